"""`llamatron plan`: every layout the trainer accepts for a model on a cluster, those that fit, fastest first
(the memory and speed of one layout are plan.py's model).

Context parallelism (--cp) is proposed only where it is needed or faster: the layouts without it are searched
first, and a layout with cp > 1 is listed only when none of them fits or it is expected faster than all that
do, by CONTEXT_SPEEDUP. cp splits the sequence, not the weights: it pays off for long sequences, whose
activations do not fit otherwise or whose tensor parallelism would move more than cp's K/V gathers; at short
ones it mostly adds traffic.

Sharding (candidates.shardings): with several replicas, each layout is weighed whole, with the distributed
optimizer, with --fsdp (and --fsdp-keep-params-in-backward), and with hybrid sharding over the replicas of one
node when the replicas span nodes; training.validate drops what the trainer refuses (--ep with
--fsdp-shard-group). The planner plans full training only: LoRA, which --fsdp refuses, is never proposed.

The layouts searched are candidates.py's; a layout's memory is judged before the trainer's validation (the most
are too big), and the fewest GPUs that fit (minimum_gpus) stop at the first valid layout that fits (layout_fits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from ..models import ModelConfig, get_preset
from ..models.inventory import num_params, unchanged_config
from ..parallel.pipeline import split_layers
from .candidates import (
    Validity,
    candidate_layouts,
    context_sizes,
    planned_model,
    searched_layouts,
)
from .params import bytes_per_param
from .plan import (
    GB,
    RUNTIME_BASE,
    RUNTIME_PER_COMM,
    Layout,
    Memory,
    Plan,
    Precision,
    Speed,
    SpeedAssumptions,
    estimate_speed,
    layout_memory,
    memory_within,
    runtime_memory,
    static_memory,
)
from .simulator.hardware import resolve_hardware

# Without --seq-length: the model's context, at most this (Llama 4 Maverick's 1M-token context would plan
# million-token sequences; pre-training runs at 4-8k and extends the context afterwards).
DEFAULT_SEQ_LENGTH = 8192
# A cp layout is listed beside layouts without cp only when expected this much faster than all of them: the
# speed model is calibrated to ~10%, and under cp attention runs flex attention over a mask of this rank's
# query positions instead of the causal kernels, which the model (layouts, not kernels) does not see.
CONTEXT_SPEEDUP = 1.05

# ---- search -------------------------------------------------------------------------------------------------


def default_seq_length(model: ModelConfig) -> int:
    """The sequence length planned when none is given: the model's context, at most DEFAULT_SEQ_LENGTH."""
    return min(model.max_seq_length, DEFAULT_SEQ_LENGTH)


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
    with unchanged_config(planned_model(model_name, model_overrides)) as model:
        search = _Search(
            model_name,
            model_overrides,
            model,
            gpus,
            gpus_per_node,
            gpu_memory,
            seq_length,
            global_batch_size,
            precision,
            speed,
        )
        fits = search.evaluate((1,))
        fits += search.context_parallel(fits)
        fits = _drop_dominated_recompute(fits)
        fits.sort(key=lambda p: (-p.speed.tokens_per_sec_per_gpu, p.memory.total))
        result = PlanResult(model_name, gpus, gpu_memory, seq_length, fits)
        if not fits and explain:
            result.explanation = _explain(model_name, model, gpus, gpu_memory, seq_length, gpus_per_node, search)
    return result


@dataclass
class _StaticBound:
    """Whether a layout's weights, gradients and optimizer state on its busiest pipeline rank (which neither the
    batch, recompute nor cp shrinks) and the runtime fit: a lower bound of layout_memory, kept by what it
    depends on."""

    model: ModelConfig
    precision: Precision
    gpu_memory: float
    _fits: dict[tuple, bool] = field(default_factory=dict)

    def __call__(self, lay: Layout) -> bool:
        key = (lay.tp, lay.cp, lay.pp, lay.vpp, lay.replicas, lay.ep, lay.sharding, lay.fsdp_keep_params)
        if key not in self._fits:
            try:
                least = static_memory(self.model, lay, self.precision) + runtime_memory(lay)
                self._fits[key] = least <= self.gpu_memory
            except ConfigError:  # pp*vpp does not divide the layers: training.validate rejects it too
                self._fits[key] = False
        return self._fits[key]


