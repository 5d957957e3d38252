"""--base-precision nf4: LoRA on a frozen base held as NF4 (QLoRA, Dettmers et al. 2023), by torchao's NF4 tensor.

torchao's `to_nf4` quantises a weight in blocks of 64 values (each block: 4-bit codes of the NormalFloat table
times its absmax) and the absmaxes again, in groups of 256, to int8 around their mean (double quantisation):
0.5 byte per weight, 1 byte per 64 weights, a factor per 16,384, and a mean and the 16-value table per tensor. Its
`get_original_weight` dequantises, and its linear (`LinearNF4`) multiplies by that dequantised weight in forward
and again in backward, giving the input its gradient and the weight none.

Each Hugging Face tensor of a fused linear ([q; k; v], [gate; up]) is quantised on its own, so the blocks, the
double-quantised scales and their mean are those of transformers + PEFT's QLoRA model on the same weights. The
frozen linears of the decoder layers are quantised, adapted or not; the embedding, norms, output head and a
mixture of experts' router and grouped experts stay as they are, as does a linear with a tensor that is not a whole
number of 16,384-weight groups. It happens after the base is loaded, so the dense copy is freed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..checkpoint.reader import BASE_KEY
from ..errors import ConfigError
from ..models import ModelConfig, build_model
from ..models.moe import MoE, SharedExpert
from .lora import LoraLinear
from .targets import ALL_LINEAR, find_targets

BLOCK, SCALER_BLOCK = 64, 256  # torchao's to_nf4 defaults, QLoRA's
GROUP = BLOCK * SCALER_BLOCK  # a quantised tensor is a whole number of these


def torchao_missing() -> bool:
    return importlib.util.find_spec("torchao") is None


def nf4_problems(
    precision: str, lora_rank: int, load: str | None, save: str | None, layout: dict[str, int], fsdp: bool, fp8: str
) -> list[str]:
    """--base-precision nf4's rules, before any memory is spent (`layout`: tp, pp, cp, ep)."""
    if precision != "nf4":
        return []
    if lora_rank == 0:
        return ["--base-precision nf4 stores LoRA's frozen base in 4 bits, but --lora-rank is 0: give --lora-rank R"]
    if torchao_missing():
        return ["--base-precision nf4 needs torchao's NF4 tensor: pip install 'llamatron[qlora]'"]
    if save and not load:  # the saves hold only the adapters and name the loaded checkpoint as their base
        return [
            "--base-precision nf4 saves only the adapters, naming the loaded checkpoint as their base: give --load "
            "CHECKPOINT (e.g. --finetune of an import), or no --save"
        ]
    # pp: each stage quantises its layers' whole tensors (tested); tp and FSDP would quantise each rank's shard
    split = [f"--{k} {v}" for k, v in layout.items() if v > 1 and k != "pp"] + (["--fsdp"] if fsdp else [])
    if split:
        return [
            f"--base-precision nf4 with {' '.join(split)} is not supported yet (under tp and FSDP each rank would "
            "quantise its own shard, whose scales differ from the whole tensor's; cp and ep are untried): run it "
            "on one rank or with --dp or --pp"
        ]
    if fp8 != "none":
        return [f"--base-precision nf4 and --fp8 {fp8} both replace the base's matmul: drop one"]
    return []


@dataclass
class NF4Weight:
    """A frozen weight as NF4 tensors, one per Hugging Face tensor: `parts` are (its rows, its NF4 tensor)."""

    parts: list[tuple[torch.Tensor, Any]]  # torchao's NF4Tensor (imported only where used: an optional extra)
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """torchao's dequantisation of each part, in its rows of the fused weight."""
        first = self.parts[0][1]
        out = torch.empty(self.shape, dtype=first.dtype, device=first.device)
        for rows, nf4 in self.parts:
            out[rows] = nf4.get_original_weight()
        return out

    def nbytes(self) -> int:
        """What torchao's tensors of this weight hold."""
        return sum(t.numel() * t.element_size() for _, nf4 in self.parts for t in _inner(nf4))


def _inner(nf4: Any) -> list[torch.Tensor]:
    names, _ = nf4.__tensor_flatten__()
    return [getattr(nf4, n) for n in names]


def nf4_bytes(numel: int, itemsize: int) -> int:
    """What torchao's NF4 tensor of `numel` weights (of `itemsize` bytes) holds: two 4-bit codes a byte, an int8
    scale per block of 64, a quantisation factor per 256 scales, their mean and the 16-value NormalFloat table
    (those three in the weight's dtype)."""
    return numel // 2 + numel // BLOCK + itemsize * (numel // GROUP + 1 + 16)


def nf4_base_bytes(cfg: ModelConfig, itemsize: int, layers: Collection[int] | None = None) -> tuple[int, int]:
    """(what a model's NF4 linears hold, what the same weights hold dense at `itemsize` bytes a weight); `layers`:
    those of these decoder layers only (a pipeline stage's)."""
    rows, model = fused_rows(cfg), build_model(cfg, device="meta")
    names = [n for n in quantizable(model, rows) if layers is None or int(n.split(".")[1]) in layers]
    numels = [len(r) * model.get_submodule(n).get_parameter("weight").shape[1] for n in names for r in rows[n]]
    return sum(nf4_bytes(n, itemsize) for n in numels), itemsize * sum(numels)


