"""What every optimizer shares: the segments of the flat buffers this rank updates, their fp32 master weights, the
global gradient norm, clipping and fp16 unscaling, and what checkpoints read (`state`, `steps`).

An optimizer keeps, per segment, flat fp32 state tensors by kind (`state(i)`: AdamW's two moments, Muon's momentum),
each the same length as the segment, so the checkpoint writer stores them like the weights and any layout reads
them back (checkpoint/ iterates the kinds; only the optimizer's module names them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.fsdp import Buffer, owned_ranges
from ..parallel.mesh import Mesh, all_reduce
from ..parallel.param_spec import ParamSpec


@dataclass
class Segment:
    """The part of one parameter that this rank updates."""

    param: nn.Parameter
    spec: ParamSpec
    buffer: Buffer
    start: int  # in the buffer
    end: int
    param_offset: int  # where the segment starts inside the flattened parameter
    decay: bool
    count_in_norm: bool  # False for tensor-parallel replicas on tp_rank > 0 and the tied head (counted once)


class SegmentOptimizer:
    """The segments, master weights, step counts and gradient norm; subclasses keep their state and `step`."""

    hidden: frozenset[str] = frozenset()  # global names of the matrices it treats apart (Muon's), for bytes_per_param

    def __init__(
        self,
        buffers: list[Buffer],
        mesh: Mesh,
        clip_grad: float,
        distributed: bool,
        shard_group: dist.ProcessGroup | None = None,
    ):
        """shard_group: the ranks whose shards together hold every element once (default the replica group;
        hybrid sharding's shard group)."""
        self.buffers, self.mesh, self.clip_grad = buffers, mesh, clip_grad
        self.shard_group = mesh.replica_group if shard_group is None else shard_group
        self.distributed = distributed and mesh.layout.replicas > 1
        self.segments: list[Segment] = []
        for buf in buffers:
            for p, s, e, start in owned_ranges(buf):
                spec = buf.spec_of[p]
                replicated_copy = (mesh.tp_rank > 0 and not spec.split_over_tp) or spec.shared_replica
                self.segments.append(
                    Segment(p, spec, buf, s, e, s - start, decay=p.ndim > 1, count_in_norm=not replicated_copy)
                )
        self.device = buffers[0].grad_data.device
        self.master_is_param = buffers[0].param_data.dtype == torch.float32
        self.master = [self._master_view(seg) for seg in self.segments]
        self.steps = [torch.zeros((), device=self.device) for _ in self.segments]

    def _master_view(self, seg: Segment) -> torch.Tensor:
        data = seg.buffer.param_data[seg.buffer.local(seg.start, seg.end)]
        return data if data.dtype == torch.float32 else data.float()

    def _zeros(self, keep: set[int]) -> list[torch.Tensor]:
        """A zero fp32 state tensor per segment, the segment's length for those in `keep`, else empty."""
        return [
            torch.zeros(seg.end - seg.start if i in keep else 0, device=self.device)
            for i, seg in enumerate(self.segments)
        ]

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """Segment i's state tensors by kind (flat, the segment's length), as checkpoints store them."""
        raise NotImplementedError

    def step(self, lr: float, loss_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale (fp16: gradients arrive multiplied by `loss_scale`), clip, update, skipping the update when the
        gradients are not finite. Returns (grad_norm, found_inf) as device tensors."""
        raise NotImplementedError

    def grads(self) -> list[torch.Tensor]:
        return [seg.buffer.grad_data[seg.buffer.local(seg.start, seg.end)] for seg in self.segments]

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm over all data-, tensor- and pipeline-parallel shards, replicas counted once."""
        dense = self._squares(False)
        experts = self._squares(True)  # each expert-parallel rank holds other experts: summed over the ep group
        if self.distributed:  # every element is one replica's (dp x cp): experts' shards and ep ranks alike
            sq = all_reduce(dense + experts, self.shard_group)
        else:
            sq = dense + all_reduce(experts, self.mesh.ep_group)
        all_reduce(sq, self.mesh.mp_group)
        return sq.sqrt().float()

    def _squares(self, experts: bool) -> torch.Tensor:
        """The sum of squares of this rank's counted gradients of expert (or dense) parameters."""
        counted = [
            part
            for g, seg in zip(self.grads(), self.segments)
            if seg.count_in_norm and seg.spec.is_expert == experts
            for part in _norm_parts(g, seg)
        ]
        # Accumulated in float64: torch's CPU fp32 norm adds the squares one after another in fp32 (relative error
        # 1.7e-4 on llama-test's 524k-element head gradient), a different error for each way a layout shards a
        # gradient. On CUDA float64 costs nothing (8.2 vs 8.1 ms for Llama 2 7B's gradients on an H200).
        if not counted:
            return torch.zeros((), device=self.device, dtype=torch.float64)
        return torch.stack(torch._foreach_norm([g.float() for g in counted], 2, dtype=torch.float64)).pow(2).sum()

    def norm_and_scale(self, loss_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(grad norm, found_inf, grad_scale): the true gradient is the stored one divided by grad_scale (None: 1),
        which holds clipping and fp16 unscaling; computed on device, no host sync."""
        norm = self.grad_norm()
        if loss_scale is not None:
            norm = norm / loss_scale
        found_inf = (~torch.isfinite(norm)).float()
        coef = None
        if self.clip_grad > 0:  # scale only when above the threshold
            coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
            coef = torch.where(torch.isfinite(coef), coef, torch.ones_like(coef))
        if loss_scale is not None:
            coef = (1.0 / loss_scale) if coef is None else coef / loss_scale
        return norm, found_inf, None if coef is None else (1.0 / coef).float().reshape(())

    def write_back(self, indices: list[int]) -> None:
        """Copy the updated fp32 master weights of these segments into the model's (bf16/fp16) weights."""
        if self.master_is_param:
            return
        for i in indices:
            seg = self.segments[i]
            seg.buffer.param_data[seg.buffer.local(seg.start, seg.end)].copy_(self.master[i])

    def publish_params(self, overlap: bool) -> None:
        """Make every rank's parameters whole again (distributed optimizer only)."""
        for buf in self.buffers:
            buf.start_param_gather(overlap)

    def bytes_per_param(self) -> float:
        """Weights + gradients + optimizer state allocated on this rank, per model parameter of this rank.

        Buffers are padded to data-parallel-divisible buckets, so this exceeds the formula by at most
        18 bytes per padding element.
        """
        n = sum(p.numel() for b in self.buffers for p in b.param_range)
        weights = sum(b.param_data.numel() * b.param_data.element_size() for b in self.buffers)
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in self.buffers)
        state = sum(t.numel() * t.element_size() for i in range(len(self.segments)) for t in self.state(i).values())
        if not self.master_is_param:
            state += sum(m.numel() * 4 for m in self.master)
        return (weights + grads + state) / n


def _norm_parts(grad: torch.Tensor, seg: Segment) -> list[torch.Tensor]:
    """The views of a segment's gradient this rank counts in the norm.

    `ParamSpec.norm_exclude` lists flat element ranges of the parameter that
    another tensor-parallel rank counts (replicated KV heads).
    """
    parts, pos, end = [], seg.param_offset, seg.param_offset + grad.numel()
    for lo, hi in seg.spec.norm_exclude:
        lo, hi = max(lo, pos), min(hi, end)
        if lo < hi:
            parts.append(grad[pos - seg.param_offset : lo - seg.param_offset])
            pos = hi
    parts.append(grad[pos - seg.param_offset :])
    return [p for p in parts if p.numel()]
