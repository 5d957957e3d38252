"""`llamatron plan`: every layout the trainer accepts for a model on a cluster, those that fit, fastest first
(the memory and speed of one layout are plan.py's model).

Context parallelism (--cp) is proposed only where it is needed or faster: the layouts without it are searched
first, and a layout with cp > 1 is listed only when none of them fits or it is expected faster than all that
do, by CONTEXT_SPEEDUP. cp splits the sequence, not the weights: it pays off for long sequences, whose
activations do not fit otherwise or whose tensor parallelism would move more than cp's K/V gathers; at short
ones it mostly adds traffic.

Sharding (`shardings`): with several replicas, each layout is weighed whole, with the distributed optimizer, with
--fsdp (and --fsdp-keep-params-in-backward), and with hybrid sharding over the replicas of one node when the
replicas span nodes; training.validate drops what the trainer refuses (--ep with --fsdp-shard-group). The planner
plans full training only: LoRA, which --fsdp refuses, is never proposed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from ..config.settings import RunConfig, config_from_values
from ..errors import ConfigError
from ..models import ModelConfig, get_preset
from ..models.inventory import num_params
from ..parallel.fsdp import fsdp_problems
from ..parallel.mesh import divisors
from ..training.validate import validate
from .params import bytes_per_param
from .plan import (
    GB,
    RUNTIME_BASE,
    RUNTIME_PER_COMM,
    Layout,
    Memory,
    Plan,
    Precision,
    SpeedAssumptions,
    estimate_speed,
    layout_memory,
    runtime_memory,
    static_memory,
)
from .simulator.hardware import resolve_hardware

RECOMPUTE_MODES = ("none", "selective", "full")
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
MAX_VPP = 8
MAX_EP = 8  # expert-parallel sizes searched (a node's worth of all-to-all)
# Without --seq-length: the model's context, at most this (Llama 4 Maverick's 1M-token context would plan
# million-token sequences; pre-training runs at 4-8k and extends the context afterwards).
DEFAULT_SEQ_LENGTH = 8192
DEFAULT_BATCH_TOKENS = 4 * 2**20  # ~4M tokens per step when --global-batch-size is not given
# A cp layout is listed beside layouts without cp only when expected this much faster than all of them: the
# speed model is calibrated to ~10%, and under cp attention runs flex attention over a mask of this rank's
# query positions instead of the causal kernels, which the model (layouts, not kernels) does not see.
CONTEXT_SPEEDUP = 1.05

# ---- search -------------------------------------------------------------------------------------------------


def _run_config(model_name: str, overrides: dict | None, lay: Layout, seq_length: int) -> RunConfig:
    values = {
        "model": model_name,
        "tp": lay.tp,
        "cp": lay.cp,
        "ep": lay.ep,
        "pp": lay.pp,
        "vpp": lay.vpp,
        "sequence_parallel": lay.sequence_parallel,
        "recompute": lay.recompute,
        "recompute_layers": lay.recompute_layers,
        "micro_batch_size": lay.micro_batch_size,
        "global_batch_size": lay.global_batch_size,
        "seq_length": seq_length,
        "precision": "bf16",
        "device": "cuda",
    }
    if lay.fsdp:  # --fsdp refuses --distributed-optimizer given beside it (it shards the optimizer already)
        values["fsdp"] = True
        values["fsdp_shard_group"] = lay.fsdp_shard_group
        values["fsdp_keep_params_in_backward"] = lay.fsdp_keep_params
    else:
        values["distributed_optimizer"] = lay.distributed_optimizer
    if overrides:
        values["model_overrides"] = overrides
    return config_from_values(values)


def shardings(replicas: int, tp: int, gpus_per_node: int) -> list[dict]:
    """How the replicas may hold the weights: whole (with the optimizer state whole or sharded), or --fsdp over
    all of them (with and without --fsdp-keep-params-in-backward), or hybrid: sharded within the replicas of one
    node, replicated across nodes (the one hybrid group size searched)."""
    if replicas == 1:
        return [{}]
    out: list[dict] = [
        {},
        {"distributed_optimizer": True},
        {"fsdp": True},
        {"fsdp": True, "fsdp_keep_params": True},
    ]
    node = max(1, gpus_per_node // tp)
    if 1 < node < replicas and replicas % node == 0:
        out.append({"fsdp": True, "fsdp_shard_group": node})
    return out


def default_seq_length(model: ModelConfig) -> int:
    """The sequence length planned when none is given: the model's context, at most DEFAULT_SEQ_LENGTH."""
    return min(model.max_seq_length, DEFAULT_SEQ_LENGTH)


