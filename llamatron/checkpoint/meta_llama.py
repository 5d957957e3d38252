"""Meta's original Llama checkpoints (`consolidated.NN.pth` + `params.json`), read as a Hugging Face model.

`MetaLlamaSource` presents Meta's tensors under Hugging Face names, so import
goes through the same rules as a Hugging Face directory. Llama 1, 2 and 3.x
(3.1+ with `use_scaled_rope`) are read. Two differences are undone here:
- model parallelism: each `consolidated.NN.pth` holds a slice of every matrix,
  by rows (column-parallel: wq, wk, wv, w1, w3, output) or by columns
  (row-parallel: wo, w2; Llama 1/2 split the embedding by columns, Llama 3 by
  rows); norms are replicated.
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
# `use_scaled_rope` (Llama 3.1+): the constants of Meta's reference code (llama-models' apply_scaling), which
# params.json does not repeat; transformers' conversion writes the same for 3.1.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_GLOBAL_NAMES = {
    "tok_embeddings.weight": ("model.embed_tokens.weight", 1),
    "norm.weight": ("model.norm.weight", None),
    "output.weight": ("lm_head.weight", 0),
}


def is_meta_checkpoint(directory: Path) -> bool:
    return (directory / "params.json").is_file() and any(directory.glob("consolidated.*.pth"))


def meta_ffn_hidden_size(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The SwiGLU width Meta's model code builds: 2/3 of 4·dim, times ffn_dim_multiplier, rounded up to
    a multiple of multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * -(-hidden // multiple_of)


def _max_positions(p: dict[str, Any], vocab: int) -> int:
    """The context the model was trained for; params.json rarely says (its max_seq_len is a runtime setting)."""
    if p.get("max_seq_len"):
        return int(p["max_seq_len"])
    if p.get("use_scaled_rope"):
        return 131072  # Llama 3.1+
    if vocab >= 128000:
        return 8192  # Llama 3 (its 128K-token vocabulary)
    return 16384 if float(p.get("rope_theta", 10000.0)) > 10000.0 else 4096  # Code Llama; Llama 2


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
        required = ("dim", "n_layers", "n_heads") + (("multiple_of",) if "multiple_of" in p else ())
        malformed = [k for k in required if not isinstance(p.get(k), int) or p[k] <= 0]
        if malformed:
            raise CheckpointError(
                f"{directory / 'params.json'}: {', '.join(malformed)} must be positive integers; re-download it"
            )
        if p.get("moe") or p.get("vision_model") or (p.get("vision_chunk_size") or -1) > 0:
            raise CheckpointError(
                f"{directory}: this Meta checkpoint (mixture of experts or vision) is not supported; "
                f"llamatron imports the text-only dense Llama 1/2/3.x models"
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
        self._check_params(directory, vocab, ffn)
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
            "rope_scaling": dict(LLAMA3_ROPE_SCALING) if p.get("use_scaled_rope") else None,
            "max_position_embeddings": _max_positions(p, vocab),
            "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def _check_params(self, directory: Path, vocab: int, ffn: int) -> None:
        """params.json describes the tensors beside it (a params.json of another size would build a model
        that does not run them correctly, or not at all)."""
        p = self.params
        want_ffn = meta_ffn_hidden_size(self.dim, p.get("multiple_of", 256), p.get("ffn_dim_multiplier"))
        problems = []
        if want_ffn != ffn:
            problems.append(
                f"dim={self.dim}, multiple_of={p.get('multiple_of', 256)}, ffn_dim_multiplier="
                f"{p.get('ffn_dim_multiplier')} give a feed-forward width of {want_ffn}, the weights have {ffn}"
            )
        if p.get("vocab_size", -1) > 0 and p["vocab_size"] != vocab:
            problems.append(f"vocab_size={p['vocab_size']}, the output layer has {vocab} rows")
        if problems:
            raise CheckpointError(
                f"{directory / 'params.json'} does not describe its consolidated.*.pth: {'; '.join(problems)}; "
                f"use the params.json that came with these weights"
            )

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


__all__ = ["LLAMA3_ROPE_SCALING", "MetaLlamaSource", "is_meta_checkpoint", "meta_ffn_hidden_size", "pairs_to_halves"]
