"""AdamW over flat gradient buffers: fp32 master weights, optional sharding over data-parallel ranks.

Memory per parameter (weights + gradients + optimizer state):
  bf16 params, fp32 grads:  2 + 4 + (4 master + 8 moments) / s   = 18 (s=1) or 6 + 12/d
  fp32 params, fp32 grads:  4 + 4 + 8 moments / s (master = param) = 16 (s=1) or 8 + 8/d
where s = d with --distributed-optimizer, else 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw as functional_adamw

from ..kernels.adamw_kernel import adamw_segment
from ..parallel.fsdp import Buffer
from ..parallel.mesh import Mesh
from .base import SegmentOptimizer

# The state kinds AdamW keeps per element (fp32), as checkpoints name them.
MOMENTS = ("exp_avg", "exp_avg_sq")


class DistributedAdamW(SegmentOptimizer):
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
        super().__init__(buffers, mesh, clip_grad, distributed, shard_group)
        self.kernel = kernel
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.adamw_segments = self._adamw_indices()
        self.exp_avg = self._zeros(set(self.adamw_segments))
        self.exp_avg_sq = self._zeros(set(self.adamw_segments))

    def _adamw_indices(self) -> list[int]:
        """The segments AdamW updates (all of them here; Muon keeps the matrices)."""
        return list(range(len(self.segments)))

    def state(self, i: int) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg[i], "exp_avg_sq": self.exp_avg_sq[i]}

    @torch.no_grad()
    def step(self, lr: float, loss_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, clip, update. Returns (grad_norm, found_inf) as device tensors.

        `loss_scale` (fp16): gradients arrive multiplied by it and are divided back here.
        """
        norm, found_inf, grad_scale = self.norm_and_scale(loss_scale)
        self.adamw_step(self.adamw_segments, self.grads(), lr, grad_scale, found_inf)
        return norm, found_inf

    def adamw_step(
        self,
        indices: list[int],
        grads: list[torch.Tensor],
        lr: float,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor,
    ) -> None:
        """AdamW on these segments. The fused AdamW (CUDA and CPU) skips the whole update on device when found_inf
        is set: no host sync. Clipping and fp16 unscaling ride in the kernel (it divides each gradient by
        grad_scale as it reads it) instead of a separate pass over all gradients."""
        if self.kernel == "triton":
            if indices:
                # A skipped step does not count (as torch's fused AdamW). The increment goes in as a tensor list: a
                # 0-d tensor passed as the scalar argument is read on the host, a device sync each step (an H200).
                steps = [self.steps[i] for i in indices]
                torch._foreach_add_(steps, [1.0 - found_inf] * len(steps))
            for i in indices:
                self._triton_segment(i, grads[i], lr, grad_scale, found_inf)
            return
        for decay in (True, False):
            idx = [i for i in indices if self.segments[i].decay == decay]
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
        self.write_back(indices)

    def _triton_segment(self, i: int, grad: torch.Tensor, lr: float, scale: torch.Tensor | None, inf: torch.Tensor):
        """The same update as the fused torch path on segment i, one kernel that writes the model weights too."""
        seg = self.segments[i]
        out = None if self.master_is_param else seg.buffer.param_data[seg.buffer.local(seg.start, seg.end)]
        adamw_segment(
            self.master[i],
            grad,
            self.exp_avg[i],
            self.exp_avg_sq[i],
            self.steps[i],
            out,
            lr=lr,
            beta1=self.betas[0],
            beta2=self.betas[1],
            eps=self.eps,
            weight_decay=self.weight_decay if seg.decay else 0.0,
            grad_scale=scale,
            found_inf=inf,
        )


def adamw_state_bytes(dtype: str) -> float:
    """AdamW's fp32 state per parameter it updates: two moments, and the master weight unless the weights are
    fp32 (the master then is the weight)."""
    return 8.0 if dtype == "fp32" else 12.0
