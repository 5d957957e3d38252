"""AdamW over flat gradient buffers: fp32 master weights, optional sharding over data-parallel ranks.

Memory per parameter (weights + gradients + optimizer state):
  bf16 params, fp32 grads:  2 + 4 + (4 master + 8 moments) / s   = 18 (s=1) or 6 + 12/d
  fp32 params, fp32 grads:  4 + 4 + 8 moments / s (master = param) = 16 (s=1) or 8 + 8/d
where s = d with --distributed-optimizer, else 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adamw import adamw as functional_adamw

from ..kernels.adamw_kernel import adamw_segment
from .fsdp import Buffer, owned_ranges
from .mesh import Mesh, all_reduce
from .param_spec import ParamSpec


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


class DistributedAdamW:
    def __init__(
        self,
        buffers: list[Buffer],
        mesh: Mesh,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float,
        distributed: bool,
        kernel: str = "torch",
        shard_group: dist.ProcessGroup | None = None,
    ):
        """shard_group: the ranks whose shards together hold every element once (default the replica group;
        hybrid sharding's shard group)."""
        self.buffers, self.mesh, self.kernel = buffers, mesh, kernel
        self.shard_group = mesh.replica_group if shard_group is None else shard_group
        self.lr, self.weight_decay, self.betas, self.eps, self.clip_grad = lr, weight_decay, betas, eps, clip_grad
        self.distributed = distributed and mesh.layout.replicas > 1
        self.segments: list[Segment] = []
        for buf in buffers:
            for p, s, e, start in owned_ranges(buf):
                spec = buf.spec_of[p]
                replicated_copy = (mesh.tp_rank > 0 and not spec.split_over_tp) or spec.shared_replica
                self.segments.append(
                    Segment(p, spec, buf, s, e, s - start, decay=p.ndim > 1, count_in_norm=not replicated_copy)
                )
        device = buffers[0].grad_data.device
        self.master_is_param = buffers[0].param_data.dtype == torch.float32
        self.master = [self._master_view(seg) for seg in self.segments]
        self.exp_avg = [torch.zeros(seg.end - seg.start, device=device) for seg in self.segments]
        self.exp_avg_sq = [torch.zeros(seg.end - seg.start, device=device) for seg in self.segments]
        self.steps = [torch.zeros((), device=device) for _ in self.segments]

    def _master_view(self, seg: Segment) -> torch.Tensor:
        data = seg.buffer.param_data[seg.buffer.local(seg.start, seg.end)]
        return data if data.dtype == torch.float32 else data.float()

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
            return torch.zeros((), device=self.buffers[0].grad_data.device, dtype=torch.float64)
        return torch.stack(torch._foreach_norm([g.float() for g in counted], 2, dtype=torch.float64)).pow(2).sum()

    @torch.no_grad()
    def step(self, lr: float, loss_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, clip, update. Returns (grad_norm, found_inf) as device tensors.

        `loss_scale` (fp16): gradients arrive multiplied by it and are divided back here.
        """
        grads = self.grads()
        norm = self.grad_norm()
        if loss_scale is not None:
            norm = norm / loss_scale
        # The fused AdamW (CUDA and CPU) skips the whole update on device when found_inf is set: no host sync.
        found_inf = (~torch.isfinite(norm)).float()
        coef = None
        if self.clip_grad > 0:
            # Scale only when above the threshold; computed on device, no host sync.
            coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
            coef = torch.where(torch.isfinite(coef), coef, torch.ones_like(coef))
        if loss_scale is not None:
            coef = (1.0 / loss_scale) if coef is None else coef / loss_scale
        # Clipping and fp16 unscaling ride in the AdamW kernel (it divides each gradient by grad_scale as it
        # reads it) instead of a separate pass over all gradients.
        grad_scale = None if coef is None else (1.0 / coef).float().reshape(())
        if self.kernel == "triton":
            self._triton_step(grads, lr, grad_scale, found_inf)
            return norm, found_inf
        for decay in (True, False):
            idx = [i for i, s in enumerate(self.segments) if s.decay == decay]
            if not idx:
                continue
            functional_adamw(
                [self.master[i] for i in idx],
                [grads[i] for i in idx],
                [self.exp_avg[i] for i in idx],
                [self.exp_avg_sq[i] for i in idx],
                [],
                [self.steps[i] for i in idx],
                fused=True,
                amsgrad=False,
                beta1=self.betas[0],
                beta2=self.betas[1],
                lr=lr,
                weight_decay=self.weight_decay if decay else 0.0,
                eps=self.eps,
                maximize=False,
                grad_scale=grad_scale,
                found_inf=found_inf,
            )
        if not self.master_is_param:
            for seg, master in zip(self.segments, self.master):
                seg.buffer.param_data[seg.buffer.local(seg.start, seg.end)].copy_(master)
        return norm, found_inf

    def _triton_step(
        self, grads: list[torch.Tensor], lr: float, grad_scale: torch.Tensor | None, found_inf: torch.Tensor
    ) -> None:
        """The same update as the fused torch path, one kernel per segment writing the model weights too."""
        # A skipped step does not count (as torch's fused AdamW). The increment goes in as a tensor list: a 0-d
        # tensor passed as the scalar argument is read on the host, a device sync each step (seen on an H200).
        increment = 1.0 - found_inf
        torch._foreach_add_(self.steps, [increment] * len(self.steps))
        for i, seg in enumerate(self.segments):
            out = None if self.master_is_param else seg.buffer.param_data[seg.buffer.local(seg.start, seg.end)]
            adamw_segment(
                self.master[i],
                grads[i],
                self.exp_avg[i],
                self.exp_avg_sq[i],
                self.steps[i],
                out,
                lr=lr,
                beta1=self.betas[0],
                beta2=self.betas[1],
                eps=self.eps,
                weight_decay=self.weight_decay if seg.decay else 0.0,
                grad_scale=grad_scale,
                found_inf=found_inf,
            )

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
        state = sum(t.numel() * 4 for t in self.exp_avg + self.exp_avg_sq)
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


def bytes_per_param(dtype: str, distributed_optimizer: bool, replicas: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter held, as parallel/optimizer.py allocates them
    (replicas: dp x cp, over which the distributed optimizer shards)."""
    shards = replicas if distributed_optimizer else 1
    if dtype == "fp32":
        return 4.0, 4.0, 8.0 / shards
    return 2.0, 4.0, 12.0 / shards


def lr_problems(lr: float, min_lr: float) -> list[str]:
    """The learning-rate schedule's flags that do not go together (each one's range is declared on its flag)."""
    return [f"--min-lr {min_lr} is above --lr {lr}"] if min_lr > lr else []


def lr_at(step: int, peak: float, floor: float, warmup: int, total: int, schedule: str) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then constant/linear/cosine to `floor`."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    if schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")
