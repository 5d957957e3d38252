"""`llamatron train`: one process, torchrun's ranks, or --nproc-per-node N; no data given: the demo."""

from __future__ import annotations

import argparse
import os

from ..config.settings import add_config_arguments, load_config
from ..errors import STOPPED_EARLY_EXIT
from ..training.trainer import model_to_train, run_training
from . import demo
from .launch import add_launch_argument, relaunch_if_asked


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (no data given: the embedded demo corpus)",
        description="Train a model. With no --data and no --mock-data it trains llama-tiny on the "
        "Python standard library's source (the demo), then samples from it; with --objective dpo and no data it "
        "aligns that model with DPO on real continuations of the same source against ones with tokens swapped "
        "(the DPO demo).",
    )
    add_config_arguments(p)
    add_launch_argument(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    # checked against the model it trains (a --load checkpoint's); the ranks then apply the demo's settings
    status = relaunch_if_asked(args, cfg, model_to_train(cfg) if args.nproc_per_node else None)
    if status is not None:
        return status
    is_demo = demo.is_demo(cfg)
    note = None
    if is_demo:
        demo.apply_demo_defaults(cfg)
        note = demo.demo_start_note(cfg)
    result = run_training(cfg, on_checked=note, faults=args.faults)
    if is_demo and result.checkpoint and int(os.environ.get("RANK", "0")) == 0:
        if cfg.objective.objective == "dpo":
            demo.print_dpo_demo_summary(result.valid, result.checkpoint)
        elif cfg.objective.objective == "grpo":
            demo.print_grpo_demo_summary(result.checkpoint)
        else:
            demo.print_demo_summary(result.valid, result.checkpoint)
    return STOPPED_EARLY_EXIT if result.stopped_early else 0
