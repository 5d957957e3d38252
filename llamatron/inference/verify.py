"""The check that the Hugging Face round trip is exact (`llamatron verify`): a checkpoint's logits against
transformers' own implementation on the same random batches."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..dtypes import DTYPES
from .generate import load_for_generation

# Mean absolute logit difference allowed by `verify`, per precision. bf16: the seeds' documented bar.
DEFAULT_TOLERANCE = {"fp32": 1e-4, "bf16": 0.1}


def load_transformers_model(hf_dir: str, dtype: torch.dtype, device: str = "cpu"):
    import transformers

    dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", **{dtype_arg: dtype})
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs type .to() wrongly


@torch.no_grad()
def compare_with_hf(
    ckpt: str,
    hf_dir: str,
    dtype_name: str = "fp32",
    batches: int = 4,
    batch_size: int = 2,
    seq_length: int | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """Both implementations on the same random batches: per-batch and overall logit and loss differences."""
    dtype = DTYPES[dtype_name]
    model, _ = load_for_generation(ckpt, device)
    model = model.to(dtype)
    hf_model = load_transformers_model(hf_dir, dtype, device)
    vocab = min(hf_model.config.vocab_size, model.cfg.vocab_size)  # padded rows are not compared
    seq = seq_length or min(128, model.cfg.max_seq_length, hf_model.config.max_position_embeddings)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batches):
        tokens = torch.randint(0, vocab, (batch_size, seq), generator=gen).to(device)
        ours = model(tokens)[..., :vocab].float()
        theirs = hf_model(tokens).logits[..., :vocab].float()
        diff = (ours - theirs).abs()
        losses = [
            F.cross_entropy(x[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1)).item() for x in (ours, theirs)
        ]
        rows.append(
            {
                "batch": b,
                "max_abs": diff.max().item(),
                "mean_abs": diff.mean().item(),
                "loss_llamatron": losses[0],
                "loss_hf": losses[1],
                "loss_diff": abs(losses[0] - losses[1]),
            }
        )
    return {
        "rows": rows,
        "max_abs": max(r["max_abs"] for r in rows),
        "mean_abs": sum(r["mean_abs"] for r in rows) / len(rows),
        "loss_diff": max(r["loss_diff"] for r in rows),
        "seq_length": seq,
        "vocab": vocab,
    }


__all__ = ["DEFAULT_TOLERANCE", "compare_with_hf", "load_transformers_model"]
