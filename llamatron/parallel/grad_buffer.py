"""Contiguous gradient buffers cut into buckets, reduced over data-parallel ranks during backward.

Each model chunk's parameters live in one flat parameter buffer and accumulate
their gradients into one flat fp32 gradient buffer (no per-parameter `.grad`
survives a backward); the buffer owns each parameter's gradient view
(`grad(p)`) and knows which were not written since `zero_grad`, and holds the
chunk's parameter specs (param_spec.py) by parameter (`spec_of`), for the
optimizer and checkpoints. Parameters are laid out in reverse order of use,
so buckets fill up in the order backward produces them. A bucket is reduced
(all-reduce, or reduce-scatter for the distributed optimizer) as soon as its
last gradient of the step's *last* micro-batch has arrived: one collective per
bucket per step, whatever the number of micro-batches.

With the distributed optimizer each data-parallel rank owns the i-th 1/dp of
every bucket; after the step the updated parameters are all-gathered bucket by
bucket, and each bucket is waited on just before the first module that uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from .grad_accumulate import accumulate_grad
from .mesh import all_gather_flat as _all_gather
from .mesh import reduce_scatter_flat as _reduce_scatter
from .param_spec import ParamSpec, ParamSpecs, param_specs

# Buckets are padded so every shard starts on a 128-byte boundary for any dtype used here.
_ALIGN = 64


def reduce_dtype_problems(dtype_name: str, grad_reduce_dtype: str) -> list[str]:
    """--grad-reduce-dtype against the parameters' dtype."""
    if dtype_name == "fp16" and grad_reduce_dtype == "bf16":
        return ["--precision fp16 with --grad-reduce-dtype bf16 mixes two half types; use fp32 reduction"]
    return []


class Span(Protocol):
    """A bucket as the optimizer and checkpoints see it: a range of the flat layout."""

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def numel(self) -> int: ...


class Microbatched(Protocol):
    """A chunk's buffer, told whether the coming backward is the step's last."""

    module: nn.Module
    is_last_microbatch: bool


@dataclass
class Bucket:
    index: int
    start: int  # element offsets into the flat buffers
    end: int
    params: list[nn.Parameter]
    pending: int = 0
    reduce_handle: dist.Work | None = None
    gather_handle: dist.Work | None = None
    reduce_staging: torch.Tensor | None = None
    deferred: bool = False  # holds a tied embedding, summed over pipeline stages before it is reduced

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class CommStats:
    """Counts of collectives issued, for tests and the benchmark breakdown."""

    grad_reductions: int = 0
    param_gathers: int = 0
    wait_seconds: float = 0.0
    per_step: list[int] = field(default_factory=list)
    # This step's collectives in the order they happened (cleared by zero_grad): ("reduce", bucket, "backward" or
    # "after backward"): where a bucket's gradient reduction was issued; ("gather wait", bucket, where): where
    # forward waited for a bucket's parameter all-gather (a layer's name, or "after forward").
    events: list[tuple[str, int, str]] = field(default_factory=list)


