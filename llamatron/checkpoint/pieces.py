"""Where a rank's part of a parameter lies in the full tensor: boxes and pieces, the vocabulary of the format.

A *box* is a rectangular block of a full tensor (the unpadded tensor of the
single-device model): offsets and sizes per dimension. A checkpoint stores
every tensor as pieces, each one box, written by the one rank that was
responsible for it; a reader of any layout asks for the boxes it needs and
gets them from whichever pieces overlap them.

A rank's local tensor maps to full boxes in two steps:

1. a flat range of the local tensor (a distributed-optimizer segment, or the
   whole tensor) is cut into *blocks*, each contiguous in memory and
   rectangular in local coordinates (a partial first row, whole rows, a
   partial last row);
2. along the tensor-parallel dimension a block is cut into *runs* of
   consecutive full indices (ShardLayout.local_index): a rank's fused QKV rows
   are three runs, vocabulary padding rows (index -1) belong to no run.

Both steps are arithmetic on the layout, so every rank computes its pieces
without talking to the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..parallel.param_spec import ParamSpec


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def whole(shape: tuple[int, ...]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(shape))

    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def slices_within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box inside the tensor holding `outer`."""
        return tuple(slice(o - p, o - p + s) for o, s, p in zip(self.offsets, self.sizes, outer.offsets))


@dataclass(frozen=True)
class LocalPiece:
    """One full-tensor box of a flat range of a local tensor: `view(flat)` is its data."""

    box: Box  # where it lies in the full tensor
    flat_start: int  # start of its contiguous block, relative to the flat range
    block_shape: tuple[int, ...]
    dim: int  # the piece is block.narrow(dim, start, length)
    start: int
    length: int

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        n = math.prod(self.block_shape)
        block = flat[self.flat_start : self.flat_start + n].view(self.block_shape)
        return block.narrow(self.dim, self.start, self.length)


Block = tuple[int, tuple[int, ...], tuple[int, ...]]  # flat start, offsets, sizes


def contiguous_blocks(shape: tuple[int, ...], start: int, end: int) -> list[Block]:
    """The flat range [start, end) of a row-major tensor as (flat start, offsets, sizes) blocks, in order."""
    if start >= end:
        return []
    if len(shape) == 1:
        return [(start, (start,), (end - start,))]
    inner = math.prod(shape[1:])
    out = []

    def partial_row(row: int, lo: int, hi: int) -> None:
        for flat, offsets, sizes in contiguous_blocks(shape[1:], lo, hi):
            out.append((row * inner + flat, (row, *offsets), (1, *sizes)))

    if start % inner:
        row = start // inner
        stop = min(end, (row + 1) * inner)
        partial_row(row, start - row * inner, stop - row * inner)
        start = stop
    whole_rows = (end - start) // inner
    if whole_rows:
        out.append((start, (start // inner, *(0 for _ in shape[1:])), (whole_rows, *shape[1:])))
        start += whole_rows * inner
    if start < end:
        partial_row(start // inner, 0, end - start)  # start is at a row boundary here
    return out


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local start, length, full start) of each run of consecutive full indices; -1 entries are skipped."""
    if len(index) == 0:
        return []
    breaks = (index[1:] != index[:-1] + 1) | (index[1:] < 0) | (index[:-1] < 0)
    starts = [0, *(breaks.nonzero().flatten() + 1).tolist(), len(index)]
    return [(s, e - s, int(index[s])) for s, e in zip(starts[:-1], starts[1:]) if index[s] >= 0]


def local_pieces(spec: ParamSpec, start: int, end: int, owned_only: bool) -> list[LocalPiece]:
    """Pieces of the flat range [start, end) of the local tensor of the parameter `spec` describes.

    owned_only: leave out rows another tensor-parallel rank is responsible for
    (replicated KV heads are written by their lowest holder); a reader wants them too.
    """
    shape = spec.local_shape or (1,)
    layout = spec.tp_layout
    index = None
    if layout is not None:
        index = layout.local_index.clone()
        if owned_only and len(layout.not_owned_positions):
            index[layout.not_owned_positions] = -1
    pieces = []
    first_expert = spec.expert_shard[0] if spec.expert_shard is not None else 0  # local expert 0 in the full tensor
    for flat, local_offsets, sizes in contiguous_blocks(shape, start, end):
        offsets = (local_offsets[0] + first_expert, *local_offsets[1:])
        if index is None or layout is None:
            pieces.append(LocalPiece(Box(offsets, sizes), flat - start, sizes, 0, 0, sizes[0]))
            continue
        d = layout.dim
        for local, length, full in _runs(index[local_offsets[d] : local_offsets[d] + sizes[d]]):
            box = Box(
                tuple(full if i == d else o for i, o in enumerate(offsets)),
                tuple(length if i == d else s for i, s in enumerate(sizes)),
            )
            pieces.append(LocalPiece(box, flat - start, sizes, d, local, length))
    return pieces


__all__ = ["Box", "LocalPiece", "contiguous_blocks", "local_pieces"]
