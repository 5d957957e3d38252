"""Fully sharded data parallelism (ZeRO-3, --fsdp): parameters, gradients and optimizer state sharded over the
data-parallel ranks, each layer's parameters gathered just before use and freed after.

`ShardedBuffer` has the interface of the gradient buffer (grad_buffer.py) that the optimizer, the gradient norm
and the checkpoint writer read, with the same flat layout (element offsets, buckets padded to dp·_ALIGN, rank r
owning the r-th 1/dp of each bucket), so the optimizer (llamatron/optim/) and `checkpoint/writer.py` run unchanged
over it.
What differs: a bucket is one forward unit (the embedding, a decoder layer, the final norm with the output head),
and a rank *stores* only its shard of each bucket (`param_data`, `grad_data`: numel/dp elements). The whole
bucket exists only while gathered: its parameters are views of `bucket.full`, whose storage is resized to 0 when
freed and refilled by an all-gather; autograd's saved references to the parameters are views of the same storage,
so backward sees the weights again once the bucket is re-gathered. The model is built on meta and only the local
shard is ever written (`initial` draws one full tensor at a time, as models/init.py does).

A step, for unit i: forward pre-hook gathers i (waits for it) and issues the gather of i+1 (prefetch), the
post-hook frees i (not the last unit, which backward needs at once, nor a unit whose weight the head shares) and
hooks i's output, whose gradient fires when backward reaches i: gather i again (unless
--fsdp-keep-params-in-backward kept it) and prefetch i-1. When every parameter of i has its gradient, the bucket's
full gradient is reduce-scattered into this rank's shard (added to it for a later micro-batch) and i is freed; at
most MAX_REDUCING reduce-scatters stay in flight (the oldest is finished as a new one is issued), so the whole
gradients waiting as their inputs are a few layers', not the chunk's.
With one rank the shard is the whole bucket: nothing is gathered, freed or reduced, gradients accumulate in place.
`stats.events` records the order (gather, computed, reduce, free) for tests/test_fsdp.py.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from .grad_accumulate import accumulate_grad
from .grad_buffer import _ALIGN, CommStats, GradBuffer, Span, _forward_units
from .mesh import all_gather_flat, reduce_scatter_flat
from .param_spec import ParamSpec, ParamSpecs
from .tensor import sync_tensor_parallel_grads

# Reduce-scatters a buffer keeps in flight: the one just issued and the one before it (each holds its unit's whole
# gradient as input until it is finished).
MAX_REDUCING = 2


def fsdp_problems(
    fsdp: bool,
    keep_params_in_backward: bool,
    prefetch: bool,
    shard_group: int | None,
    replicas: int,
    given: list[str],
    tp: int,
    pp: int,
    cp: int,
    ep: int,
    fp8: str,
    lora_rank: int,
) -> list[str]:
    """--fsdp against the flags that make no sense with it and the layouts it does not compose with yet.

    shard_group: --fsdp-shard-group; replicas: the ranks holding the same weights (dp x cp); given: the names of
    the parallel settings set explicitly (YAML or flags)."""
    if not fsdp:
        flags = [
            ("--fsdp-keep-params-in-backward", keep_params_in_backward),
            ("--no-fsdp-prefetch", not prefetch),
            (f"--fsdp-shard-group {shard_group}", shard_group is not None),
        ]
        return [f"{flag} needs --fsdp" for flag, given_ in flags if given_]
    problems = []
    if shard_group is not None and (shard_group >= replicas or replicas % shard_group):
        fits = [n for n in range(2, replicas) if replicas % n == 0]
        problems.append(
            f"--fsdp-shard-group {shard_group} must divide the {replicas} data-parallel ranks (dp x cp) and be "
            f"fewer: use one of {fits}, or drop it to shard over all {replicas}"
            if fits
            else f"--fsdp-shard-group {shard_group}: {replicas} data-parallel ranks have no smaller group to shard "
            "over; drop it"
        )
    meaningless = {
        "distributed_optimizer": "--fsdp shards the optimizer state already; drop --distributed-optimizer",
        "overlap_param_gather": "--fsdp gathers each layer's parameters before its forward; drop "
        "--overlap-param-gather (use --no-fsdp-prefetch to gather without prefetching)",
        "overlap_grad_reduce": "--fsdp reduce-scatters each layer's gradients during backward; drop "
        "--overlap-grad-reduce",
        "bucket_size": "--fsdp makes one bucket per layer; drop --bucket-size",
    }
    problems += [why for name, why in meaningless.items() if name in given]
    not_yet = [
        (lora_rank > 0, "LoRA (--lora-rank)"),
        (ep > 1 and shard_group is not None, f"--ep {ep} and --fsdp-shard-group"),
    ]
    problems += [f"--fsdp does not compose with {what} yet; drop one of the two" for bad, what in not_yet if bad]
    return problems


@dataclass
class ShardedBucket:
    """One forward unit's parameters: offsets into the flat layout, and the gathered copy while it lives."""

    index: int
    start: int
    end: int
    params: list[nn.Parameter]
    name: str
    full: torch.Tensor  # the whole bucket's parameters (the params are views); storage size 0 while freed
    keep_after_forward: bool = False  # the last unit, or a weight the head uses again (tied embedding)
    gathered: bool = False
    gather_handle: dist.Work | None = None
    pending: int = 0
    staging: torch.Tensor | None = None  # this micro-batch's full gradient, until it is reduce-scattered
    reduce: tuple | None = None  # (handle, output shard, input kept alive) of the reduce-scatter in flight
    reduced_this_step: bool = False
    deferred: bool = False  # holds a tied embedding: summed over pipeline stages before it is reduced

    @property
    def numel(self) -> int:
        return self.end - self.start