@dataclass
class _Search:
    """The layouts of one plan() weighed: training.validate is asked only of those that fit; those that do not
    are kept in search order, unvalidated and without their memory, for what needs them (partial recompute,
    whether any layout is valid, the explanation). What plan() lists is as if every layout were validated and
    modelled first: a layout is listed when it is valid and fits, whichever is asked first."""

    model_name: str
    model_overrides: dict | None
    model: ModelConfig
    gpus: int
    gpus_per_node: int
    gpu_memory: float
    seq_length: int
    global_batch_size: int | None
    precision: Precision = Precision()
    speed: SpeedAssumptions = SpeedAssumptions()
    rejected: list[Layout] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.valid = Validity(self.model_name, self.model_overrides, self.gpus, self.seq_length)
        self.bound = _StaticBound(self.model, self.precision, self.gpu_memory)
        self._rejected: set[Layout] = set()

    def evaluate(self, context: Iterable[int], worth: Callable[[Layout], bool] | None = None) -> list[Plan]:
        """The valid layouts of cp sizes `context` (that pass `worth`) that fit, with their partial-recompute
        variants."""
        fits = []
        layouts = searched_layouts(
            self.model_name,
            self.gpus,
            self.seq_length,
            self.gpus_per_node,
            self.global_batch_size,
            self.model_overrides,
            context,
        )
        for lay in layouts:
            if worth is not None and not worth(lay):
                continue
            mem = self._memory(lay) if self.bound(lay) else None
            if mem is None:
                self.rejected.append(lay)
                self._rejected.add(lay)
            elif self.valid(lay):
                fits.append(self._plan(lay, mem))
        partial = self._partial_recompute(fits)
        return fits + [
            self._plan(lay, layout_memory(self.model, lay, self.seq_length, self.precision)) for lay in partial
        ]

    def context_parallel(self, fits: list[Plan]) -> list[Plan]:
        """The cp layouts to list beside `fits` (those without cp): only where needed or faster, a cp layout must
        beat every layout without cp that fits by CONTEXT_SPEEDUP."""
        context = [c for c in context_sizes(self.gpus, self.seq_length) if c > 1]
        if not context:
            return []
        to_beat = CONTEXT_SPEEDUP * max((p.speed.tokens_per_sec_per_gpu for p in fits), default=0.0)
        # Without any valid layout to explain a failure by, cp layouts are modelled in full even when their
        # weights alone cannot fit (the explanation names the smallest).
        worth = _ContextFilter(
            self.model,
            self.seq_length,
            self.precision,
            self.gpus,
            self.gpus_per_node,
            to_beat,
            self.bound,
            self.speed,
            bool(fits) or self.any(),
        )
        return [p for p in self.evaluate(context, worth) if p.speed.tokens_per_sec_per_gpu > to_beat]

    def any(self) -> bool:
        """Whether any layout weighed so far is valid."""
        return any(map(self.valid, self.rejected))

    def rejected_memory(self) -> list[tuple[Layout, Memory]]:
        """The valid layouts that do not fit, with their memory."""
        model, seq, precision = self.model, self.seq_length, self.precision
        return [(lay, layout_memory(model, lay, seq, precision)) for lay in self.rejected if self.valid(lay)]

    def _memory(self, lay: Layout) -> Memory | None:
        return memory_within(self.model, lay, self.seq_length, self.precision, self.gpu_memory)

    def _plan(self, lay: Layout, mem: Memory) -> Plan:
        speed = _estimate(self.model, lay, self.seq_length, self.gpus, self.gpus_per_node, self.speed, self.precision)
        return Plan(lay, mem, speed)

    def _partial_recompute(self, fits: list[Plan]) -> list[Layout]:
        """Where full recompute fits and no recompute (a valid layout) does not, the fewest recomputed layers per
        chunk that fit (--recompute-layers N): each layer not recomputed saves a layer's forward."""
        out = []
        for p in fits:
            lay = p.layout
            if lay.recompute != "full" or lay.recompute_layers is not None:
                continue
            plain = replace(lay, recompute="none")
            if plain not in self._rejected or not self.valid(plain):
                continue
            per_chunk = max(split_layers(self.model.num_layers, lay.pp, lay.vpp, lay.pp_layers))
            lo, hi = 1, per_chunk  # hi: all of the chunk's layers (fits)
            while lo < hi:  # smallest N that fits; memory falls as N grows
                mid = (lo + hi) // 2
                if self._memory(replace(lay, recompute_layers=mid)) is not None:
                    hi = mid
                else:
                    lo = mid + 1
            if lo < per_chunk:
                out.append(replace(lay, recompute_layers=lo))
        return out


@dataclass
class _ContextFilter:
    """Whether a cp layout can fit and be listed, judged before validating it or modelling its activations:
    its weights, gradients and optimizer state (which cp does not shrink) and the runtime must fit, and where a
    layout without cp fits it must be faster than `to_beat` even without recompute (recompute, partial or not,
    only slows a layout down)."""

    model: ModelConfig
    seq_length: int
    precision: Precision
    gpus: int
    gpus_per_node: int
    to_beat: float  # tokens/s per GPU; 0 when no layout without cp fits
    bound: _StaticBound
    speed: SpeedAssumptions = field(default_factory=SpeedAssumptions)
    static_bound: bool = True  # skip the layouts whose weights, gradients, optimizer state and runtime overflow

    def __call__(self, lay: Layout) -> bool:
        if lay.micro_batches < 1 or (self.static_bound and not self.bound(lay)):
            return False  # (no micro-batch: the global batch does not split, training.validate rejects it)
        if self.to_beat == 0:
            return True
        fastest = replace(lay, recompute="none", recompute_layers=None)
        speed = _estimate(
            self.model, fastest, self.seq_length, self.gpus, self.gpus_per_node, self.speed, self.precision
        )
        return speed.tokens_per_sec_per_gpu > self.to_beat


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


