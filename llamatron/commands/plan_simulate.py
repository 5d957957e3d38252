"""`llamatron plan`'s hardware and simulator flags (llamatron/planning/simulator/): which GPU, link and network, the
step simulator's settings, and what it prints (--explain, --explain-png, the cost of --train-tokens)."""

from __future__ import annotations

import argparse
from typing import Any

from ..config.ranges import at_least, number_arg
from ..errors import ConfigError
from ..models import ModelConfig
from ..models.inventory import active_params, num_params
from ..planning.plan import Plan, Precision
from ..planning.simulator.evaluate import SimSettings, Simulation, simulate_layout
from ..planning.simulator.hardware import Hardware, resolve_hardware
from ..planning.simulator.report import explain_png, explain_text
from ..planning.simulator.step import StepResult


def add_arguments(p: argparse.ArgumentParser) -> None:
    hw = p.add_argument_group("hardware (llamatron/planning/simulator/hardware.yaml; the step simulator's)")
    hw.add_argument(
        "--gpu", default=None, help="GPU profile: h100-sxm (default), h200, a100-80gb, a100-40gb, h100-pcie"
    )
    hw.add_argument(
        "--hardware", default=None, help="a YAML file of more GPU/link/network profiles (hardware.yaml's shape)"
    )
    hw.add_argument(
        "--network", default=None, help="inter-node network: 8x400Gb-ndr (default), 8x200Gb-hdr, ... or NxRATEGb"
    )
    hw.add_argument(
        "--inter-node-bandwidth", type=number_arg(float, at_least(0.001)), default=None, help="GB/s per GPU"
    )
    hw.add_argument("--inter-node-latency", type=number_arg(float, at_least(0.0)), default=None, help="microseconds")
    sim = p.add_argument_group("step simulator (a fixed layout is always simulated)")
    sim.add_argument(
        "--simulate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rank a search by the step simulator (the default; kept for old scripts): the --top fastest of all "
        "layouts that fit, each simulated; --no-simulate ranks by the closed-form model instead (faster, and up to "
        "2x off for a mixture of experts or --fsdp)",
    )
    sim.add_argument("--explain", action="store_true", help="print the simulated step's timeline as text")
    sim.add_argument("--explain-png", default=None, metavar="FILE", help="draw it as a Gantt chart (needs matplotlib)")
    sim.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True, help="data-parallel overlap")
    sim.add_argument("--pipeline-schedule", choices=("1f1b", "zb-h1"), default="1f1b", help="zb-h1: predicted only")
    sim.add_argument("--attention-backend", choices=("auto", "fa4", "flash"), default="auto", help="its efficiency")
    sim.add_argument("--bucket-size", type=number_arg(int, at_least(1)), default=40_000_000, help="gradient bucket")
    sim.add_argument("--grad-reduce-dtype", choices=("fp32", "bf16"), default="fp32", help="gradient reduction dtype")
    sim.add_argument("--train-tokens", type=number_arg(float, at_least(1.0)), default=None, help="e.g. 1e12")
    sim.add_argument("--price-per-gpu-hour", type=number_arg(float, at_least(0.0)), default=None, help="for the cost")


def hardware_of(args: argparse.Namespace) -> Hardware:
    return resolve_hardware(
        args.gpu or "h100-sxm",
        args.network,
        args.inter_node_bandwidth,
        args.inter_node_latency,
        args.gpus_per_node,
        args.hardware,
    )


def settings_of(args: argparse.Namespace) -> SimSettings:
    return SimSettings(
        overlap=args.overlap,
        schedule=args.pipeline_schedule,
        attention=args.attention_backend,
        bucket_size=args.bucket_size,
        grad_reduce_dtype=args.grad_reduce_dtype,
    )


def simulate(
    args: argparse.Namespace,
    model: ModelConfig,
    p: Plan,
    seq: int,
    hw: Hardware,
    prec: Precision,
    step: StepResult | None = None,
) -> Simulation:
    """`p` simulated as the flags say (`step`: its step, already simulated by the ranking)."""
    if args.pipeline_schedule == "zb-h1" and p.layout.vpp > 1:
        raise ConfigError("--pipeline-schedule zb-h1 is modelled for vpp 1; drop --vpp")
    return simulate_layout(model, p.layout, seq, hw, prec, settings_of(args), result=step)


def record(args: argparse.Namespace, sim: Simulation) -> dict[str, Any]:
    return sim.to_dict(args.train_tokens, args.price_per_gpu_hour)


def print_extras(args: argparse.Namespace, sim: Simulation) -> None:
    """What --explain, --explain-png and --train-tokens add to the text output (and a mixture of experts' line)."""
    if sim.model.is_moe:
        moe = sim.to_dict()["moe"]
        print(
            f"\nmixture of experts: {num_params(sim.model) / 1e9:.1f}B parameters, "
            f"{active_params(sim.model) / 1e9:.1f}B active per token (FLOPs and MFU count these); "
            f"{moe['experts_per_rank']} experts per rank ({moe['expert_weights_gb_per_rank']:.1f} GB of expert "
            f"weights), all-to-all {moe['all_to_all_gb_per_rank_and_step']:.1f} GB per rank and step "
            f"({moe['all_to_all_seconds_exposed'] * 1e3:,.0f} ms exposed)"
        )
    if args.explain:
        print("\n" + explain_text(sim))
    if args.explain_png:
        explain_png(sim, args.explain_png)
        print(f"\nGantt chart written to {args.explain_png}")
    if args.train_tokens:
        c = sim.train_cost(args.train_tokens, args.price_per_gpu_hour)
        cost = f", {c['cost']:,.0f} at {args.price_per_gpu_hour:g}/GPU-hour" if c["cost"] is not None else ""
        print(
            f"\ntraining {args.train_tokens:.3g} tokens: {c['days']:,.1f} days on {sim.result.gpus} GPUs, "
            f"{c['gpu_hours']:,.0f} GPU-hours{cost}"
        )
