"""LoRA: a frozen linear plus a trained low-rank update, y = W x + (alpha / r) B A x (Hu et al. 2021).

llamatron fuses some of Hugging Face's linears ([Q; K; V], [gate; up]); LoRA adapts each of those separately (one
A and one B per q_proj, k_proj, ...), so an adapted fused linear holds one A per segment, stacked (S*r, in), and
one B row block per output row, (out, r): each output row reads only its own segment's r columns of A x. Which
rows belong to which segment comes from the family's Hugging Face weight rules (the same ones import and export
use), so any family's fused layout, reordered rows included, gets adapters that are exactly PEFT's.

Under tensor parallelism the adapters split with their linear (parallel/tensor_layers.py) and the update runs
inside its matmul, on the same input and before the same collective: a column-parallel linear (output rows
split) holds the B rows of its own rows and A whole, whose gradient is then a partial sum over the tp ranks; a
row-parallel one (input split) holds the A columns of its inputs and B whole (partial gradient), and its update
is summed over the ranks with the base's partial output, by the reduction the base already makes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor_layers import ColumnParallelLinear, RowParallelLinear

ParallelLinear = ColumnParallelLinear | RowParallelLinear


class _OneHot:
    """(rows, S): 1 where a row belongs to a segment. Kept off the module's buffers (materialising a meta-built
    model, models/init.py, leaves buffers uninitialised): one copy per device and dtype, made by `place_adapters`
    before a compiled forward reads it (made inside one, the copy would change the compiled graph between a
    checkpointed forward and its recomputation)."""

    def __init__(self, segment: torch.Tensor, segments: int):
        onehot = torch.zeros(segment.numel(), segments)
        rows = segment >= 0
        onehot[rows, segment[rows]] = 1.0
        self._master = onehot
        self._copies = {(onehot.device, onehot.dtype): onehot}

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        self._copies.setdefault((device, dtype), self._master.to(device, dtype))

    def like(self, t: torch.Tensor) -> torch.Tensor:
        self.place(t.device, t.dtype)
        return self._copies[(t.device, t.dtype)]


def b_full(lora_b: torch.Tensor, onehot: _OneHot) -> torch.Tensor:
    """B_full (rows, S*r): each row's r values of `lora_b` in the columns of its segment (rows of none: zero)."""
    return (lora_b.unsqueeze(1) * onehot.like(lora_b).unsqueeze(-1)).flatten(1)


def low_rank_update(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, onehot: _OneHot, dropout: float, training: bool):
    """B_full A dropout(x), without the scale."""
    x = F.dropout(x, dropout, training) if dropout > 0 else x
    return x @ a.to(x.dtype).t() @ b_full(b, onehot).to(x.dtype).t()


def _adapter_params(module: nn.Module, a_shape: tuple[int, int], b_shape: tuple[int, int]) -> None:
    """Register lora_a and lora_b on `module`: B zero, A as PEFT initialises it (on meta, models/init.py does,
    layout-free, by global name)."""
    device = module.get_parameter("weight").device
    a = nn.Parameter(torch.empty(a_shape, device=device))
    module.register_parameter("lora_a", a)
    module.register_parameter("lora_b", nn.Parameter(torch.zeros(b_shape, device=device)))
    if device.type != "meta":
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))


class LoraLinear(nn.Module):
    """A linear's own weight and bias (frozen, under their names: checkpoints and weight rules see the same
    tensors) plus scale * B_full A (`segment`: each output row's adapter, -1 for none). `base_matmul` computes
    the frozen part (x, weight, bias -> output): F.linear, or FP8's (training/fp8.py)."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    base_matmul: Callable[..., torch.Tensor] = staticmethod(F.linear)

    def __init__(self, base: nn.Linear, segment: torch.Tensor, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        segments = int(segment.max()) + 1
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.scale, self.dropout = rank, alpha / rank, dropout
        _adapter_params(self, (segments * rank, base.in_features), (segment.numel(), rank))
        self.onehot = _OneHot(segment, segments)

    def delta_weight(self) -> torch.Tensor:
        """What merging adds to the base weight."""
        return self.scale * b_full(self.lora_b, self.onehot) @ self.lora_a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_matmul(x, self.weight, self.bias)
        if not self.scale:  # adapters off (adapters_off)
            return base
        return base + self.scale * low_rank_update(
            x, self.lora_a, self.lora_b, self.onehot, self.dropout, self.training
        )


class LoraMatmul:
    """A tensor-parallel linear's matmul (its `linear`: x, weight[, bias] -> its local output) plus the LoRA
    update of the adapters registered on the same module, on the same local input. `inner` is the frozen part's
    matmul (the layer's own, or FP8's)."""

    def __init__(self, module: ParallelLinear, inner, onehot: _OneHot, scale: float, dropout: float):
        self.module, self.inner, self.onehot, self.scale, self.dropout = module, inner, onehot, scale, dropout

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, *bias: torch.Tensor | None) -> torch.Tensor:
        m = self.module  # its parameters read at each call: materialising replaces them
        base = self.inner(x, weight, *bias)
        if not self.scale:  # adapters off (adapters_off)
            return base
        a, b = m.get_parameter("lora_a"), m.get_parameter("lora_b")
        return base + self.scale * low_rank_update(x, a, b, self.onehot, self.dropout, m.training)


def adapt_parallel(module: ParallelLinear, segment: torch.Tensor, rank: int, alpha: float, dropout: float) -> None:
    """Add adapters to a tensor-parallel linear of the full linear whose output row i belongs to `segment[i]`."""
    segments = int(segment.max()) + 1
    if isinstance(module, ColumnParallelLinear):  # this rank's rows: their B rows and segments; A whole
        local = module.layout.local_index
        local_segment = torch.where(local >= 0, segment[local.clamp(min=0)], -1)
        a_shape, b_shape = (segments * rank, module.in_features), (module.layout.local_size, rank)
    else:  # this rank's inputs: their A columns; B whole
        local_segment = segment
        a_shape, b_shape = (segments * rank, module.layout.local_size), (module.out_features, rank)
    _adapter_params(module, a_shape, b_shape)
    module.linear = LoraMatmul(module, module.linear, _OneHot(local_segment, segments), alpha / rank, dropout)


@contextmanager
def adapters_off(chunks: Sequence[nn.Module]) -> Iterator[None]:
    """Inside, the models compute their base (every adapter's scale 0): DPO's reference pass. Nothing without
    adapters changes."""
    owners: list[LoraLinear | LoraMatmul] = []
    for m in (m for chunk in chunks for m in chunk.modules()):
        owner = m if isinstance(m, LoraLinear) else getattr(m, "linear", None)
        if isinstance(owner, (LoraLinear, LoraMatmul)):
            owners.append(owner)
    scales = [owner.scale for owner in owners]
    for owner in owners:
        owner.scale = 0.0
    try:
        yield
    finally:
        for owner, scale in zip(owners, scales):
            owner.scale = scale


def place_adapters(model: nn.Module) -> None:
    """Put each adapter's constant row map on its adapter's device and dtype: once after materialising, before
    any compiled forward."""
    for m in model.modules():
        onehot = m.onehot if isinstance(m, LoraLinear) else getattr(getattr(m, "linear", None), "onehot", None)
        if isinstance(onehot, _OneHot):
            b = m.get_parameter("lora_b")
            onehot.place(b.device, b.dtype)


__all__ = [
    "adapters_off",
    "LoraLinear",
    "LoraMatmul",
    "ParallelLinear",
    "adapt_parallel",
    "b_full",
    "low_rank_update",
    "place_adapters",
]
