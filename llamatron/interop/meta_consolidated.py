"""Meta's original checkpoints (`consolidated.NN.pth` + `params.json`), read as a Hugging Face model.

`MetaSource` presents Meta's tensors under Hugging Face names, so import goes
through the same rules as a Hugging Face directory. The names and config.json
come from the family that has a Meta format (models/families/llama/foreign.py:
Llama 1, 2 and 3.x, 3.1+ with `use_scaled_rope`). Two differences are undone here:
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

from ..checkpoint.tensor_io import load_pickled
from ..errors import CheckpointError
from ..models.families import meta_format
from ..models.family import MetaFormat


def is_meta_checkpoint(directory: Path) -> bool:
    return (directory / "params.json").is_file() and any(directory.glob("consolidated.*.pth"))


def pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection from Meta's rotary layout (pairs) to the half-split one, head by head."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _format(directory: Path) -> MetaFormat:
    fmt = meta_format()
    if fmt is None:
        raise CheckpointError(f"{directory}: a Meta consolidated checkpoint, which no model family here reads")
    return fmt


def _check_slices(directory: Path, name: str, slices: list[Any], dim: int | None) -> None:
    """Each file's slice of one tensor: a 2-D (or, for norms, 1-D) tensor, all the same shape but for the split dim."""
    want = 1 if dim is None else 2
    if any(not isinstance(t, torch.Tensor) or t.dim() != want for t in slices):
        raise CheckpointError(f"{directory}: {name} is not a {want}-D tensor in every consolidated.*.pth")
    if dim is not None and len(slices) > 1 and len({t.shape[1 - dim] for t in slices}) > 1:
        raise CheckpointError(f"{directory}: the consolidated.*.pth slices of {name} differ in shape; re-download them")


class MetaSource:
    """The tensors of a Meta checkpoint directory under Hugging Face names; `hf_config` describes them."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        fmt = _format(directory)
        # a JSON object: checked with the directory's other JSON files (hf_files.py)
        self.params: dict[str, Any] = json.loads((directory / "params.json").read_text(encoding="utf-8"))
        p = self.params
        problems = fmt.field_problems(p)
        if problems:
            raise CheckpointError(f"{directory / 'params.json'}: {'; '.join(problems)}; re-download it")
        files = sorted(directory.glob("consolidated.*.pth"))
        self.shards = [load_pickled(f) for f in files]
        if p.get("moe") or p.get("vision_model") or (p.get("vision_chunk_size") or -1) > 0:
            raise CheckpointError(
                f"{directory}: this Meta checkpoint (mixture of experts or vision) is not supported; "
                f"llamatron imports the text-only dense Llama 1/2/3.x models"
            )
        self.heads, self.dim = p["n_heads"], p["dim"]
        self.kv_heads = p.get("n_kv_heads") or self.heads
        self._names: dict[str, tuple[str, int | None]] = {v[0]: (k, v[1]) for k, v in fmt.global_names.items()}
        for i in range(p["n_layers"]):
            for meta_name, (hf_name, dim) in fmt.layer_names.items():
                self._names[f"model.layers.{i}.{hf_name}"] = (f"layers.{i}.{meta_name}", dim)
        for meta_name, dim in self._names.values():
            missing = [f.name for f, s in zip(files, self.shards) if meta_name not in s]
            if missing:
                raise CheckpointError(f"{directory}: {meta_name} is missing from {', '.join(missing)}")
            _check_slices(directory, meta_name, [s[meta_name] for s in self.shards], dim)
        vocab = self.meta("lm_head.weight").shape[0]  # params.json often says -1
        ffn = self.meta("model.layers.0.mlp.gate_proj.weight").shape[0]
        problems = fmt.params_problems(p, vocab, ffn)
        if problems:  # a params.json of another size would build a model that does not run these weights
            raise CheckpointError(
                f"{directory / 'params.json'} does not describe its consolidated.*.pth: {'; '.join(problems)}; "
                f"use the params.json that came with these weights"
            )
        dtype = self.shards[0]["norm.weight"].dtype
        self.hf_config = fmt.hf_config(p, vocab, ffn, str(dtype).removeprefix("torch."))

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


__all__ = ["MetaSource", "is_meta_checkpoint", "pairs_to_halves"]
