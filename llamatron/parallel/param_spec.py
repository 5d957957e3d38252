"""What every parameter of a model chunk is in the single-device model: one frozen record per parameter.

Parallelism changes what a rank holds of a parameter, never what the parameter
is. A `ParamSpec` says it: the parameter's global name (a pipeline stage's
parameter names are the global names already; the one exception is the last
stage's copy of a tied embedding, whose global name is `embed.weight`), its
full unpadded shape, the tensor-parallel layout of its shard, and how its
gradient is treated. Nothing is stored on the `nn.Parameter` itself.

The specs of a chunk are a table, local parameter name -> ParamSpec, built
where parallelism is applied: `param_specs` gives the plain defaults, the
pipeline (`build_stage_chunks`) marks the tied embedding's two copies, tensor
parallelism (`apply_tensor_parallel`) the shards and the sequence-parallel
replicas. Initialisation (`models.init.materialize`), the gradient buffers,
the optimizer and checkpoints read the table; the gradient buffer resolves it
to parameter objects once the chunk is materialised (`to_empty` replaces
them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .tensor_layers import ShardLayout


@dataclass(frozen=True)
class ParamSpec:
    global_name: str  # the name in the single-device model: init seeds, checkpoint keys
    full_shape: tuple[int, ...]  # unpadded, of the single-device model
    tp_layout: ShardLayout | None = None  # which part this tensor-parallel rank holds; None: all of it
    # Whole on every tp rank, each of which computes part of its gradient (norms used on sequence shards, q/k norms
    # used on the rank's heads, a MoE router): a partial sum, added over the tp group by sync_tensor_parallel_grads.
    partial_grad: bool = False
    shared_replica: bool = False  # a copy of another rank's parameter (tied head): not saved, not in the grad norm
    defer_grad_reduce: bool = False  # summed over pipeline stages first (tied embedding): no overlapped reduction
    # Flat element ranges of the local tensor that another tp rank counts in the grad norm (replicated KV rows).
    norm_exclude: tuple[tuple[int, int], ...] = ()
    # Expert parallelism (parallel/expert.py): (first, count) of the experts (dim 0) this rank holds; None: all
    expert_shard: tuple[int, int] | None = None
    # Expert tensor parallelism 1: the tp ranks hold different expert_shards of whole experts (tp_layout None), so
    # every tp rank counts its shard in the grad norm and writes it to checkpoints, as a tp shard's holder does.
    experts_over_tp: bool = False

    @property
    def is_expert(self) -> bool:
        """Split over the expert-parallel ranks: reduced over the expert replicas only (dp / ep)."""
        return self.expert_shard is not None

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_layout is not None

    @property
    def split_over_tp(self) -> bool:
        """Each tp rank holds different elements (a tp shard, or etp 1's experts): none of them a replica."""
        return self.tp_layout is not None or self.experts_over_tp

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = self.full_shape if self.tp_layout is None else self.tp_layout.local_shape(self.full_shape)
        return shape if self.expert_shard is None else (self.expert_shard[1], *shape[1:])

    @property
    def tp_partial_grad(self) -> bool:
        """Each tp rank holds only part of the gradient: a partial_grad replica, or replicated KV rows."""
        return self.partial_grad or (self.tp_layout is not None and self.tp_layout.num_replicated > 0)

    def sharded(self, layout: ShardLayout, full_shape: tuple[int, ...]) -> ParamSpec:
        """This spec for a parameter split by `layout` (tensor parallelism)."""
        full_shape = tuple(full_shape)
        return replace(
            self, full_shape=full_shape, tp_layout=layout, norm_exclude=tuple(layout.norm_exclude_ranges(full_shape))
        )

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor (init, checkpoint load)."""
        if self.expert_shard is not None:
            first, count = self.expert_shard
            full = full[first : first + count]
        return full if self.tp_layout is None else self.tp_layout.shard(full)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from every tp rank's part: a collective over the tp group for a sharded parameter."""
        if self.expert_shard is not None:
            raise ValueError(f"{self.global_name}: an expert-parallel shard is not gathered (read the checkpoint)")
        return local if self.tp_layout is None else self.tp_layout.gather(local)


ParamSpecs = dict[str, ParamSpec]


def param_specs(module: nn.Module) -> ParamSpecs:
    """The plain specs of `module`'s parameters: each its own global name and full shape."""
    return {name: ParamSpec(name, tuple(p.shape)) for name, p in module.named_parameters()}
