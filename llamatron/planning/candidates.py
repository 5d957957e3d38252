"""The layouts `llamatron plan` weighs (search.py): every tp/cp/pp/vpp/dp/ep, sharding, recompute mode and
micro-batch with tp inside a node, and whether the trainer accepts one (training.validate), asked apart so that
a search validates only the layouts it needs to (those that fit, mostly)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from ..config.settings import RunConfig, config_from_values
from ..errors import ConfigError
from ..models import ModelConfig
from ..parallel.fsdp import fsdp_problems
from ..parallel.layout import divisors
from ..training.validate import validate
from .layout import Layout

RECOMPUTE_MODES = ("none", "selective", "full")
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
MAX_VPP = 8
MAX_EP = 8  # expert-parallel sizes searched (a node's worth of all-to-all)
DEFAULT_BATCH_TOKENS = 4 * 2**20  # ~4M tokens per step when --global-batch-size is not given


def planned_run_config(model_name: str, overrides: dict | None, lay: Layout, seq_length: int) -> RunConfig:
    values = {
        "model": model_name,
        "tp": lay.tp,
        "cp": lay.cp,
        "ep": lay.ep,
        "pp": lay.pp,
        "vpp": lay.vpp,
        "pp_layers": lay.pp_layers,
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
    if lay.etp is not None:
        values["etp"] = lay.etp
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


def balanced_split(num_layers: int, chunks: int) -> str:
    """The most even --pp-layers of `num_layers` over `chunks` model chunks: each base or base + 1 layers, the
    lighter chunks taken from the ends inward (the last, the first, ...), since the first chunk also holds the
    embedding and the last the head and the loss (as the Llama 3 paper's and Megatron-core's uneven splits do)."""
    base, extra = divmod(num_layers, chunks)
    ends_inward = []
    lo, hi = 0, chunks - 1
    while lo <= hi:
        ends_inward += [hi] if lo == hi else [hi, lo]
        lo, hi = lo + 1, hi - 1
    lighter = set(ends_inward[: chunks - extra])
    return ",".join(str(base + (c not in lighter)) for c in range(chunks))


def pipeline_splits(num_layers: int, pp: int) -> list[tuple[int, str | None]]:
    """The (vpp, --pp-layers) the search weighs for pp stages: vpp 1 and each vpp up to MAX_VPP whose pp x vpp
    chunks take the layers evenly (None: the even split); where pp does not divide the layers (Llama 3.1 405B's
    126, Qwen3-235B's 94), the most even split instead, at vpp 1 (one layer a stage at least) and at each vpp
    that leaves every chunk two layers or more."""
    even: list[tuple[int, str | None]] = [(1, None)]
    if pp == 1:
        return even
    if num_layers % pp == 0:
        return even + [(v, None) for v in range(2, MAX_VPP + 1) if num_layers % (pp * v) == 0]
    vpps = [1] * (pp <= num_layers) + [v for v in range(2, MAX_VPP + 1) if 2 * pp * v <= num_layers]
    return [(v, balanced_split(num_layers, pp * v)) for v in vpps]


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
    """Every layout of searched_layouts that the trainer accepts (training.validate). `worth`: a cheap test a
    layout must pass before the (costlier) validation."""
    valid = Validity(model_name, model_overrides, gpus, seq_length)
    layouts = searched_layouts(model_name, gpus, seq_length, gpus_per_node, global_batch_size, model_overrides, context)
    return (lay for lay in layouts if (worth is None or worth(lay)) and valid(lay))


def searched_layouts(
    model_name: str,
    gpus: int,
    seq_length: int,
    gpus_per_node: int,
    global_batch_size: int | None = None,
    model_overrides: dict | None = None,
    context: Iterable[int] = (1,),
) -> Iterator[Layout]:
    """Every layout with tp inside a node, cp in `context`, the pipeline splits of pipeline_splits and sequence
    parallelism whenever tp > 1, not yet validated. Without a global batch size, each layout gets the multiple of
    micro-batch x dp (x pp when interleaved) closest to ~4M tokens."""
    model = planned_model(model_name, model_overrides)

    def eps(dp: int) -> list[int]:  # expert parallelism: sizes dividing dp and the experts (MoE models only)
        return [e for e in divisors(model.num_experts) if e <= MAX_EP and dp % e == 0] if model.is_moe else [1]

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
        splits = pipeline_splits(model.num_layers, pp)
        for (vpp, pp_layers), mb, recompute in (
            (s, b, r) for s in splits for b in MICRO_BATCH_SIZES for r in RECOMPUTE_MODES
        ):
            gbs = global_batch_size
            if gbs is None:
                step = mb * dp * (pp if vpp > 1 else 1)
                gbs = max(1, round(DEFAULT_BATCH_TOKENS / seq_length / step)) * step
            for sharding, ep in ((d, e) for d in shardings(dp * cp, tp, gpus_per_node) for e in eps(dp)):
                kw = {"distributed_optimizer": False, **sharding}
                yield Layout(
                    tp=tp,
                    pp=pp,
                    vpp=vpp,
                    dp=dp,
                    sequence_parallel=tp > 1,
                    recompute=recompute,
                    micro_batch_size=mb,
                    global_batch_size=gbs,
                    cp=cp,
                    ep=ep,
                    pp_layers=pp_layers,
                    **kw,
                )


@dataclass
class Validity:
    """Whether the trainer accepts a layout of `gpus` GPUs: training.validate on the layout without its sharding
    (asked once for all shardings), then what --fsdp adds."""

    model_name: str
    model_overrides: dict | None
    gpus: int
    seq_length: int
    _checked: dict[Layout, bool] = field(default_factory=dict)

    def __call__(self, lay: Layout) -> bool:
        plain = replace(lay, distributed_optimizer=False, fsdp=False, fsdp_shard_group=None, fsdp_keep_params=False)
        if plain not in self._checked:
            try:
                run = planned_run_config(self.model_name, self.model_overrides, plain, self.seq_length)
                validate(run, self.gpus, cuda_available=True)
                self._checked[plain] = True
            except ConfigError:
                self._checked[plain] = False
        keep, group = lay.fsdp_keep_params, lay.fsdp_shard_group
        refused = lay.fsdp and fsdp_problems(
            True, keep, True, group, lay.replicas, [], lay.tp, lay.pp, lay.cp, lay.ep, "none", 0
        )
        return self._checked[plain] and not refused


def planned_model(model_name: str, overrides: dict | None) -> ModelConfig:
    cfg = RunConfig(model_overrides=dict(overrides or {}))
    cfg.train.model = model_name
    return cfg.model_config()
