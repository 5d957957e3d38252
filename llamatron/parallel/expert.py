"""Mixture-of-experts layers split over ranks: experts over the expert-parallel group, every expert's ffn over the
tensor-parallel group.

Expert parallelism (`--ep N`, carved out of the data-parallel ranks: parallel/mesh.py) gives each of the N ranks
of an `ep_group` num_experts / N of every MoE layer's experts, a contiguous range. A layer's tokens then travel:
each rank routes its own tokens, sorts their choices by expert (so they are grouped by the rank that holds the
expert), sends each rank its part with one all-to-all, runs its experts on what it received and sends the
results back with a second; backward runs the same two in reverse, the second of them (the tokens' gradient
going home) beside the experts' gate_up weight gradient. The split sizes depend on the routing, so each layer
first exchanges its per-expert counts (a host read: dropless routing has no fixed size).

Tensor parallelism splits every expert's ffn (and a shared expert's) as it splits the dense MLP (gate and up by rows,
down by columns):
each tp rank takes the whole sequence (gathered under sequence parallelism), routes it as every other tp rank
does, computes its slice of each expert and contributes a partial sum (reduce-scattered or all-reduced). Each
tp rank's router gradient is then a partial sum too (summed by sync_tensor_parallel_grads), and each carries
1/tp of the router losses' gradient, which every tp rank computes whole.

Expert tensor parallelism 1 (`--etp 1`, Megatron-core's "MoE parallel folding"; needs sequence parallelism) keeps
every expert whole instead: the tp ranks become more expert-parallel ranks (mesh.expert_group, ep x tp of them,
each holding num_experts / (ep x tp) whole experts), and each tp rank routes only its own sequence shard, so no
expert GEMM is split and nothing is gathered or reduced around the routed experts. The per-sequence statistics
(the router losses' token shares and mean probabilities, the z-loss, the balancing counts, a capacity's choice)
are summed over the tp ranks (TensorParallelShards); each rank's router gradient is its own tokens' part (still a
partial sum over tp), carrying the whole of the router losses' gradient for them. A shared expert stays split
over tp as above, gathered and reduce-scattered on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

from ..models.config import ModelConfig
from ..models.moe import Experts, MoE, Routing, SequenceShards, SharedExpert, permute, unpermute
from .layout import divisors
from .mesh import Mesh
from .param_spec import ParamSpecs, param_specs
from .tensor import gate_up_layout
from .tensor_layers import contiguous_layout, from_parallel_output, to_parallel_input


def expert_parallel_problems(
    model: ModelConfig, ep: int, cp: int, tp: int = 1, etp: int | None = None, sequence_parallel: bool = False
) -> list[str]:
    """Why a model cannot be split `ep` ways over its experts, each expert `etp` ways (None: tp) (empty when it
    can)."""
    if not model.is_moe:
        out = [f"--ep {ep} needs a mixture-of-experts model (num_experts > 0); use --ep 1"] if ep > 1 else []
        return out + _etp_problems(etp, tp, sequence_parallel, moe=False)
    out = _etp_problems(etp, tp, sequence_parallel, moe=True)
    folded = tp if etp == 1 else 1  # the tp ranks hold different experts under etp 1
    if model.num_experts % (ep * folded):
        by = f"--ep {ep} x --tp {tp} (--etp 1)" if folded > 1 else f"--ep {ep}"
        fits = [d for d in divisors(model.num_experts) if d % folded == 0]
        out.append(
            f"num_experts {model.num_experts} is not divisible by {by}; use --ep in {[d // folded for d in fits]}"
        )
    if cp > 1:
        out.append(
            f"--cp {cp} with a mixture of experts: its router losses are per sequence and context parallelism "
            "splits each sequence; use --cp 1"
        )
    return out


def _etp_problems(etp: int | None, tp: int, sequence_parallel: bool, moe: bool) -> list[str]:
    if etp is None or etp == tp:
        return []
    if etp != 1:
        return [f"--etp {etp} must be 1 (whole experts) or the --tp size {tp} (experts split like the MLP)"]
    if not moe:
        return ["--etp 1 splits a mixture of experts' experts; this model has none: drop --etp"]
    if not sequence_parallel:
        return [f"--etp 1 with --tp {tp} routes each tp rank's sequence shard: add --sequence-parallel"]
    return []


class TensorParallelShards(SequenceShards):
    """Each sequence split over the tp group (sequence parallelism), routed by part (expert tensor parallelism
    1): the statistics summed over it, a capacity's choice gathered from it."""

    def __init__(self, group: dist.ProcessGroup | None, tp: int, rank: int):
        self.group, self.count, self.rank = group, tp, rank
        self.sum = self._sum  # type: ignore[method-assign]
        self.gather = self._gather  # type: ignore[method-assign]

    def run_eagerly_under_compile(self) -> None:
        """Keep torch.compile out of the collectives, as ExpertParallelDispatch's exchange (called by
        apply_compile: torch.compiler.disable imports torch._dynamo, which an eager run never needs)."""
        self.sum = torch.compiler.disable(self._sum)  # type: ignore[method-assign]
        self.gather = torch.compiler.disable(self._gather)  # type: ignore[method-assign]

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.count)]
        dist.all_gather(parts, t.detach().contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        n = t.shape[1] // self.count
        return t[:, self.rank * n : (self.rank + 1) * n]


class _AllToAll(Function):
    """Rows of `x` in blocks by destination rank -> rows received, in blocks by source rank; backward reverses."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _all_to_all(x, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


@dataclass
class _Exchange:
    """One layer call's token exchange: split sizes by rank, the regroup order, the local experts' counts."""

    send: list[int]
    receive: list[int]
    by_expert: torch.Tensor
    counts: torch.Tensor
    group: dist.ProcessGroup
    overlap: bool
    events: list[str]


class _DispatchAndGateUp(Function):
    """The dispatch (all-to-all, regroup by local expert) and the experts' gate_up matmul, in one node so that its
    backward can send the tokens' gradient back to their ranks while the gate_up weight gradient is computed: the
    overlap expert parallelism has (forward has no work independent of the tokens it waits for)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate_up: torch.Tensor, experts: Experts, ex: _Exchange) -> torch.Tensor:
        regrouped = _all_to_all(x, ex.send, ex.receive, ex.group)[ex.by_expert]
        ctx.save_for_backward(regrouped, gate_up)
        ctx.experts, ctx.ex = experts, ex
        return experts.project(regrouped, gate_up, ex.counts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        regrouped, gate_up = ctx.saved_tensors
        ex: _Exchange = ctx.ex
        grad_regrouped = ctx.experts.input_grad(grad, gate_up, ex.counts)
        grad_received = unpermute(grad_regrouped, ex.by_expert)
        grad_x = grad_received.new_empty((sum(ex.send), grad_received.shape[1]))
        work = dist.all_to_all_single(
            grad_x,
            grad_received,
            output_split_sizes=ex.send,
            input_split_sizes=ex.receive,
            group=ex.group,
            async_op=True,
        )
        ex.events.append("input gradient sent")
        if not ex.overlap:
            work.wait()
            ex.events.append("input gradient received")
        grad_weight = ctx.experts.weight_grad(grad, regrouped, ex.counts, gate_up)
        ex.events.append("weight gradient")
        if ex.overlap:
            work.wait()
            ex.events.append("input gradient received")
        return grad_x, grad_weight, None, None


class ExpertParallelDispatch:
    """MoE.dispatch over an ep group: the sorted choices to the ranks holding their experts, and back.

    overlap: backward's first all-to-all runs beside the gate_up weight gradient (off: one after the other; for
    tests). events: what each backward did, in order (tests read it)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, local_experts: int, overlap: bool = True):
        self.group, self.ep, self.local = group, ep, local_experts
        self.overlap = overlap
        self.events: list[str] = []
        # Split sizes are read on the host: a compiled layer runs around the exchange (run_eagerly_under_compile,
        # called by apply_compile). Not disabled here: torch.compiler.disable imports torch._dynamo (1.5 s of CPU
        # a process), which an eager run never needs.
        self._exchange = self._exchange_eagerly

    def run_eagerly_under_compile(self) -> None:
        """Keep torch.compile out of the exchange: a compiled layer calls it eagerly."""
        self._exchange = torch.compiler.disable(self._exchange_eagerly)

    def __call__(self, tokens: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        return self._exchange(tokens, routing, experts)

    def _exchange_eagerly(self, tokens: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        ep, local = self.ep, self.local
        counts = routing.counts  # by global expert: blocks of `local` per destination rank
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # (source, local expert) counts
        grid = received_counts.view(ep, local)
        send, receive = counts.view(ep, local).sum(1).tolist(), grid.sum(1).tolist()
        # Received rows are by source, then by expert; the experts want them by expert, then source.
        by_expert = _source_major_to_expert_major(grid.tolist(), tokens.device)
        ex = _Exchange(send, receive, by_expert, grid.sum(0), self.group, self.overlap, self.events)
        gate_up_out = _DispatchAndGateUp.apply(permute(tokens, routing), experts.gate_up, experts, ex)
        out = experts.finish(gate_up_out, ex.counts)
        return _AllToAll.apply(unpermute(out, by_expert), receive, send, self.group)


def _source_major_to_expert_major(grid: list[list[int]], device: torch.device) -> torch.Tensor:
    """The row order that regroups rows laid out by (source, expert) blocks of sizes grid[s][e] by (expert,
    source)."""
    starts: list[list[int]] = []
    position = 0
    for row in grid:
        starts.append([])
        for n in row:
            starts[-1].append(position)
            position += n
    pieces = [
        torch.arange(starts[s][e], starts[s][e] + grid[s][e], device=device)
        for e in range(len(grid[0]))
        for s in range(len(grid))
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


def _split_shared_expert(shared: SharedExpert, prefix: str, mesh: Mesh, specs: ParamSpecs) -> ParamSpecs:
    """A shared expert's ffn split over tp like the routed experts' (gate and up by rows, down by columns): its output
    is a partial sum that joins theirs before the one reduction. What its `tp_split` keeps whole on every rank
    ("replicated_partial": Qwen2-MoE's sigmoid gate) scales a partial sum: its gradient is partial too."""
    ffn, hidden = shared.down.weight.shape[1], shared.down.weight.shape[0]
    group, rank = mesh.tp_group, mesh.tp_rank
    layouts = {
        "gate_up": (gate_up_layout(ffn, mesh.layout.tp, rank, group, dim=0), (2 * ffn, hidden)),
        "down": (contiguous_layout(1, ffn, mesh.layout.tp, rank, group), (hidden, ffn)),
    }
    for leaf, (layout, full) in layouts.items():
        name = f"{prefix}.{leaf}.weight"
        # not partial (as a replicated weight under sequence parallelism would be): each rank's slice is whole
        specs[name] = replace(specs[name], partial_grad=False).sharded(layout, full)
        getattr(shared, leaf).weight = nn.Parameter(torch.empty(specs[name].local_shape, device="meta"))
    for leaf, style in type(shared).tp_split.items():
        if style == "replicated_partial":  # whole on every rank (a family's gate), scaling a partial sum
            name = f"{prefix}.{leaf}.weight"
            specs[name] = replace(specs[name], partial_grad=True)
    return specs


def _split_experts_over_tp(moe: MoE, names: dict[str, str], mesh: Mesh, specs: ParamSpecs) -> ParamSpecs:
    """Every expert's ffn over the tp ranks (gate and up by rows, down by columns), as the dense MLP's."""
    num, ffn2, hidden = moe.experts.gate_up.shape
    ffn = ffn2 // 2
    group, rank = mesh.tp_group, mesh.tp_rank
    gu = gate_up_layout(ffn, mesh.layout.tp, rank, group, dim=1)
    dn = contiguous_layout(2, ffn, mesh.layout.tp, rank, group)
    for leaf, layout, full in (("gate_up", gu, (num, 2 * ffn, hidden)), ("down", dn, (num, hidden, ffn))):
        specs[names[leaf]] = replace(specs[names[leaf]], partial_grad=False).sharded(layout, full)
    return specs


def _route_sequence_shards(moe: MoE, mesh: Mesh, sequence_parallel: bool) -> None:
    """Expert tensor parallelism 1: the layer routes this tp rank's sequence shard (no gather, no reduction); only
    a shared expert, split over tp, gathers its input and reduce-scatters its output."""
    moe.shards = TensorParallelShards(mesh.tp_group, mesh.layout.tp, mesh.tp_rank)
    moe.shared_input = partial(to_parallel_input, group=mesh.tp_group, sequence_parallel=sequence_parallel)
    moe.shared_output = partial(from_parallel_output, group=mesh.tp_group, sequence_parallel=sequence_parallel)


def apply_expert_parallel(model: nn.Module, mesh: Mesh, sequence_parallel: bool, specs: ParamSpecs) -> ParamSpecs:
    """Split every MoE layer of `model` (on meta, after apply_tensor_parallel) over the layout's ep (experts) and tp
    (each expert's ffn, or under etp 1 more experts), in place; returns the specs with the experts' shards."""
    specs = dict(specs or param_specs(model))
    for prefix, moe in [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]:
        experts = moe.experts
        num = experts.gate_up.shape[0]
        names = {leaf: f"{prefix}.experts.{leaf}" for leaf in ("gate_up", "down")}
        router = f"{prefix}.router.weight"
        if mesh.layout.tp > 1:
            specs[router] = replace(specs[router], partial_grad=True)  # partial on each tp rank
            if moe.shared is not None:
                specs = _split_shared_expert(moe.shared, f"{prefix}.shared", mesh, specs)
        if mesh.layout.experts_fold_tp:
            _route_sequence_shards(moe, mesh, sequence_parallel)
        elif mesh.layout.tp > 1:
            specs = _split_experts_over_tp(moe, names, mesh, specs)
            moe.gather_input = partial(to_parallel_input, group=mesh.tp_group, sequence_parallel=sequence_parallel)
            moe.reduce_output = partial(from_parallel_output, group=mesh.tp_group, sequence_parallel=sequence_parallel)
            moe.router_loss_share = 1.0 / mesh.layout.tp
        if mesh.layout.expert_parallel > 1:
            local = num // mesh.layout.expert_parallel
            shard = (mesh.expert_rank * local, local)
            for leaf in names.values():
                # not partial under sequence parallelism: etp 1's tp ranks hold different experts
                fold = mesh.layout.experts_fold_tp
                specs[leaf] = replace(specs[leaf], expert_shard=shard, experts_over_tp=fold, partial_grad=False)
            assert mesh.expert_group is not None
            moe.dispatch = ExpertParallelDispatch(mesh.expert_group, mesh.layout.expert_parallel, local)
        for leaf, name in names.items():
            spec = specs[name]
            setattr(experts, leaf, nn.Parameter(torch.empty(spec.local_shape, device="meta")))
    return specs


__all__ = ["ExpertParallelDispatch", "TensorParallelShards", "apply_expert_parallel", "expert_parallel_problems"]