def context_sizes(gpus: int, seq_length: int) -> list[int]:
    """The cp sizes worth searching: 1, 2, 4, 8, ... dividing the GPU count, with the sequence cut into 2*cp
    chunks (training.validate checks the rest: with sequence parallelism each rank's part splits over tp)."""
    return [
        c for c in (2**i for i in range(gpus.bit_length())) if gpus % c == 0 and (c == 1 or seq_length % (2 * c) == 0)
    ]


def candidate_layouts(
    model_name: str,
    gpus: int,
    seq_length: int,
    gpus_per_node: int,
    global_batch_size: int | None = None,
    model_overrides: dict | None = None,
    context: Iterable[int] = (1,),
    worth: Callable[[Layout], bool] | None = None,
) -> Iterator[Layout]:
    """Every layout the trainer accepts (training.validate) with tp inside a node, cp in `context`, even pipeline
    splits and sequence parallelism whenever tp > 1. Without a global batch size, each layout gets the multiple
    of micro-batch x dp (x pp when interleaved) closest to ~4M tokens. `worth`: a cheap test a layout must pass
    before the (costlier) validation."""
    model = _model(model_name, model_overrides)

    def eps(dp: int) -> list[int]:  # expert parallelism: sizes dividing dp and the experts (MoE models only)
        return [e for e in divisors(dp) if e <= MAX_EP and model.num_experts % e == 0] if model.is_moe else [1]

    checked: dict[Layout, bool] = {}

    def valid(lay: Layout) -> bool:
        """training.validate on the layout without its sharding (once for all shardings), then what --fsdp adds."""
        plain = replace(lay, distributed_optimizer=False, fsdp=False, fsdp_shard_group=None, fsdp_keep_params=False)
        if plain not in checked:
            try:
                validate(_run_config(model_name, model_overrides, plain, seq_length), gpus, cuda_available=True)
                checked[plain] = True
            except ConfigError:
                checked[plain] = False
        keep, group = lay.fsdp_keep_params, lay.fsdp_shard_group
        refused = lay.fsdp and fsdp_problems(
            True, keep, True, group, lay.replicas, [], lay.tp, lay.pp, lay.cp, lay.ep, "none", 0
        )
        return checked[plain] and not refused

    sizes = [
        (tp, cp, pp)
        for tp in divisors(gpus)
        if tp <= gpus_per_node and gpus_per_node % tp == 0
        for cp in context
        if (gpus // tp) % cp == 0
        for pp in divisors(gpus // (tp * cp))
    ]
    for tp, cp, pp in sizes:
        dp = gpus // (tp * cp * pp)
        vpps = [1] + [v for v in range(2, MAX_VPP + 1) if pp > 1 and model.num_layers % (pp * v) == 0]
        for vpp, mb, recompute in ((v, b, r) for v in vpps for b in MICRO_BATCH_SIZES for r in RECOMPUTE_MODES):
            gbs = global_batch_size
            if gbs is None:
                step = mb * dp * (pp if vpp > 1 else 1)
                gbs = max(1, round(DEFAULT_BATCH_TOKENS / seq_length / step)) * step
            for sharding, ep in ((d, e) for d in shardings(dp * cp, tp, gpus_per_node) for e in eps(dp)):
                kw = {"distributed_optimizer": False, **sharding}
                lay = Layout(
                    tp,
                    pp,
                    vpp,
                    dp,
                    tp > 1,
                    recompute=recompute,
                    micro_batch_size=mb,
                    global_batch_size=gbs,
                    cp=cp,
                    ep=ep,
                    **kw,
                )
                if worth is not None and not worth(lay):
                    continue
                if valid(lay):
                    yield lay


@dataclass
class PlanResult:
    model: str
    gpus: int
    gpu_memory: float
    seq_length: int
    fits: list[Plan]
    explanation: str = ""


def plan(
    model_name: str,
    gpus: int,
    gpu_memory: float,
    seq_length: int,
    global_batch_size: int | None = None,
    gpus_per_node: int = 8,
    model_overrides: dict | None = None,
    precision: Precision = Precision(),
    explain: bool = True,
    speed: SpeedAssumptions = SpeedAssumptions(),
) -> PlanResult:
    """All layouts that fit, fastest first; when none does, an explanation of why."""
    _check_inputs(model_name, gpus, gpu_memory, seq_length, gpus_per_node, global_batch_size)
    model = _model(model_name, model_overrides)

    def evaluate(context: Iterable[int], worth: Callable[[Layout], bool] | None = None) -> tuple[list, list]:
        layouts = candidate_layouts(
            model_name, gpus, seq_length, gpus_per_node, global_batch_size, model_overrides, context, worth
        )
        return _evaluate(model, layouts, seq_length, gpu_memory, precision, gpus, gpus_per_node, speed)

    fits, rejected = evaluate((1,))
    context = [c for c in context_sizes(gpus, seq_length) if c > 1]
    if context:
        # cp only where needed or faster: a cp layout must beat every layout without cp that fits, by CONTEXT_SPEEDUP.
        to_beat = CONTEXT_SPEEDUP * max((p.speed.tokens_per_sec_per_gpu for p in fits), default=0.0)
        # Without any valid layout to explain a failure by, cp layouts are modelled in full even when their
        # weights alone cannot fit (the explanation names the smallest).
        worth = _ContextFilter(
            model, seq_length, gpu_memory, precision, gpus, gpus_per_node, to_beat, speed, bool(fits or rejected)
        )
        cp_fits, cp_rejected = evaluate(context, worth)
        fits += [p for p in cp_fits if p.speed.tokens_per_sec_per_gpu > to_beat]
        rejected += cp_rejected
    fits = _drop_dominated_recompute(fits)
    fits.sort(key=lambda p: (-p.speed.tokens_per_sec_per_gpu, p.memory.total))
    result = PlanResult(model_name, gpus, gpu_memory, seq_length, fits)
    if not fits and explain:
        result.explanation = _explain(
            model_name,
            model,
            gpus,
            gpu_memory,
            seq_length,
            gpus_per_node,
            global_batch_size,
            model_overrides,
            precision,
            rejected,
        )
    return result


def _evaluate(
    model: ModelConfig,
    layouts: Iterable[Layout],
    seq_length: int,
    gpu_memory: float,
    precision: Precision,
    gpus: int,
    gpus_per_node: int,
    speed: SpeedAssumptions,
) -> tuple[list[Plan], list[tuple[Layout, Memory]]]:
    """(the layouts that fit, with their partial-recompute variants; those that do not, with their memory)."""
    fits, rejected = [], []
    for lay in layouts:
        mem = layout_memory(model, lay, seq_length, precision)
        if mem.total <= gpu_memory:
            fits.append(
                Plan(lay, mem, estimate_speed(model, lay, seq_length, gpus, gpus_per_node, speed, fp8=precision.fp8))
            )
        else:
            rejected.append((lay, mem))
    fits += _partial_recompute(model, fits, rejected, seq_length, gpu_memory, precision, gpus, gpus_per_node, speed)
    return fits, rejected


@dataclass
class _ContextFilter:
    """Whether a cp layout can fit and be listed, judged before validating it or modelling its activations:
    its weights, gradients and optimizer state (which cp does not shrink) and the runtime must fit, and where a
    layout without cp fits it must be faster than `to_beat` even without recompute (recompute, partial or not,
    only slows a layout down)."""

    model: ModelConfig
    seq_length: int
    gpu_memory: float
    precision: Precision
    gpus: int
    gpus_per_node: int
    to_beat: float  # tokens/s per GPU; 0 when no layout without cp fits
    speed: SpeedAssumptions = field(default_factory=SpeedAssumptions)
    static_bound: bool = True  # skip the layouts whose weights, gradients, optimizer state and runtime overflow
    _static_fits: dict[tuple, bool] = field(default_factory=dict)  # by what the lower bound depends on

    def __call__(self, lay: Layout) -> bool:
        if lay.micro_batches < 1 or (self.static_bound and not self._fits_statically(lay)):
            return False  # (no micro-batch: the global batch does not split, training.validate rejects it)
        if self.to_beat == 0:
            return True
        fastest = replace(lay, recompute="none", recompute_layers=None)
        speed = estimate_speed(
            self.model, fastest, self.seq_length, self.gpus, self.gpus_per_node, self.speed, fp8=self.precision.fp8
        )
        return speed.tokens_per_sec_per_gpu > self.to_beat

    def _fits_statically(self, lay: Layout) -> bool:
        key = (lay.tp, lay.cp, lay.pp, lay.vpp, lay.replicas, lay.ep, lay.sharding, lay.fsdp_keep_params)
        if key not in self._static_fits:
            try:
                least = static_memory(self.model, lay, self.precision) + runtime_memory(lay)
                self._static_fits[key] = least <= self.gpu_memory
            except ConfigError:  # pp*vpp does not divide the layers: training.validate rejects it too
                self._static_fits[key] = False
        return self._static_fits[key]


def _partial_recompute(
    model: ModelConfig,
    fits: list[Plan],
    rejected: list,
    seq_length: int,
    gpu_memory: float,
    precision: Precision,
    gpus: int,
    gpus_per_node: int,
    speed: SpeedAssumptions,
) -> list[Plan]:
    """Where full recompute fits and no recompute does not, the fewest recomputed layers per chunk that fit
    (--recompute-layers N): each layer not recomputed saves a layer's forward."""
    too_big = {replace(lay, recompute="full") for lay, _ in rejected if lay.recompute == "none"}
    out = []
    for p in fits:
        lay = p.layout
        if lay.recompute != "full" or lay.recompute_layers is not None or lay not in too_big:
            continue
        per_chunk = model.num_layers // (lay.pp * lay.vpp)
        lo, hi = 1, per_chunk  # hi: all of the chunk's layers (fits)
        while lo < hi:  # smallest N that fits; memory falls as N grows
            mid = (lo + hi) // 2
            if layout_memory(model, replace(lay, recompute_layers=mid), seq_length, precision).total <= gpu_memory:
                hi = mid
            else:
                lo = mid + 1
        if lo < per_chunk:
            partial = replace(lay, recompute_layers=lo)
            mem = layout_memory(model, partial, seq_length, precision)
            out.append(
                Plan(
                    partial,
                    mem,
                    estimate_speed(model, partial, seq_length, gpus, gpus_per_node, speed, fp8=precision.fp8),
                )
            )
    return out


def _drop_dominated_recompute(fits: list[Plan]) -> list[Plan]:
    """Drop a recomputing layout when the same layout without recompute also fits and needs at most 1% more
    memory (selective recompute frees almost nothing when the attention kernel keeps no score matrix): it is
    only slower."""

    def key(p: Plan) -> tuple:
        lay = p.layout
        return (
            lay.tp,
            lay.cp,
            lay.pp,
            lay.vpp,
            lay.dp,
            lay.sequence_parallel,
            lay.distributed_optimizer,
            lay.ep,
            lay.sharding,
            lay.fsdp_keep_params,
            lay.micro_batch_size,
            lay.global_batch_size,
        )

    plain = {key(p): p.memory.total for p in fits if p.layout.recompute == "none"}
    return [p for p in fits if p.layout.recompute == "none" or plain.get(key(p), float("inf")) > 1.01 * p.memory.total]


def _model(model_name: str, overrides: dict | None) -> ModelConfig:
    cfg = RunConfig(model_overrides=dict(overrides or {}))
    cfg.train.model = model_name
    return cfg.model_config()


def _check_inputs(
    model_name: str, gpus: int, gpu_memory: float, seq_length: int, gpus_per_node: int, global_batch_size: int | None
) -> None:
    try:
        model = get_preset(model_name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if gpus < 1 or gpus_per_node < 1:
        raise ConfigError("--gpus and --gpus-per-node must be >= 1")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ConfigError(f"--gpus {gpus} spans nodes but is not a multiple of --gpus-per-node {gpus_per_node}")
    if gpu_memory <= 0:
        raise ConfigError("--gpu-memory must be positive")
    problems = model.seq_length_problems(seq_length, model_name)
    if problems:
        raise ConfigError("; ".join(problems))
    if global_batch_size is not None and global_batch_size < 1:
        raise ConfigError("--global-batch-size must be >= 1")


def minimum_gpus(
    model_name: str,
    gpu_memory: float,
    seq_length: int,
    gpus_per_node: int = 8,
    global_batch_size: int | None = None,
    model_overrides: dict | None = None,
    precision: Precision = Precision(),
    start: int = 1,
    limit: int = 16384,
) -> int | None:
    """The smallest GPU count >= start (powers of two inside a node, whole nodes beyond) where a layout fits.

    Doubling counts are tried first, so that a model that fits on no count is answered after ~log2(limit) plans,
    not one plan per node; then the counts between the last doubling that failed and the first that fits, one by
    one (halving first while more than 64 are left, which assumes more GPUs there never fit worse).
    """
    model = _model(model_name, model_overrides)
    counts = [
        g
        for g in [2**i for i in range(32) if 2**i < gpus_per_node]
        + list(range(gpus_per_node, limit + 1, gpus_per_node))
        if g >= start
    ]

    def fits(gpus: int) -> bool:
        # Quick bound: even sharded perfectly (--fsdp over every GPU), each GPU holds the weights, gradients and
        # optimizer state of 1/gpus of the parameters, and the CUDA runtime (with NCCL's buffers once there are
        # several GPUs), which no GPU count shrinks.
        runtime = RUNTIME_BASE + (RUNTIME_PER_COMM if gpus > 1 else 0)
        if num_params(model) * sum(bytes_per_param(precision.dtype, True, 1)) / gpus + runtime > gpu_memory:
            return False
        return bool(
            plan(
                model_name,
                gpus,
                gpu_memory,
                seq_length,
                global_batch_size,
                gpus_per_node,
                model_overrides,
                precision,
                explain=False,
            ).fits
        )

    doubling = [i for i, g in enumerate(counts) if g < gpus_per_node or (g // gpus_per_node).bit_count() == 1]
    if counts and doubling[-1:] != [len(counts) - 1]:
        doubling.append(len(counts) - 1)  # the limit itself
    failed = -1  # index into counts of the largest count known not to fit
    for i in doubling:
        if fits(counts[i]):
            break
        failed = i
    else:
        return None
    while i - failed > 64:
        mid = (failed + i) // 2
        if fits(counts[mid]):
            i = mid
        else:
            failed = mid
    return next(counts[k] for k in range(failed + 1, i + 1) if k == i or fits(counts[k]))


def _explain(
    model_name: str,
    model: ModelConfig,
    gpus: int,
    gpu_memory: float,
    seq_length: int,
    gpus_per_node: int,
    global_batch_size: int | None,
    overrides: dict | None,
    precision: Precision,
    rejected: list[tuple[Layout, Memory]],
) -> str:
    setup = (
        f"{model_name} ({num_params(model) / 1e9:.1f}B parameters) does not fit on {gpus} x {gpu_memory / GB:.0f} GB"
    )
    if not rejected:
        batch = f" and global batch size {global_batch_size}" if global_batch_size else ""
        return (
            f"{setup}: no layout of {gpus} GPUs is valid for this model{batch} (tp must divide the heads and "
            f"stay within a node of {gpus_per_node}, pp*vpp must divide its {model.num_layers} layers, 2*cp the "
            f"sequence)"
        )
    static_lay, static_mem = min(rejected, key=lambda r: (r[1].static, -r[0].tp))
    per_param = sum(bytes_per_param(precision.dtype, True, 1))
    perfect = per_param * num_params(model) / gpus
    if perfect > gpu_memory:
        why = (
            f"weights+grads+optimizer alone need {perfect / GB:.1f} GB per GPU even sharded perfectly over all "
            f"{gpus} GPUs ({per_param:.0f} bytes a parameter / {gpus}, as --fsdp over every GPU would)"
        )
    elif static_mem.static > gpu_memory:
        why = (
            f"weights+grads+optimizer alone need {static_mem.static / GB:.1f} GB per GPU in the layout that shards "
            f"them furthest ({static_lay.label}, sharding {static_lay.sharding})"
        )
    else:
        lay, mem = min(rejected, key=lambda r: r[1].total)
        why = (
            f"the smallest layout ({lay.label}, recompute {lay.recompute}, micro-batch "
            f"{lay.micro_batch_size}) needs {mem.total / GB:.1f} GB: weights+grads+optimizer {mem.static / GB:.1f}, "
            f"activations {mem.activations / GB:.1f}, buffers {mem.buffers_total / GB:.1f}"
        )
    needed = minimum_gpus(
        model_name, gpu_memory, seq_length, gpus_per_node, global_batch_size, overrides, precision, start=gpus + 1
    )
    more = f"; it needs at least {needed} GPUs of this size" if needed else ""
    h200 = resolve_hardware("h200").gpu.memory
    if perfect > gpu_memory and perfect + RUNTIME_BASE <= h200:  # the bound is met on a larger GPU
        more += f"; an H200 (--gpu h200) holds {h200 / GB:.1f} GB, above that bound: plan with it to see what fits"
    return f"{setup}: {why}, and a GPU has {gpu_memory / GB:.1f} GB{more}"
