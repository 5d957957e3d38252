"""`llamatron plan`: arguments and the table (the model of memory and speed lives in llamatron/planning/plan.py)."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from typing import Any

from ..config.model_overrides import add_model_override_argument, parse_model_overrides
from ..config.ranges import Range, at_least, number_arg
from ..config.settings import FP8_RECIPES, OPTIMIZERS, RunConfig
from ..errors import ConfigError
from ..models import ModelConfig, get_preset
from ..models.families import model_problems
from ..planning.candidates import planned_model
from ..planning.plan import GB, GiB, Plan, Precision, SpeedAssumptions
from ..planning.search import DEFAULT_SEQ_LENGTH, PlanResult, default_seq_length, plan
from ..planning.simulator.evaluate import Simulation
from ..planning.simulator.hardware import Hardware
from ..planning.simulator.ranking import rank_by_simulation, simulated_plan
from ..planning.simulator.step import StepResult
from ..training.fp8 import fp8_flag_problems
from ..training.validate import shape_fix
from . import plan_simulate
from .plan_layout import _LAYOUT_FLAGS, _LAYOUT_KEYS, evaluate_layout, planned_settings


def parse_memory(text: str) -> float:
    """'80GB' (10^9 bytes), '80GiB' (2^30), '80' (GB) -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(GB|GiB|G|TB|TiB)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ConfigError(f"--gpu-memory {text!r}: give a size such as 80GB or 139.8GiB")
    scale = {"gb": GB, "g": GB, "gib": GiB, "tb": 1e12, "tib": 2**40}[(match.group(2) or "GB").lower()]
    return float(match.group(1)) * scale


# --gpus: a bound on the search's time, which grows with the count; far beyond the largest clusters (~10^5 GPUs)
GPUS = Range(low=1, high=2**20, note="2^20, more than any cluster holds")


def register(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="list the parallel layouts that fit a model on a cluster, fastest first",
        description="Memory per GPU and expected speed of every tp/cp/pp/vpp/dp/optimizer/recompute/"
        "micro-batch layout that fits (context parallelism, cp, only where needed or faster). Memory is "
        "given in GB (10^9 bytes); a GPU sold as '80GB' holds about 85.5e9 bytes (81559 MiB), so "
        "--gpu-memory 80GB leaves a small margin; an H200 (sold as 141GB) gives torch 139.8 GiB: "
        "--gpu-memory 139.8GiB. Speeds assume H100/H200-class GPUs and the measured kernel efficiencies of "
        "benchmarks/RESULTS.md.",
    )
    p.add_argument("--model", default=None, help="model preset, e.g. llama2-70b (or `model:` in --config)")
    p.add_argument(
        "--config",
        default=None,
        help="a train YAML: its model and model_overrides (any shape), and its layout if it gives one",
    )
    add_model_override_argument(p, default=None)
    p.add_argument("--gpus", type=number_arg(int, GPUS), required=True, help=f"number of GPUs (at most {GPUS.high:,})")
    p.add_argument(
        "--gpu-memory",
        default=None,
        help="memory of one GPU, e.g. 80GB or 139.8GiB (default: the --gpu profile's, else 80GB: an H100)",
    )
    p.add_argument(
        "--seq-length",
        type=number_arg(int, at_least(1)),
        default=None,
        help=f"tokens per sample (default: the model's context length, at most {DEFAULT_SEQ_LENGTH})",
    )
    p.add_argument(
        "--global-batch-size",
        type=number_arg(int, Range(low=1, high=2**31, note="samples per step")),
        default=None,
        help="samples per step (default: about 4M tokens, rounded per layout)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=number_arg(int, at_least(1)),
        default=None,
        help="GPUs per node; tensor parallelism stays inside one (default: the --gpu profile's, 8)",
    )
    p.add_argument(
        "--top",
        type=number_arg(int, at_least(1)),
        default=10,
        help="show the K fastest layouts (each simulated: a K of hundreds takes a minute; --no-simulate does not)",
    )
    _add_precision_arguments(p)
    fixed = p.add_argument_group("a fixed layout: evaluate it instead of searching (unset: the --config's, else 1)")
    for flag, kind, what in _LAYOUT_FLAGS:
        fixed.add_argument(f"--{flag}", type=kind, default=None, help=what)
    fixed.add_argument(
        "--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None, help="shard optimizer state"
    )
    fixed.add_argument("--fsdp", action="store_true", default=None, help="fully sharded data parallelism (ZeRO-3)")
    fixed.add_argument(
        "--fsdp-keep-params-in-backward", action="store_true", default=None, help="with --fsdp: no re-gather"
    )
    fixed.add_argument("--search", action="store_true", help="search layouts even when --config gives one")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan_simulate.add_arguments(p)
    p.set_defaults(func=cmd_plan)


