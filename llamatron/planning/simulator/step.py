"""One optimizer step, simulated: the pipeline timeline of every stage (timeline.py) with the costs of
costs.py, then the data-parallel collectives per gradient bucket and the optimizer.

Data parallelism as llamatron does it (parallel/grad_buffer.py): each model chunk's parameters sit in
buckets of ~bucket_size elements in reverse order of use; a bucket's reduce-scatter (all-reduce without the
distributed optimizer) is issued once per step, when its last gradient of the step's last micro-batch has
arrived (with --no-overlap-grad-reduce: all of them after the last backward); the collectives of a rank run
one after another on its data-parallel stream. With the distributed optimizer the updated parameters are
all-gathered bucket by bucket at the start of the next step, first layers first, and each layer's first
forward waits for its bucket (with --no-overlap-param-gather: all of them after the optimizer, exposed).
Expert weights of a mixture of experts are reduced over the dp/ep ranks holding the same experts. Every
rank waits for the slowest before the optimizer (the global gradient norm). Overlapped collectives slow the
compute beside them by their bytes / contention bandwidth, at most by the time they run beside it
(calibration.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...models import ModelConfig
from ...models.inventory import flops_per_token
from ..params import layer_shards
from .calibration import Calibration, load_calibration
from .chunks import Chunk, build_chunks
from .costs import Costs, Shape, StepOptions
from .dataparallel import DataParallel
from .fsdp import exposed_per_micro_batch, layer_traffic
from .hardware import Hardware
from .timeline import ChunkDurations, Event, run_pipeline


@dataclass
class StepResult:
    step_seconds: float
    tokens_per_step: float
    gpus: int
    model_flops_per_token: float
    peak_flops: float
    parts: dict[str, float]  # seconds on the critical rank; they add up to the step
    dp_comm_seconds: float  # the data-parallel collectives' own time on the busiest rank
    dp_exposed_seconds: float  # the part of it (and of the gather waits) not hidden behind compute
    events: list[Event] = field(default_factory=list)

    @property
    def tokens_per_sec_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_seconds / self.gpus

    @property
    def mfu(self) -> float:
        return self.tokens_per_sec_per_gpu * self.model_flops_per_token / self.peak_flops


@dataclass
class _Prepared:
    """What a step's timeline runs: the costs, the chunks (with --fsdp's collectives in them), the durations the
    schedule sees, the point-to-point time between stages and --fsdp's tail."""

    costs: Costs
    chunks: list[Chunk]
    durations: list[ChunkDurations]
    p2p: float
    fsdp_tail: float


def _prepare(model: ModelConfig, s: Shape, hw: Hardware, opt: StepOptions, cal: Calibration) -> _Prepared:
    costs = Costs(model, s, hw, cal)
    chunks = build_chunks(model, s, costs, s.vpp, s.pp_layers)
    fsdp_tail = _add_fsdp(model, s, hw, opt, costs, chunks) if opt.fsdp is not None else 0.0
    zb = opt.schedule == "zb-h1"
    durations = [
        ChunkDurations(
            ch.forward.seconds, ch.backward.seconds + (0 if zb else ch.weight.seconds), ch.weight.seconds if zb else 0.0
        )
        for ch in chunks
    ]
    stride = s.tp * s.cp * s.dp
    p2p = costs.p2p(across_nodes=stride * s.pp > hw.gpus_per_node) if s.pp > 1 else 0.0
    return _Prepared(costs, chunks, durations, p2p, fsdp_tail)


def simulate_step(
    model: ModelConfig, s: Shape, hw: Hardware, opt: StepOptions, cal: Calibration | None = None
) -> StepResult:
    """Simulate one optimizer step of `model` laid out as `s` on `hw` (one data-parallel replica's pipeline:
    every replica runs the same)."""
    cal = cal or load_calibration()
    prep = _prepare(model, s, hw, opt, cal)
    costs, chunks, p2p = prep.costs, prep.chunks, prep.p2p
    zb = opt.schedule == "zb-h1"
    dp = DataParallel(model, s, hw, opt, costs, chunks)
    gathers = dp.gathers() if s.distributed_optimizer and opt.overlap_param_gather else {}
    events = run_pipeline(
        s.pp, s.vpp, opt.micro_batches, prep.durations, p2p, zb, dp.first_forward(gathers) if gathers else None
    )
    done = dp.finish(events, gathers, zb)
    if model.is_moe and model.router_aux_loss_scope == "global_batch":
        routing = _routing_pass(model, s, opt, costs, chunks, p2p)
        done.step_seconds += routing
        done.parts["routing_pass"] = routing
    if opt.optimizer_extra:  # --optimizer muon: Newton-Schulz and its updates' traffic, after the reduction
        done.step_seconds += opt.optimizer_extra
        done.parts["optimizer"] = done.parts.get("optimizer", 0.0) + opt.optimizer_extra
    if prep.fsdp_tail:  # the step's last reduce-scatter (the first unit's), waited for before the optimizer
        done.step_seconds += prep.fsdp_tail
        done.parts["fsdp"] = done.parts.get("fsdp", 0.0) + prep.fsdp_tail
    # The GPU idles between kernels (host launches, synchronisation) for a share of every measured step.
    idle = done.step_seconds * cal.idle_share / (1 - cal.idle_share)
    return StepResult(
        done.step_seconds + idle,
        opt.micro_batches * s.micro_batch_size * s.seq_length * s.dp,
        s.tp * s.cp * s.dp * s.pp,
        flops_per_token(model, s.seq_length),
        hw.gpu.peak_flops,
        {**done.parts, "idle": idle},
        done.dp_comm_seconds,
        done.dp_exposed_seconds,
        done.events,
    )


