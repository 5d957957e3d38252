"""A LoRA checkpoint read as the model it stands for: each adapted weight merged, W + (alpha / r) B A.

A LoRA run saves its frozen base weights under their own names and the adapters beside them (`NAME.lora_a`,
`NAME.lora_b`, llamatron/adapters/lora.py). export-hf, generate and verify read weights through a CheckpointReader;
`open_model_weights` gives them one whose adapted weights come back merged and whose adapters are gone, so they
work on a LoRA checkpoint unchanged. Which rows of a fused weight each adapter covers is recomputed from the run's
saved --lora-targets (adapters/targets.py), as training applied them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.pieces import Box
from ..checkpoint.reader import CheckpointReader, read_meta, resolve_checkpoint, saved_lora_settings
from ..errors import CheckpointError
from ..models import build_model, config_from_dict
from .nf4 import fused_rows, quantizable, quantize
from .targets import LoraTarget, find_targets, requested

ADAPTER_SUFFIXES = (".lora_a", ".lora_b")
ADAPTER_KIND = "adapter"  # where a merged reader keeps the adapters


@dataclass(frozen=True)
class SavedLora:
    """The adapters a checkpoint was trained with: rank, alpha and the adapted linears."""

    rank: int
    alpha: float
    targets: tuple[LoraTarget, ...]
    # --base-precision nf4: each NF4 weight's rows per Hugging Face tensor, and the dtype it was quantised in
    nf4: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    nf4_dtype: torch.dtype = torch.float32

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def saved_lora(run_meta: dict[str, Any]) -> SavedLora | None:
    """The LoRA settings of a checkpoint's meta.json (None for a checkpoint trained without LoRA)."""
    lora = saved_lora_settings(run_meta)
    if not lora.get("lora_rank"):
        return None
    cfg = config_from_dict(run_meta["model_config"])
    model = build_model(cfg, device="meta")
    targets = find_targets(model, cfg, requested(lora["lora_targets"]))
    nf4, dtype = {}, torch.float32
    if lora.get("base_precision") == "nf4":  # the base as trained: NF4, in the run's dtype
        rows = fused_rows(cfg)
        nf4 = {f"{name}.weight": rows[name] for name in quantizable(model, rows)}
        dtype = getattr(torch, run_meta["layout"]["dtype"])
    return SavedLora(int(lora["lora_rank"]), float(lora["lora_alpha"]), tuple(targets), nf4, dtype)


def lora_update(a: torch.Tensor, b: torch.Tensor, target: LoraTarget, rank: int) -> torch.Tensor:
    """B_full A of one adapted linear (out, in), in fp32: each adapter's rows are its B rows times its A."""
    a, b = a.float(), b.float()
    update = torch.zeros(b.shape[0], a.shape[1])
    for s, rows in enumerate(target.rows):
        update[rows] = b[rows] @ a[s * rank : (s + 1) * rank]
    return update


class MergedLoraReader(CheckpointReader):
    """A LoRA checkpoint's weights with the adapters merged in: the model names and shapes of the plain model."""

    merges_adapters = True

    def __init__(self, path: str | Path, lora: SavedLora):
        super().__init__(path)
        self.lora = lora
        self._targets = {f"{t.module}.weight": t for t in lora.targets}
        models = self.tensors["model"]
        # Out of the model's names, kept readable as their own kind (a piece's stored key does not change).
        self.tensors[ADAPTER_KIND] = {n: models.pop(n) for n in [n for n in models if n.endswith(ADAPTER_SUFFIXES)]}
        self._merged: dict[str, torch.Tensor] = {}  # a tensor-parallel load reads one box at a time

    def adapter(self, name: str) -> torch.Tensor:
        """An adapter tensor, from the fp32 master copy when the run kept one (mixed precision)."""
        if self.has("master", name):
            return super().read("master", name)
        return super().read(ADAPTER_KIND, name)

    def read(self, kind: str, name: str, box: Box | None = None) -> torch.Tensor:
        if kind != "model" or (name not in self._targets and name not in self.lora.nf4):
            return super().read(kind, name, box)
        if name not in self._merged:
            weight = super().read(kind, name)
            merged = self._base(name, weight).float()
            if name in self._targets:
                module, t = name.removesuffix(".weight"), self._targets[name]
                a, b = (self.adapter(f"{module}{s}") for s in ADAPTER_SUFFIXES)
                merged += self.lora.scale * lora_update(a, b, t, self.lora.rank)
            self._merged[name] = merged.to(weight.dtype)
        merged = self._merged[name]
        return merged if box is None else merged[box.slices_within(Box.whole(tuple(merged.shape)))].clone()

    def _base(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The frozen weight the adapters were trained on: an NF4 base's dequantised (adapters/nf4.py)."""
        rows = self.lora.nf4.get(name)
        return weight if rows is None else quantize(weight.to(self.lora.nf4_dtype), rows).dequantize()


class LoraBaseReader(MergedLoraReader):
    """A LoRA checkpoint's frozen base weights, its adapters left out (export-hf --without-adapters)."""

    def read(self, kind: str, name: str, box: Box | None = None) -> torch.Tensor:
        return CheckpointReader.read(self, kind, name, box)


def open_base_weights(path: str | Path) -> LoraBaseReader:
    """The weights a LoRA checkpoint was trained on, without its adapters."""
    lora = saved_lora(read_meta(path))
    if lora is None:
        raise CheckpointError(f"{resolve_checkpoint(path)} holds no LoRA adapters; drop --without-adapters")
    return LoraBaseReader(path, lora)


def open_model_weights(path: str | Path) -> CheckpointReader:
    """The weights of any checkpoint as the plain model's: a LoRA checkpoint's adapters merged into its base."""
    lora = saved_lora(read_meta(path))  # meta.json alone: the checkpoint (and any base) is opened once, below
    return CheckpointReader(path) if lora is None else MergedLoraReader(path, lora)


__all__ = [
    "ADAPTER_KIND",
    "ADAPTER_SUFFIXES",
    "LoraBaseReader",
    "MergedLoraReader",
    "SavedLora",
    "lora_update",
    "open_base_weights",
    "open_model_weights",
    "saved_lora",
]