def _add_precision_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the run compiles its decoder layers (the GPU default), which saves fewer activations",
    )
    p.add_argument(
        "--fp8",
        choices=FP8_RECIPES,
        default="none",
        help="the run's --fp8 recipe: its decoder linears' speed-up, measured on an H200 (memory as bf16)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="the run's --optimizer: its state's memory; muon adds its Newton-Schulz FLOPs and traffic to the step",
    )
    p.add_argument(
        "--fp8-experts",
        action="store_true",
        default=None,
        help="with --fp8 on a mixture of experts: the run's --fp8-experts (its experts' grouped GEMMs in FP8), "
        "checked as train checks it and added to the train flags; simulated with the experts at bf16 speed, "
        "nearer what llamatron's FP8 experts measured (mixtral-1b's step 0.95x of bf16's, benchmarks/RESULTS.md "
        "run 23) than FP8's GEMM speed-up",
    )


def _check_model(model_name: str, overrides: dict | None, flags: dict[str, str], fp8: str, fp8_experts: bool) -> None:
    """A model setting no layout can fix (a capacity factor of 0, top-k above the experts) is a configuration
    error, as in `train`, not a layout that does not fit (an unknown field: planned_model's own error); so are
    FP8 flags the model cannot take (--fp8-experts on a dense model), as train checks them. `flags`: the model
    fields --model-override set, each one's flag as typed (the error names them)."""
    model = planned_model(model_name, overrides)
    problems = model_problems(model, overrides or {})
    if problems:
        given = RunConfig(model_overrides=dict(overrides or {}), override_flags=flags)
        raise ConfigError(f"{'; '.join(problems)} ({shape_fix(given, problems)})")
    problems = fp8_flag_problems(fp8, model, experts=fp8_experts)
    if problems:
        raise ConfigError("; ".join(problems))