class GradBuffer:
    """Flat parameter and gradient storage of one model chunk, bucketed for data-parallel reduction."""

    holds_full_params = True  # every parameter whole on this rank (fsdp.ShardedBuffer: its shard only)
    writes_checkpoint = True  # its share of every bucket (hybrid sharding: one of the replicas holding a shard)

    def __init__(
        self,
        module: nn.Module,
        dp_group: dist.ProcessGroup | None,
        dp: int,
        grad_dtype: torch.dtype = torch.float32,
        bucket_size: int = 40_000_000,
        distributed: bool = False,
        overlap_grad_reduce: bool = True,
        reduce_dtype: torch.dtype | None = None,
        specs: ParamSpecs | None = None,
        select: Callable[[ParamSpec], bool] | None = None,
    ):
        """specs: the chunk's parameter specs by local name (default: the plain ones), resolved here to the
        materialised parameters. select: which of the chunk's parameters this buffer holds (default: all; expert
        parallelism gives the experts a buffer of their own, reduced over their own replicas)."""
        self.module = module
        self.dp_group, self.dp = dp_group, dp
        # This rank's place among the replicas: which shard it owns and writes to checkpoints.
        self.replica_rank = dist.get_rank(dp_group) if dp_group is not None and dp > 1 else 0
        self.distributed = distributed
        self.overlap_grad_reduce = overlap_grad_reduce and dp > 1
        self.reduce_dtype = reduce_dtype
        self.stats = CommStats()
        specs = param_specs(module) if specs is None else specs
        self.spec_of: dict[nn.Parameter, ParamSpec] = {
            p: specs[n]
            for n, p in module.named_parameters()
            if p.requires_grad and (select is None or select(specs[n]))
        }
        wrong = [s.global_name for p, s in self.spec_of.items() if s.local_shape != tuple(p.shape)]
        if wrong:
            raise ValueError(f"parameter specs do not fit the parameters' shapes: {wrong[:5]}")
        params = list(self.spec_of)
        if not params:
            raise ValueError("a model chunk without trainable parameters")
        params = list(reversed(params))  # backward produces gradients roughly in reverse order
        device, dtype = params[0].device, params[0].dtype
        # Cut into buckets at parameter boundaries; pad each to a multiple of dp * _ALIGN.
        self.buckets: list[Bucket] = []
        self.param_range: dict[nn.Parameter, tuple[int, int]] = {}
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        offset, current, bucket_start = 0, [], 0
        for i, p in enumerate(params):
            self.param_range[p] = (offset, offset + p.numel())
            offset += p.numel()
            current.append(p)
            if offset - bucket_start >= bucket_size or i == len(params) - 1:
                multiple = dp * _ALIGN
                padded_end = bucket_start + -(-(offset - bucket_start) // multiple) * multiple
                deferred = any(self.spec_of[q].defer_grad_reduce for q in current)
                self.buckets.append(Bucket(len(self.buckets), bucket_start, padded_end, current, deferred=deferred))
                offset = bucket_start = padded_end
                current = []
        self.numel = offset
        self.param_data = torch.zeros(self.numel, dtype=dtype, device=device)
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self._grads: dict[nn.Parameter, torch.Tensor] = {}
        for bucket in self.buckets:
            for p in bucket.params:
                start, end = self.param_range[p]
                self.param_data[start:end].copy_(p.data.flatten())
                p.data = self.param_data[start:end].view_as(p)
                self._grads[p] = self.grad_data[start:end].view_as(p)
                self.bucket_of[p] = bucket
        # Parameters whose gradient no backward wrote since zero_grad (grad_data starts zeroed: none).
        self._unwritten: set[nn.Parameter] = set()
        # Listed once here so the step does no per-parameter Python work to find them.
        self.tp_partial_grads = [
            (self._grads[p], self.spec_of[p]) for p in self.spec_of if self.spec_of[p].tp_partial_grad
        ]
        self.is_last_microbatch = True
        # NCCL gathers in place (input = this rank's slice of the output); gloo needs a separate input.
        self._in_place_gather = dp_group is not None and dist.get_backend(dp_group) == "nccl"
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self._gather_hooks: list = []
        self.reset_pending()

    # ---- gradient side -------------------------------------------------------------------------

    def grad(self, param: nn.Parameter) -> torch.Tensor:
        """The parameter's gradient: its view of the flat fp32 buffer."""
        return self._grads[param]

    def zero_if_unwritten(self, param: nn.Parameter) -> None:
        """Zero the gradient of `param` if no backward wrote it since zero_grad (which writes none)."""
        if param in self._unwritten:
            self._grads[param].zero_()
            self._unwritten.discard(param)

    def reset_pending(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)

    def _grad_ready(self, param: nn.Parameter) -> None:
        # The first gradient after zero_grad is written, not added: zero_grad writes nothing, which saves a
        # zeroing pass over the fp32 buffer and a read of it.
        overwrite = param in self._unwritten
        if overwrite:
            self._unwritten.discard(param)
        assert param.grad is not None  # a post-accumulate-grad hook runs once the gradient is there
        accumulate_grad(self._grads[param], param.grad, overwrite=overwrite)
        param.grad = None
        if not self.is_last_microbatch:
            return
        bucket = self.bucket_of[param]
        bucket.pending -= 1
        # A weight shared across pipeline stages (tied embedding) is summed over them first: finish_grad_sync
        # reduces it.
        if bucket.pending == 0 and self.overlap_grad_reduce and not bucket.deferred:
            self._start_reduce(bucket, "backward")

    def shard_range(self, bucket: Span, dp_rank: int) -> tuple[int, int]:
        """Element range of the bucket owned by dp_rank (the whole bucket without the distributed optimizer)."""
        if not self.distributed:
            return bucket.start, bucket.end
        size = bucket.numel // self.dp
        return bucket.start + dp_rank * size, bucket.start + (dp_rank + 1) * size

    def local(self, start: int, end: int) -> slice:
        """Where the flat element range [start, end) lies in param_data and grad_data (they hold every element)."""
        return slice(start, end)

    def _start_reduce(self, bucket: Bucket, when: str) -> None:
        if self.dp == 1 or bucket.reduce_handle is not None:
            return
        self.stats.events.append(("reduce", bucket.index, when))
        data = self.grad_data[bucket.start : bucket.end]
        if self.reduce_dtype is not None and self.reduce_dtype != data.dtype:
            bucket.reduce_staging = data.to(self.reduce_dtype)
            data = bucket.reduce_staging
        if self.distributed:
            rank = dist.get_rank(self.dp_group)
            size = bucket.numel // self.dp
            bucket.reduce_handle = _reduce_scatter(
                data[rank * size : (rank + 1) * size], data, group=self.dp_group, async_op=True
            )
        else:
            bucket.reduce_handle = dist.all_reduce(data, group=self.dp_group, async_op=True)
        self.stats.grad_reductions += 1

    def finish_grad_sync(self) -> None:
        """Reduce what backward did not start, then wait for every bucket. Call after the last backward."""
        self._zero_unwritten()
        for bucket in self.buckets:
            self._start_reduce(bucket, "after backward")
        for bucket in self.buckets:
            if bucket.reduce_handle is not None:
                bucket.reduce_handle.wait()
                bucket.reduce_handle = None
            if bucket.reduce_staging is not None:
                start, end = self.shard_range(bucket, dist.get_rank(self.dp_group) if self.dp > 1 else 0)
                local = slice(start - bucket.start, end - bucket.start)
                self.grad_data[start:end].copy_(bucket.reduce_staging[local])
                bucket.reduce_staging = None
        self.reset_pending()

    def zero_grad(self) -> None:
        """Mark every gradient stale; the next backward overwrites it (padding between buckets stays 0)."""
        self._unwritten = set(self._grads)
        self.reset_pending()
        self.stats.events.clear()

    def _zero_unwritten(self) -> None:
        """Zero the gradients of parameters that backward did not reach since zero_grad (unused this step)."""
        for p in self._unwritten:
            self._grads[p].zero_()
        self._unwritten.clear()

    # ---- parameter side (distributed optimizer) -------------------------------------------------

    def start_param_gather(self, overlap: bool) -> None:
        """All-gather every bucket's updated shards; with overlap, wait lazily in forward pre-hooks."""
        if not self.distributed or self.dp == 1:
            return
        rank = dist.get_rank(self.dp_group)
        # The first layers' parameters sit in the last buckets: gather those first.
        for bucket in reversed(self.buckets):
            size = bucket.numel // self.dp
            data = self.param_data[bucket.start : bucket.end]
            shard = data[rank * size : (rank + 1) * size]
            if not self._in_place_gather:
                shard = shard.clone()
            bucket.gather_handle = _all_gather(data, shard, group=self.dp_group, async_op=overlap)
            self.stats.param_gathers += 1
        if not overlap:
            for bucket in self.buckets:
                bucket.gather_handle = None
        elif not self._gather_hooks:
            self._install_gather_hooks()

    def _install_gather_hooks(self) -> None:
        """Wait for a bucket just before the first unit that uses it: a decoder layer, the embedding, the head.

        Hooks sit on whole layers (not inner linears) so compiled layers run their hooks outside the graph.
        The output head is the exception: Transformer.logits reads its weight through F.linear without calling
        the head module, so its hook would never run; its buckets are waited for with the final norm's, which
        runs just before.
        """
        head, norm = getattr(self.module, "lm_head", None), getattr(self.module, "norm", None)
        names = {id(m): n for n, m in self.module.named_modules()}
        for unit in _forward_units(self.module):
            if unit is head and norm is not None:
                continue
            own = [p for p in unit.parameters() if p in self.bucket_of]
            if unit is norm and head is not None:
                own += [p for p in head.parameters() if p in self.bucket_of]
            if own:
                buckets = sorted({self.bucket_of[p].index for p in own})
                where = names[id(unit)]
                wait = lambda _m, _args, idx=buckets, name=where: self._wait_gather(idx, name)
                self._gather_hooks.append(unit.register_forward_pre_hook(wait))

    def _wait_gather(self, bucket_indices: list[int], where: str) -> None:
        for i in bucket_indices:
            handle = self.buckets[i].gather_handle
            if handle is not None:
                handle.wait()
                self.buckets[i].gather_handle = None
                self.stats.events.append(("gather wait", i, where))

    def finish_param_gather(self) -> None:
        self._wait_gather(list(range(len(self.buckets))), "after forward")


def mark_last_microbatch(buffers: Sequence[Microbatched], chunk: nn.Module, last: bool) -> None:
    """Tell the buffers of `chunk` whether the coming backward is the step's last micro-batch's (their buckets
    reduce during it)."""
    for buf in buffers:
        if buf.module is chunk:
            buf.is_last_microbatch = last


def _forward_units(module: nn.Module) -> list[nn.Module]:
    """Top-level children in forward order, with layer lists and dicts flattened into their layers."""
    units: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, nn.ModuleDict):
            units.extend(child.values())
        elif isinstance(child, nn.ModuleList):
            units.extend(child)
        else:
            units.append(child)
    return units or [module]