class ShardedBuffer:
    """This rank's shard of one model chunk's parameters and gradients, gathered unit by unit (module docstring)."""

    holds_full_params = False
    distributed = True

    def __init__(
        self,
        module: nn.Module,
        dp_group: dist.ProcessGroup | None,
        dp: int,
        specs: ParamSpecs,
        initial: Callable[[ParamSpec], torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        grad_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype | None = None,
        keep_params_in_backward: bool = False,
        prefetch: bool = True,
        replicate_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        select: Callable[[ParamSpec], bool] | None = None,
    ):
        """module: on the meta device; its parameters are replaced by views of the gathered buckets. initial: a
        parameter's initial local (tensor-parallel) tensor from its spec, drawn one parameter at a time.
        dp_group, dp: the ranks sharding the weights; replicate_group: hybrid sharding's ranks holding the same
        shard (their gradients are all-reduced; the first of them writes checkpoints). tp_group: where the
        gradients each tensor-parallel rank holds part of are summed (tensor.sync_tensor_parallel_grads).
        select: which parameters this buffer holds (default: all; expert parallelism gives the experts a buffer of
        their own, sharded over their own replicas)."""
        self.module, self.dp_group, self.dp = module, dp_group, dp
        self.replica_rank = dist.get_rank(dp_group) if dp_group is not None and dp > 1 else 0
        self.replicate_group, self.tp_group = replicate_group, tp_group
        self.writes_checkpoint = replicate_group is None or dist.get_rank(replicate_group) == 0
        self.reduce_dtype, self.keep_params_in_backward, self.prefetch = reduce_dtype, keep_params_in_backward, prefetch
        self.stats = CommStats()
        self._reducing: list[ShardedBucket] = []  # buckets whose reduce-scatter is in flight, oldest first
        self.is_last_microbatch = True  # every micro-batch's gradients are reduce-scattered: not read
        bucket_units = self._lay_out(module, specs, dtype, device, select)
        if not self.buckets:
            raise ValueError("a model chunk without trainable parameters")
        wrong = [s.global_name for p, s in self.spec_of.items() if s.local_shape != tuple(p.shape)]
        if wrong:
            raise ValueError(f"parameter specs do not fit the parameters' shapes: {wrong[:5]}")
        self._starts = [b.start for b in self.buckets]
        self.param_data = torch.zeros(self.numel // dp, dtype=dtype, device=device)
        self.grad_data = torch.zeros(self.numel // dp, dtype=grad_dtype, device=device)
        self._initialise(initial)
        if dp == 1:  # the shard is the bucket: the parameters live in it, always "gathered"
            for b in self.buckets:
                b.full = self.param_data[b.start : b.end]
                _point_at(b, self.param_range)
                b.gathered = True
        self.buckets[-1].keep_after_forward = True  # backward starts with the last unit
        head = getattr(module, "head_weight", None)
        if callable(head) and getattr(module, "norm", None) is not None:
            shared = head()
            if shared in self.bucket_of:  # a tied head reads the embedding's weight after the embedding ran
                self.bucket_of[shared].keep_after_forward = True
        self._unwritten: set[nn.Parameter] = set()
        partial_grads = [(p, self.spec_of[p]) for p in self.spec_of if self.spec_of[p].tp_partial_grad]
        # Summed over tp by train_step with one rank (the gradients are whole in grad_data); with more, here, on
        # each unit's whole gradient before it is reduce-scattered (a shard may cut a replicated KV row).
        self.tp_partial_grads = (
            [(self.grad_data[slice(*self.param_range[p])].view_as(p), s) for p, s in partial_grads] if dp == 1 else []
        )
        self._partial_of = {b.index: [(p, s) for p, s in partial_grads if self.bucket_of[p] is b] for b in self.buckets}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.spec_of]
        for i, unit in enumerate(bucket_units):
            self._hooks.append(unit.register_forward_pre_hook(partial(self._before_forward, i)))
            self._hooks.append(unit.register_forward_hook(partial(self._after_forward, i)))
        self.zero_grad()

    def _lay_out(
        self,
        module: nn.Module,
        specs: ParamSpecs,
        dtype: torch.dtype,
        device: torch.device,
        select: Callable[[ParamSpec], bool] | None,
    ) -> list[nn.Module]:
        """One bucket per forward unit, its parameters (new, views of the bucket's `full`) in place of the meta
        ones; returns the unit module of each bucket (where its hooks go)."""
        dp = self.dp
        units = self._units(module)
        names = {id(m): n for n, m in module.named_modules()}
        local_name = {id(p): n for n, p in module.named_parameters()}
        seen: set[int] = set()
        self.spec_of: dict[nn.Parameter, ParamSpec] = {}
        self.param_range: dict[nn.Parameter, tuple[int, int]] = {}
        self.bucket_of: dict[nn.Parameter, ShardedBucket] = {}
        self.buckets: list[ShardedBucket] = []
        replaced: dict[int, nn.Parameter] = {}
        bucket_units: list[nn.Module] = []
        offset = 0
        for unit_modules in units:
            meta = [
                p
                for m in unit_modules
                for p in m.parameters()
                if p.requires_grad
                and id(p) not in seen
                and not seen.add(id(p))  # type: ignore[func-returns-value]
                and (select is None or select(specs[local_name[id(p)]]))
            ]
            if not meta:
                continue
            start, size = offset, sum(p.numel() for p in meta)
            end = start + -(-size // (dp * _ALIGN)) * (dp * _ALIGN)
            full = torch.empty(end - start, dtype=dtype, device=device)
            params, pos = [], start
            for p in meta:
                # Given its data by `.data =`, the parameter keeps a version counter of its own: the all-gathers
                # into `full` do not count as in-place changes of the weights autograd saved.
                new = nn.Parameter(torch.empty(0, dtype=dtype, device=device))
                new.data = full[pos - start : pos - start + p.numel()].view(p.shape)
                replaced[id(p)] = new
                self.spec_of[new] = specs[local_name[id(p)]]
                self.param_range[new] = (pos, pos + p.numel())
                params.append(new)
                pos += p.numel()
            full.untyped_storage().resize_(0)  # allocated for one bucket at a time: the views' storage, empty now
            bucket = ShardedBucket(len(self.buckets), start, end, params, names[id(unit_modules[0])], full)
            bucket.deferred = any(self.spec_of[p].defer_grad_reduce for p in params)
            self.buckets.append(bucket)
            bucket_units.append(unit_modules[0])
            for p in params:
                self.bucket_of[p] = bucket
            offset = end
        _replace_parameters(module, replaced)
        self.numel = offset
        return bucket_units

    @staticmethod
    def _units(module: nn.Module) -> list[list[nn.Module]]:
        """Forward units in order (grad_buffer's), the output head joined to the final norm (Transformer.logits
        calls the head's matmul, not the head module)."""
        head, norm = getattr(module, "lm_head", None), getattr(module, "norm", None)
        units = [[u] for u in _forward_units(module) if u is not head or norm is None]
        if head is not None and norm is not None:
            next(u for u in units if u[0] is norm).append(head)
        return [u for u in units if any(p.requires_grad for m in u for p in m.parameters())]

    @torch.no_grad()
    def _initialise(self, initial: Callable[[ParamSpec], torch.Tensor]) -> None:
        """Each parameter's owned part of its initial value into this rank's shard, one full tensor at a time."""
        for p, a, z, s in owned_ranges(self):
            value = initial(self.spec_of[p]).reshape(-1)
            self.param_data[self.local(a, z)].copy_(value[a - s : z - s])

    # ---- the flat layout, as grad_buffer.GradBuffer's ---------------------------------------------

    def shard_range(self, bucket: Span, dp_rank: int) -> tuple[int, int]:
        size = bucket.numel // self.dp
        return bucket.start + dp_rank * size, bucket.start + (dp_rank + 1) * size

    def local(self, start: int, end: int) -> slice:
        """Where the flat element range [start, end) of this rank's shard of a bucket lies in param_data and
        grad_data."""
        b = self.buckets[bisect.bisect_right(self._starts, start) - 1]
        lo, hi = self.shard_range(b, self.replica_rank)
        if not lo <= start <= end <= hi:
            raise ValueError(f"[{start}, {end}) is not in this rank's shard [{lo}, {hi}) of bucket {b.index}")
        first = b.start // self.dp + start - lo
        return slice(first, first + end - start)

    def _shard(self, b: ShardedBucket, data: torch.Tensor) -> torch.Tensor:
        size = b.numel // self.dp
        return data[b.start // self.dp : b.start // self.dp + size]

    # ---- gathering parameters ------------------------------------------------------------------

    def _issue_gather(self, i: int, where: str) -> None:
        b = self.buckets[i]
        if b.gathered or b.gather_handle is not None:
            return
        b.full.untyped_storage().resize_(b.full.numel() * b.full.element_size())
        b.gather_handle = all_gather_flat(b.full, self._shard(b, self.param_data), group=self.dp_group, async_op=True)
        self.stats.param_gathers += 1
        self.stats.events.append(("gather", i, where))

    def _ensure_gathered(self, i: int, where: str) -> None:
        b = self.buckets[i]
        self._issue_gather(i, where)
        if b.gather_handle is not None:
            b.gather_handle.wait()
            b.gather_handle = None
            b.gathered = True

    def _free(self, i: int, where: str) -> None:
        b = self.buckets[i]
        if self.dp == 1 or not b.gathered:
            return
        b.full.untyped_storage().resize_(0)
        b.gathered = False
        self.stats.events.append(("free", i, where))

    def _before_forward(self, i: int, _module: nn.Module, _args) -> None:
        self._ensure_gathered(i, "forward")
        if self.prefetch and i + 1 < len(self.buckets):
            self._issue_gather(i + 1, "prefetch forward")

    def _after_forward(self, i: int, _module: nn.Module, _args, output) -> None:
        self.stats.events.append(("computed", i, "forward"))
        training = torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad
        if training:
            output.register_hook(partial(self._before_backward, i))
        if self.buckets[i].keep_after_forward or (training and self.keep_params_in_backward):
            return
        self._free(i, "forward")

    def _before_backward(self, i: int, _grad: torch.Tensor) -> None:
        self._ensure_gathered(i, "backward")
        if self.prefetch and i > 0:
            self._issue_gather(i - 1, "prefetch backward")

    # ---- gradients -------------------------------------------------------------------------------

    def grad(self, param: nn.Parameter) -> torch.Tensor:
        """The whole gradient of a parameter whose reduction waits for the end of backward (a tied embedding's
        pipeline copies, summed by pipeline.sum_tied_embedding_grads), or of any parameter with one rank."""
        b = self.bucket_of[param]
        s, e = self.param_range[param]
        if self.dp == 1:
            return self.grad_data[s:e].view_as(param)
        if not b.deferred:
            raise ValueError("--fsdp holds gradient shards only: read grad_data through the optimizer's segments")
        return self._staging(b)[s - b.start : e - b.start].view_as(param)

    def zero_if_unwritten(self, param: nn.Parameter) -> None:
        if param in self._unwritten:
            s, e = self.param_range[param]
            self.grad_data[s:e].zero_()
            self._unwritten.discard(param)

    def _staging(self, b: ShardedBucket) -> torch.Tensor:
        if b.staging is None:  # zeros: the padding, and parameters this micro-batch did not use
            b.staging = torch.zeros(b.numel, dtype=self.grad_data.dtype, device=self.grad_data.device)
        return b.staging

    def _grad_ready(self, param: nn.Parameter) -> None:
        b = self.bucket_of[param]
        assert param.grad is not None  # a post-accumulate-grad hook runs once the gradient is there
        s, e = self.param_range[param]
        if self.dp == 1:
            target = self.grad_data[s:e]
            overwrite = param in self._unwritten
            self._unwritten.discard(param)
        else:  # a deferred bucket's staging collects every micro-batch's gradient (it starts at zero)
            target, overwrite = self._staging(b)[s - b.start : e - b.start], not b.deferred
        accumulate_grad(target.view_as(param), param.grad, overwrite=overwrite)
        param.grad = None
        b.pending -= 1
        if b.pending == 0:
            if b.deferred:
                b.pending = len(b.params)
            else:
                self._start_reduce(b, "backward")
            self._free(b.index, "backward")

    def _start_reduce(self, b: ShardedBucket, when: str) -> None:
        b.pending = len(b.params)
        if self.dp == 1 or b.staging is None:
            return
        self._finish_reduce(b)  # the previous micro-batch's, added to the shard first
        if self.tp_group is not None and self._partial_of[b.index]:
            staging = b.staging
            views = [
                (staging[self.param_range[p][0] - b.start : self.param_range[p][1] - b.start].view_as(p), s)
                for p, s in self._partial_of[b.index]
            ]
            sync_tensor_parallel_grads(views, self.tp_group)
        data = b.staging if self.reduce_dtype is None else b.staging.to(self.reduce_dtype)
        out = torch.empty(b.numel // self.dp, dtype=data.dtype, device=data.device)
        handle = reduce_scatter_flat(out, data, group=self.dp_group, async_op=True)
        b.reduce, b.staging = (handle, out, data), None
        self.stats.grad_reductions += 1
        self.stats.events.append(("reduce", b.index, when))
        # At most MAX_REDUCING in flight: the oldest is finished (its whole-gradient input freed) as a new one is
        # issued, a layer's backward after it started, instead of living until its bucket's next micro-batch.
        self._reducing.append(b)
        while len(self._reducing) > MAX_REDUCING:
            self._finish_reduce(self._reducing[0])

    def _finish_reduce(self, b: ShardedBucket) -> None:
        if b.reduce is None:
            return
        self._reducing.remove(b)
        handle, out, _ = b.reduce
        handle.wait()
        if self.replicate_group is not None:  # hybrid sharding: summed over the groups holding the same shard
            dist.all_reduce(out, group=self.replicate_group)
        shard = self._shard(b, self.grad_data)
        if b.reduced_this_step:
            shard.add_(out)
        else:
            shard.copy_(out)
        b.reduce, b.reduced_this_step = None, True

    def finish_grad_sync(self) -> None:
        """Reduce what backward left (a unit some parameter of which got no gradient), wait for every bucket;
        a bucket no backward reached this step has a zero gradient."""
        for b in self.buckets:
            if b.staging is not None:
                self._start_reduce(b, "after backward")
        for b in self.buckets:
            self._finish_reduce(b)
            if self.dp > 1 and not b.reduced_this_step:
                self._shard(b, self.grad_data).zero_()
            b.pending = len(b.params)
        for p in self._unwritten:  # one rank: parameters no backward reached
            s, e = self.param_range[p]
            self.grad_data[s:e].zero_()
        self._unwritten.clear()

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.reduced_this_step, b.pending, b.staging = False, len(b.params), None
        self._unwritten = set(self.spec_of) if self.dp == 1 else set()
        self.stats.events.clear()

    # ---- after the optimizer step ----------------------------------------------------------------

    def start_param_gather(self, overlap: bool) -> None:
        """The shards changed: every gathered copy is stale (the next forward gathers again)."""
        for b in self.buckets:
            self._free(b.index, "after step")

    def finish_param_gather(self) -> None:
        pass


def _point_at(b: ShardedBucket, param_range: dict[nn.Parameter, tuple[int, int]]) -> None:
    """Make the bucket's parameters views of `b.full` again (after it was replaced by the shard itself)."""
    for p in b.params:
        s, e = param_range[p]
        p.data = b.full[s - b.start : e - b.start].view(p.shape)


def _replace_parameters(module: nn.Module, new: dict[int, nn.Parameter]) -> None:
    """Put the new parameters where the meta ones were (every module holding one, so a tied weight stays tied)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[name] = new[id(p)]


Buffer = GradBuffer | ShardedBuffer  # what the optimizer, the gradient norm and checkpoints read


def owned_ranges(buf: Buffer) -> Iterator[tuple[nn.Parameter, int, int, int]]:
    """(parameter, start, end, its own start) of every flat range [start, end) of a parameter that this rank's shard
    of `buf` holds: what the optimizer steps and initialisation writes."""
    for bucket in buf.buckets:
        lo, hi = buf.shard_range(bucket, buf.replica_rank)
        for p in bucket.params:
            first, last = buf.param_range[p]
            start, end = max(first, lo), min(last, hi)
            if start < end:
                yield p, start, end, first