def cmd_plan(args: argparse.Namespace) -> int:
    hw = plan_simulate.hardware_of(args)
    args.gpus_per_node = hw.gpus_per_node
    memory = parse_memory(args.gpu_memory) if args.gpu_memory else (hw.gpu.memory if args.gpu else 80 * GB)
    settings = planned_settings(args)
    if settings.get("model") is None:
        raise ConfigError("plan needs a model: --model PRESET, or --config FILE with `model:`")
    try:
        preset = get_preset(settings["model"])
        seq_length = settings.get("seq_length") or default_seq_length(preset)
    except ValueError as e:  # an unknown preset: its message lists the known ones
        raise ConfigError(str(e)) from None
    fp8 = args.fp8 if args.fp8 != "none" else settings.get("fp8", "none")
    fp8_experts = bool(args.fp8_experts or settings.get("fp8_experts"))
    flags = parse_model_overrides(args.model_override).flags
    _check_model(settings["model"], settings.get("model_overrides"), flags, fp8, fp8_experts)
    optimizer = args.optimizer or settings.get("optimizer", "adamw")
    if optimizer not in OPTIMIZERS:  # the YAML's, which argparse did not check
        raise ConfigError(f"optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    precision = Precision(compiled=args.compile, fp8=fp8, optimizer=optimizer)
    run_flags = (f" --fp8 {fp8}" if fp8 != "none" else "") + (" --fp8-experts" if fp8_experts else "")
    run_flags += f" --optimizer {optimizer}" if optimizer != "adamw" else ""
    if not settings.get("seq_length") and not args.json:
        print(
            f"seq {seq_length}: the default, the model's context ({preset.max_seq_length}) but at most "
            f"{DEFAULT_SEQ_LENGTH}; --seq-length N plans another"
        )
    request = PlanRequest(settings, memory, seq_length, hw, precision, run_flags)
    if not args.search and any(k in settings for k in _LAYOUT_KEYS):
        return print_fixed_layout(args, request)
    return print_search(args, request)


@dataclass(frozen=True)
class PlanRequest:
    """What plan resolved from its flags and --config, for a search or a fixed layout."""

    settings: dict[str, Any]  # the model, its shape and the layout (planned_settings)
    gpu_memory: float
    seq_length: int
    hw: Hardware
    precision: Precision
    run_flags: str = ""  # the precision's train flags (--fp8 ... --fp8-experts)


def print_search(args: argparse.Namespace, request: PlanRequest) -> int:
    """Search the layouts that fit and print the --top fastest (by the step simulator unless --no-simulate), or
    why none fits (exit status 1)."""
    settings, seq_length, hw, precision = request.settings, request.seq_length, request.hw, request.precision
    memory, run_flags = request.gpu_memory, request.run_flags
    result = plan(
        settings["model"],
        args.gpus,
        memory,
        seq_length,
        settings.get("global_batch_size"),
        args.gpus_per_node,
        settings.get("model_overrides"),
        precision=precision,
        speed=_ranking_speed(args, hw),
    )
    if not result.fits:
        empty = _search_record(args, result, memory, hw, run_flags, [], {}, 0)
        print(json.dumps(empty, indent=2) if args.json else result.explanation)
        return 1
    model = _model_of(result.model, settings.get("model_overrides"))
    steps: dict[int, StepResult] = {}
    shown, simulated = result.fits[: max(args.top, 0)], 0
    if args.simulate:
        shown, steps, simulated = _rank_by_simulation(args, model, result, seq_length, hw, precision)

    def simulation(p: Plan) -> Simulation:  # the step both ways (the ranking simulated it one way)
        return plan_simulate.simulate(args, model, p, seq_length, hw, precision, step=steps.get(id(p)))

    if args.json:
        sims = {id(p): simulation(p) for p in shown if id(p) in steps}
        print(json.dumps(_search_record(args, result, memory, hw, run_flags, shown, sims, simulated), indent=2))
        return 0
    ranked_by = f"by the step simulator ({simulated} simulated)" if steps else "by the ranking model"
    print(format_table(result, shown, SIMULATED if steps else RANKED, _search_head(result, shown, ranked_by)))
    if "--fp8-experts" in run_flags:
        print(FP8_EXPERTS)
    if shown:
        print(f"\n#1 as `llamatron train` flags: {_train_flags(shown[0], seq_length, run_flags)}")
        if steps:
            print(f"(simulated on {hw.describe()})")
            plan_simulate.print_extras(args, simulation(shown[0]))
        elif args.explain or args.explain_png:  # the best layout's simulated step, its traffic included
            print(f"\n#1 simulated on {hw.describe()}:")
            plan_simulate.print_extras(args, simulation(shown[0]))
    return 0


def _search_record(
    args: argparse.Namespace,
    result: PlanResult,
    memory: float,
    hw: Hardware,
    run_flags: str,
    shown: list[Plan],
    sims: dict[int, Simulation],
    simulated: int,
) -> dict[str, Any]:
    """plan --json of a search: the shown layouts, each with its simulation when ranked by the simulator."""
    return {
        "model": result.model,
        "gpus": result.gpus,
        "gpu_memory_gb": memory / GB,
        "seq_length": result.seq_length,
        "fits": len(result.fits),
        "ranked_by": "simulator" if sims else "ranking model",
        "simulated": simulated,
        "hardware": hw.describe(),
        "layouts": [
            {
                **p.to_dict(),
                "train_flags": _train_flags(p, result.seq_length, run_flags),
                **({"simulation": plan_simulate.record(args, sims[id(p)])} if id(p) in sims else {}),
            }
            for p in shown
        ],
        "explanation": result.explanation or None,
    }


def _ranking_speed(args: argparse.Namespace, hw: Hardware) -> SpeedAssumptions:
    """The ranking model's numbers: scaled to the hardware when it is named, else as calibrated."""
    named = args.gpu or args.network or args.inter_node_bandwidth or args.hardware
    return SpeedAssumptions.for_hardware(hw) if named else SpeedAssumptions()


def _rank_by_simulation(
    args: argparse.Namespace,
    model: ModelConfig,
    result: PlanResult,
    seq_length: int,
    hw: Hardware,
    precision: Precision,
) -> tuple[list[Plan], dict[int, StepResult], int]:
    """The --top fastest layouts that fit by the step simulator (simulator/ranking.py: exactly those simulating
    them all would list), their simulated steps by id, and how many layouts were simulated."""
    # zb-h1 is modelled for vpp 1 only (plan_simulate.simulate refuses the others)
    candidates = [p for p in result.fits if args.pipeline_schedule != "zb-h1" or p.layout.vpp == 1]
    settings = plan_simulate.settings_of(args)
    ranked = rank_by_simulation(model, candidates, seq_length, hw, precision, settings, max(args.top, 1))
    top = ranked.top[: max(args.top, 0)]
    return [p for p, _ in top], {id(p): step for p, step in top}, ranked.simulated


def _model_of(name: str, overrides: dict | None) -> ModelConfig:
    cfg = RunConfig(model_overrides=dict(overrides or {}))
    cfg.train.model = name
    return cfg.model_config()


def _train_flags(p: Plan, seq_length: int, run_flags: str) -> str:
    return p.layout.train_flags(seq_length) + run_flags


# Where the table's tok/s/gpu and mfu come from: two models of one step. The simulator is the one plan lists by
# default; the closed-form ranking model (--no-simulate) is faster and can differ by 2x (MoE, --fsdp).
RANKED = (
    "tok/s/gpu and mfu: the closed-form ranking model's estimate (--no-simulate: it leaves out the MoE token "
    "permutation and routing and --fsdp's contention, which the step simulator has; without --no-simulate plan "
    "ranks by the simulator)"
)
SIMULATED = "tok/s/gpu and mfu: the step simulator's (llamatron/planning/simulator)"
FP8_EXPERTS = (
    "--fp8-experts: the experts' grouped GEMMs simulated at bf16 speed (llamatron's FP8 experts measured slower "
    "than bf16: mixtral-1b's step 0.95x, benchmarks/RESULTS.md run 23)"
)


def _setting(result: PlanResult) -> str:
    return f"{result.model} on {result.gpus} x {result.gpu_memory / GB:.0f} GB, seq {result.seq_length}"


def _search_head(result: PlanResult, shown: list[Plan], ranked_by: str) -> str:
    n = len(result.fits)
    fit = "1 layout fits" if n == 1 else f"{n} layouts fit"
    fastest = "the fastest" if len(shown) == 1 else f"the {len(shown)} fastest"
    return f"{_setting(result)}: {fit}; {fastest} {ranked_by} (memory per GPU in GB, busiest pipeline stage)"


def format_table(result: PlanResult, shown: list[Plan], speed_source: str = RANKED, head: str = "") -> str:
    """The table of `shown` under `head` (default: the search's line), or why nothing fits."""
    if not result.fits:
        return result.explanation
    head = head or _search_head(result, shown, "by the ranking model")
    cols = [
        "#",
        "tp",
        "cp",
        "pp",
        "vpp",
        "dp",
        "ep",
        "sharding",
        "recompute",
        "mb",
        "gbs",
        "weights",
        "grads",
        "optim",
        "activ",
        "buffers",
        "total",
        "tok/s/gpu",
        "mfu",
    ]
    rows = [cols]
    for i, p in enumerate(shown, 1):
        lay, m = p.layout, p.memory
        rows.append(
            [
                str(i),
                str(lay.tp),
                str(lay.cp),
                str(lay.pp) + ("*" if lay.pp_layers else ""),
                str(lay.vpp),
                str(lay.dp),
                str(lay.ep),
                lay.sharding + (" keep" if lay.fsdp_keep_params else ""),
                lay.recompute_label,
                str(lay.micro_batch_size),
                str(lay.global_batch_size),
            ]
            + [f"{x / GB:.1f}" for x in (m.weights, m.gradients, m.optimizer, m.activations, m.buffers_total, m.total)]
            + [f"{p.speed.tokens_per_sec_per_gpu:,.0f}", f"{p.speed.mfu:.0%}"]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    note = (
        "sharding: how the dp x cp replicas hold the weights: no (whole), dist-opt (--distributed-optimizer: the "
        "optimizer state sharded), fsdp (--fsdp: weights, gradients and optimizer state sharded, each layer "
        "gathered in use; keep: --fsdp-keep-params-in-backward), hsdp N (--fsdp-shard-group N); "
        "sequence parallelism is on whenever tp > 1; pp N* = an uneven split of the layers (--pp-layers: in the "
        "layout's train flags and --json); cp = context-parallel ranks per sequence (listed only where "
        "no layout without it fits or it is expected faster than all that do); recompute full:N = --recompute "
        "full --recompute-layers N (the fewest layers per chunk that fit); buffers = logits/loss or backward "
        "temporaries, staging, batch, allocator fragmentation and CUDA/NCCL runtime (see `python -m pydoc "
        "llamatron.planning.plan`)"
    )
    return "\n".join([head, *lines, note, speed_source])


def print_fixed_layout(args: argparse.Namespace, request: PlanRequest) -> int:
    """Print the layout's plan and its simulated step (a table row, or JSON with tokens_per_sec_per_gpu and
    tflops_per_gpu: the simulator's); exit status 1 when it does not fit in the GPU's memory."""
    settings, seq_length, hw, precision = request.settings, request.seq_length, request.hw, request.precision
    gpu_memory, run_flags = request.gpu_memory, request.run_flags
    gpus = args.gpus
    p, model = evaluate_layout(settings, gpus, seq_length, hw.gpus_per_node, precision, _ranking_speed(args, hw))
    sim = plan_simulate.simulate(args, model, p, seq_length, hw, precision)
    r = sim.result
    simulated = simulated_plan(p, r)
    fits = p.memory.total <= gpu_memory
    tflops = r.mfu * r.peak_flops / 1e12
    if args.json:
        record = {"model": settings["model"], "gpus": gpus, "gpu_memory_gb": gpu_memory / GB, "seq_length": seq_length}
        record.update({**simulated.to_dict(), "tflops_per_gpu": tflops, "fits": fits, "parts_seconds": r.parts})
        record["ranking_model_tokens_per_sec_per_gpu"] = p.speed.tokens_per_sec_per_gpu
        record["train_flags"] = _train_flags(p, seq_length, run_flags)
        record["simulation"] = plan_simulate.record(args, sim)
        print(json.dumps(record, indent=2))
    else:
        source = f"{SIMULATED}; the ranking model's estimate: {p.speed.tokens_per_sec_per_gpu:,.0f} tok/s/gpu"
        table = PlanResult(settings["model"], gpus, gpu_memory, seq_length, [simulated])
        head = f"{_setting(table)}: the layout given (memory per GPU in GB, busiest pipeline stage)"
        print(format_table(table, [simulated], source, head))
        if "--fp8-experts" in run_flags:
            print(FP8_EXPERTS)
        if p.layout.distributed_optimizer and p.layout.replicas == 1:
            print("--distributed-optimizer shards the optimizer over dp x cp replicas: with one it saves nothing")
        verdict = "fits" if fits else f"does NOT fit in {gpu_memory / GB:.0f} GB"
        print(f"\nthis layout {verdict}; {tflops:.0f} TFLOP/s per GPU simulated on {hw.describe()}")
        plan_simulate.print_extras(args, sim)
    return 0 if fits else 1