def layout_fits(
    model_name: str,
    gpus: int,
    gpu_memory: float,
    seq_length: int,
    gpus_per_node: int = 8,
    global_batch_size: int | None = None,
    model_overrides: dict | None = None,
    precision: Precision = Precision(),
) -> bool:
    """Whether plan() lists any layout, answered at the first valid layout that fits: plan lists a cp layout
    beside layouts without cp only when faster, but every one that fits when none without cp does (to_beat 0),
    and its recompute filters drop a layout only for another that fits, so its list is empty exactly when no
    valid layout of its search fits. Memory is judged before the (costlier) validation, the static lower bound
    before the activations; the cp layouts pass plan's own filter first."""
    with unchanged_config(planned_model(model_name, model_overrides)) as model:
        # plan's filter of cp layouts (to_beat 0: where none without cp fits, every cp layout that fits is listed);
        # its static lower bound rules out the layouts without cp too.
        bound = _StaticBound(model, precision, gpu_memory)
        cp_filter = _ContextFilter(model, seq_length, precision, gpus, gpus_per_node, 0.0, bound)

        def fits(lay: Layout) -> bool:
            plausible = cp_filter(lay) if lay.cp > 1 else bound(lay)
            return plausible and memory_within(model, lay, seq_length, precision, gpu_memory) is not None

        context = [c for c in context_sizes(gpus, seq_length) if c > 1]
        for sizes in [(1,), context] if context else [(1,)]:
            layouts = candidate_layouts(
                model_name, gpus, seq_length, gpus_per_node, global_batch_size, model_overrides, sizes, fits
            )
            if next(layouts, None) is not None:
                return True
        return False


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
    model = planned_model(model_name, model_overrides)
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
        return layout_fits(
            model_name, gpus, gpu_memory, seq_length, gpus_per_node, global_batch_size, model_overrides, precision
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
    search: _Search,
) -> str:
    global_batch_size, overrides, precision = search.global_batch_size, search.model_overrides, search.precision
    setup = (
        f"{model_name} ({num_params(model) / 1e9:.1f}B parameters) does not fit on {gpus} x {gpu_memory / GB:.0f} GB"
    )
    if not search.any():
        batch = f" and global batch size {global_batch_size}" if global_batch_size else ""
        return (
            f"{setup}: no layout of {gpus} GPUs is valid for this model{batch} (tp must divide the heads and "
            f"stay within a node of {gpus_per_node}, pp*vpp must divide its {model.num_layers} layers, 2*cp the "
            f"sequence)"
        )
    per_param = sum(bytes_per_param(precision.dtype, True, 1))
    perfect = per_param * num_params(model) / gpus
    if perfect > gpu_memory:
        why = (
            f"weights+grads+optimizer alone need {perfect / GB:.1f} GB per GPU even sharded perfectly over all "
            f"{gpus} GPUs ({per_param:.0f} bytes a parameter / {gpus}, as --fsdp over every GPU would)"
        )
    else:  # (only here are the valid layouts that do not fit modelled in full)
        why = _smallest_layout(search.rejected_memory(), gpu_memory)
    needed = minimum_gpus(
        model_name, gpu_memory, seq_length, gpus_per_node, global_batch_size, overrides, precision, start=gpus + 1
    )
    more = f"; it needs at least {needed} GPUs of this size" if needed else ""
    h200 = resolve_hardware("h200").gpu.memory
    if perfect > gpu_memory and perfect + RUNTIME_BASE <= h200:  # the bound is met on a larger GPU
        more += f"; an H200 (--gpu h200) holds {h200 / GB:.1f} GB, above that bound: plan with it to see what fits"
    return f"{setup}: {why}, and a GPU has {gpu_memory / GB:.1f} GB{more}"


def _smallest_layout(rejected: list[tuple[Layout, Memory]], gpu_memory: float) -> str:
    """Why no layout fits, where sharding over every GPU would: the weights of the layout that shards them
    furthest, or the smallest layout's memory."""
    static_lay, static_mem = min(rejected, key=lambda r: (r[1].static, -r[0].tp))
    if static_mem.static > gpu_memory:
        return (
            f"weights+grads+optimizer alone need {static_mem.static / GB:.1f} GB per GPU in the layout that shards "
            f"them furthest ({static_lay.label}, sharding {static_lay.sharding})"
        )
    lay, mem = min(rejected, key=lambda r: r[1].total)
    return (
        f"the smallest layout ({lay.label}, recompute {lay.recompute}, micro-batch "
        f"{lay.micro_batch_size}) needs {mem.total / GB:.1f} GB: weights+grads+optimizer {mem.static / GB:.1f}, "
        f"activations {mem.activations / GB:.1f}, buffers {mem.buffers_total / GB:.1f}"
    )


def _estimate(
    model: ModelConfig, lay: Layout, seq: int, gpus: int, per_node: int, hw: SpeedAssumptions, prec: Precision
) -> Speed:
    """estimate_speed with the precision's FP8 recipe and optimizer."""
    return estimate_speed(model, lay, seq, gpus, per_node, hw, fp8=prec.fp8, optimizer_name=prec.optimizer)