def step_seconds_bound(
    model: ModelConfig, s: Shape, hw: Hardware, opt: StepOptions, cal: Calibration | None = None
) -> float:
    """A lower bound of simulate_step's step_seconds from the same costs, without the timeline (a millisecond or
    so). A rank runs its actions one after another; its first, micro-batch 0's forward of its first chunk, starts
    once that forward has come through the chunks before it (a first forward waiting for its all-gathers only
    takes longer); its schedule's last action, the last micro-batch's backward of its first chunk, is followed by
    that micro-batch's backward through the chunks before it. The routing pass's forwards, --fsdp's tail and the
    idle share are added as simulate_step adds them; what is left out (the data-parallel collectives, the
    optimizer, the waits inside the pipeline) only lengthens the step."""
    cal = cal or load_calibration()
    prep = _prepare(model, s, hw, opt, cal)
    m, chunks, p2p = opt.micro_batches, prep.durations, prep.p2p

    def busiest(forward_only: bool) -> float:
        ends = []
        for r in range(s.pp):
            mine = chunks[r :: s.pp]
            arrival = sum(d.forward + p2p for d in chunks[:r])
            ordered = m * sum(d.forward + (0.0 if forward_only else d.backward) for d in mine)  # W: ZB-H1's own
            weights = 0.0 if forward_only else m * sum(d.weight for d in mine)
            drain = 0.0 if forward_only else sum(d.backward + p2p for d in chunks[:r])
            ends.append(arrival + max(ordered + drain, ordered + weights))
        return max(ends)

    step = busiest(False) + prep.fsdp_tail
    if model.is_moe and model.router_aux_loss_scope == "global_batch":
        step += busiest(True)
    return step / (1 - cal.idle_share)


def _routing_pass(
    model: ModelConfig, s: Shape, opt: StepOptions, costs: Costs, chunks: list[Chunk], p2p: float
) -> float:
    """Global-batch load balancing's routing pass (models/moe_balance.py, before the step's forward passes): every
    micro-batch forward without gradient through the forward-only schedule (each chunk's forward as in training:
    its GEMMs, attention, all-to-alls and the head), then the MoE layers' counts all-reduced over the
    data-parallel ranks."""
    forward = [ChunkDurations(ch.forward.seconds, 0.0, 0.0) for ch in chunks]
    events = run_pipeline(s.pp, s.vpp, opt.micro_batches, forward, p2p, forward_only=True)
    counts = model.num_moe_layers / s.pp * model.num_experts * 4  # fp32 per MoE layer of a stage and expert
    reduce = costs.collective("all_reduce", counts, s.dp * s.cp, costs.group_per_node(s.tp, s.dp * s.cp))
    return max(e.end for e in events) + reduce


def _add_fsdp(model: ModelConfig, s: Shape, hw: Hardware, opt: StepOptions, costs: Costs, chunks: list[Chunk]) -> float:
    """--fsdp's per-layer collectives into each chunk's forward and backward (simulator/fsdp.py); returns the
    exposed tail of the step (the first unit's last reduce-scatter)."""
    assert opt.fsdp is not None
    fs, gpn = opt.fsdp, hw.gpus_per_node

    def per_node(stride: int, size: int) -> int:  # consecutive replicas are tp ranks apart
        step = s.tp * stride
        return max(1, min(size, gpn // step)) if step <= gpn else 1

    dense, experts = layer_shards(model, s.tp, s.ep)
    t = layer_traffic(fs, dense, experts, opt.param_gather_bytes, opt.grad_reduce_bytes, costs.collective, per_node)
    layer = costs.layer(s.recompute != "none")
    backward = layer.backward_input.seconds + layer.backward_weight.seconds + layer.recompute.seconds
    contention = costs.cal.contention_bandwidth
    for ch in chunks:
        fwd, back, c_fwd, c_back = exposed_per_micro_batch(t, fs, ch.layer_forward, backward, contention)
        ch.forward.add("fsdp", fwd)
        ch.forward.add("contention", c_fwd)
        ch.backward.add("fsdp", back)
        ch.backward.add("contention", c_back)
    return t.reduce
