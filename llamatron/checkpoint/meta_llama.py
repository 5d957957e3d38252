"""Meta's original Llama checkpoints (`consolidated.NN.pth` + `params.json`), read as a Hugging Face model.

`MetaLlamaSource` presents Meta's tensors under Hugging Face names, so import
goes through the same rules as a Hugging Face directory. Two differences are
undone here:
- model parallelism: each `consolidated.NN.pth` holds a slice of every matrix,
  by rows (column-parallel: wq, wk, wv, w1, w3, output) or by columns
  (row-parallel: wo, w2; Llama 1/2 also split the embedding by columns);
  norms are replicated.
- rotary layout: Meta rotates adjacent pairs (x[2i], x[2i+1]); Hugging Face
  (and llamatron) rotate the halves (x[i], x[i + d/2]). Rows of wq/wk are
  reordered within each head so both compute the same thing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .tensor_io import load_pickled

# Meta name (after "layers.N.") -> (Hugging Face name, dimension split across model-parallel files or None)
_LAYER_NAMES = {
    "attention.wq.weight": ("self_attn.q_proj.weight", 0),
    "attention.wk.weight": ("self_attn.k_proj.weight", 0),
    "attention.wv.weight": ("self_attn.v_proj.weight", 0),
    "attention.wo.weight": ("self_attn.o_proj.weight", 1),
    "feed_forward.w1.weight": ("mlp.gate_proj.weight", 0),
    "feed_forward.w3.weight": ("mlp.up_proj.weight", 0),
    "feed_forward.w2.weight": ("mlp.down_proj.weight", 1),
    "attention_norm.weight": ("input_layernorm.weight", None),
    "ffn_norm.weight": ("post_attention_layernorm.weight", None),
}
_GLOBAL_NAMES = {
    "tok_embeddings.weight": ("model.embed_tokens.weight", 1),
    "norm.weight": ("model.norm.weight", None),
    "output.weight": ("lm_head.weight", 0),
}


def is_meta_checkpoint(directory: Path) -> bool:
    return (directory / "params.json").is_file() and any(directory.glob("consolidated.*.pth"))


def pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection from Meta's rotary layout (pairs) to the half-split one, head by head."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


class MetaLlamaSource:
    """The tensors of a Meta checkpoint directory under Hugging Face names; `hf_config` describes them."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        self.params: dict[str, Any] = json.loads((directory / "params.json").read_text())
        files = sorted(directory.glob("consolidated.*.pth"))
        self.shards = [load_pickled(f) for f in files]
        p = self.params
        if p.get("use_scaled_rope") or p.get("moe"):
            raise CheckpointError(
                f"{directory}: this Meta checkpoint (Llama 3.1+ scaled rope or MoE) is not "
                f"supported; convert it with transformers' script and import that directory"
            )
        self.heads, self.dim = p["n_heads"], p["dim"]
        self.kv_heads = p.get("n_kv_heads") or self.heads
        self._names: dict[str, tuple[str, int | None]] = {v[0]: (k, v[1]) for k, v in _GLOBAL_NAMES.items()}
        for i in range(p["n_layers"]):
            for meta_name, (hf_name, dim) in _LAYER_NAMES.items():
                self._names[f"model.layers.{i}.{hf_name}"] = (f"layers.{i}.{meta_name}", dim)
        for meta_name, _ in self._names.values():
            missing = [f.name for f, s in zip(files, self.shards) if meta_name not in s]
            if missing:
                raise CheckpointError(f"{directory}: {meta_name} is missing from {', '.join(missing)}")
        vocab = self.meta("lm_head.weight").shape[0]  # params.json often says -1
        ffn = self.meta("model.layers.0.mlp.gate_proj.weight").shape[0]
        dtype = self.shards[0]["norm.weight"].dtype
        self.hf_config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": self.dim,
            "intermediate_size": ffn,
            "num_hidden_layers": p["n_layers"],
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "hidden_act": "silu",
            "rms_norm_eps": p.get("norm_eps", 1e-5),
            "rope_theta": float(p.get("rope_theta", 10000.0)),
            "max_position_embeddings": p.get("max_seq_len", 4096),
            "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def keys(self) -> set[str]:
        return set(self._names)

    def _split_dim(self, hf_name: str) -> int | None:
        meta_name, dim = self._names[hf_name]
        if meta_name == "tok_embeddings.weight" and len(self.shards) > 1:
            # Llama 1/2 split the embedding by columns (ParallelEmbedding), Llama 3 by rows.
            dim = 1 if self.shards[0][meta_name].shape[1] * len(self.shards) == self.dim else 0
        return dim if len(self.shards) > 1 else None

    def meta(self, hf_name: str) -> torch.Tensor:
        meta_name = self._names[hf_name][0]
        first = self.shards[0][meta_name]
        shape = list(first.shape)
        dim = self._split_dim(hf_name)
        if dim is not None:
            shape[dim] = sum(s[meta_name].shape[dim] for s in self.shards)
        return torch.empty(shape, dtype=first.dtype, device="meta")

    def get(self, hf_name: str) -> torch.Tensor:
        meta_name = self._names[hf_name][0]
        dim = self._split_dim(hf_name)
        parts = [s[meta_name] for s in self.shards]
        full = parts[0] if dim is None else torch.cat(parts, dim=dim)
        if hf_name.endswith("q_proj.weight"):
            return pairs_to_halves(full, self.heads)
        if hf_name.endswith("k_proj.weight"):
            return pairs_to_halves(full, self.kv_heads)
        return full


__all__ = ["MetaLlamaSource", "is_meta_checkpoint", "pairs_to_halves"]