class _NF4Linear(torch.autograd.Function):
    """x W^T: the dequantised weight is made in forward and again in backward, never saved (LinearNF4's way); the
    input gets its gradient, the weight none."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: NF4Weight) -> torch.Tensor:
        ctx.weight = weight
        return x @ weight.dequantize().to(x.dtype).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.weight.dequantize().to(grad.dtype), None


@torch.compiler.disable  # a compiled layer runs it eagerly: its weight is no tensor for the compiler to trace
def nf4_linear(x: torch.Tensor, weight: NF4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A LoraLinear's `base_matmul` over an NF4 weight (the bias added as torchao's F.linear on NF4 adds it)."""
    out = _NF4Linear.apply(x, weight)
    return out if bias is None else out + bias


class NF4Linear(nn.Module):
    """A frozen nn.Linear whose weight is NF4 (the module that replaces it: same name, no weight parameter)."""

    def __init__(self, weight: NF4Weight, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.weight, self.bias)


def fused_rows(cfg: ModelConfig) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each decoder linear's rows per Hugging Face tensor (adapters/targets.py's weight-rule split)."""
    return {t.module: t.rows for t in find_targets(build_model(cfg, device="meta"), cfg, [ALL_LINEAR])}


def quantizable(model: nn.Module, rows: dict[str, tuple[torch.Tensor, ...]]) -> list[str]:
    """The linears of `model` (frozen under LoRA) that become NF4: every decoder linear with weight rules, but a
    router or a shared expert's gate, whose every Hugging Face tensor is a whole number of groups."""
    kept = {id(m.router) for m in model.modules() if isinstance(m, MoE)}
    kept |= {id(m.gate) for m in model.modules() if isinstance(m, SharedExpert) and m.gate is not None}
    out = []
    for name, m in model.named_modules():
        if name in rows and id(m) not in kept and isinstance(m, (nn.Linear, LoraLinear)):
            width = m.get_parameter("weight").shape[1]
            if all(len(r) * width % GROUP == 0 for r in rows[name]):
                out.append(name)
    return out


@torch.no_grad()
def quantize(weight: torch.Tensor, rows: Sequence[torch.Tensor]) -> NF4Weight:
    """`weight` (out, in) as NF4, each Hugging Face tensor (its `rows`) on its own."""
    if torchao_missing():
        raise ConfigError("an NF4 base (--base-precision nf4) needs torchao: pip install 'llamatron[qlora]'")
    from torchao.quantization import to_nf4

    parts = [(r.to(weight.device), to_nf4(weight[r.to(weight.device)].contiguous(), BLOCK, SCALER_BLOCK)) for r in rows]
    return NF4Weight(parts, (weight.shape[0], weight.shape[1]))


def quantize_base(model: nn.Module, cfg: ModelConfig, rows: dict[str, tuple[torch.Tensor, ...]]) -> set[int]:
    """Make `model`'s frozen decoder linears NF4 in place (`rows`: fused_rows); returns the ids of the dense
    weights it let go."""
    gone = set()
    for name in quantizable(model, rows):
        m = model.get_submodule(name)
        weight = m.get_parameter("weight")
        nf4 = quantize(weight.detach(), rows[name])
        gone.add(id(weight))
        if isinstance(m, LoraLinear):  # its base_matmul is the only reader of its weight
            del m.weight
            m.weight = nf4  # type: ignore[assignment]
            m.base_matmul = nf4_linear
        else:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, NF4Linear(nf4, cast(nn.Linear, m).bias))
    return gone


def quantize_frozen(precision: str, chunks: Sequence[nn.Module], cfg: ModelConfig, frozen: list) -> None:
    """--base-precision nf4 on a run's model chunks, whose loaded frozen weights are `frozen` ((parameter, spec)
    pairs): it keeps those still dense, which the saves and loads keep (the NF4 ones are the base checkpoint's)."""
    if precision != "nf4":
        return
    rows = fused_rows(cfg)
    gone = set().union(*(quantize_base(chunk, cfg, rows) for chunk in chunks))
    frozen[:] = [(p, spec) for p, spec in frozen if id(p) not in gone]


def check_nf4_saves(precision: str, save: str | None, inherited: dict) -> None:
    """An NF4 run's saves must name a base checkpoint (they hold no frozen weights): a LoRA checkpoint that holds
    its base itself has none to name."""
    if precision == "nf4" and save and BASE_KEY not in inherited:
        raise ConfigError(
            "--base-precision nf4: the loaded checkpoint holds its frozen base itself, which an NF4 run cannot save "
            "again; --finetune --load the plain model's checkpoint it was trained from"
        )


__all__ = [
    "BLOCK",
    "GROUP",
    "NF4Linear",
    "NF4Weight",
    "SCALER_BLOCK",
    "check_nf4_saves",
    "fused_rows",
    "nf4_base_bytes",
    "nf4_bytes",
    "nf4_linear",
    "nf4_problems",
    "quantize",
    "quantize_base",
    "quantize_frozen",
    "quantizable",
    "torchao_missing",
]
