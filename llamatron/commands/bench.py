"""`llamatron bench`: synthetic training steps, one table row of throughput and where the time goes."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

import torch.distributed as dist

from ..config.objective_settings import ObjectiveConfig
from ..config.settings import add_config_arguments, load_config
from ..errors import ConfigError
from ..training.bench import format_row, run_bench
from .launch import add_launch_argument, relaunch_if_asked

# Settings of `train` that bench does not use: its --help leaves them out, and given anyway (a train command line
# reused) they are ignored with a warning, not silently.
_TRAIN_ONLY = frozenset(
    {
        "save",
        "load",
        "finetune",
        "save_interval",
        "keep_last",
        "async_save",
        "train_steps",
        "eval_interval",
        "eval_iters",
        "eval_metrics",
        "eval_tasks",
        "eval_include_path",
        "eval_limit",
        "log_interval",
        "metrics_file",
        "progress",
        "tensorboard_dir",
        "wandb_project",
        "wandb_name",
        "wandb_mode",
        "exit_duration_mins",
        "max_skipped_steps",
        # DPO's step is the language model's forward and backward on pairs, after a reference pass bench has no
        # use for: bench times the step of --objective lm
        "objective",
        "dpo_beta",
        "dpo_loss",
        "preference_data",
        # GRPO's step trains on rollouts it samples first (objectives/grpo.py): not bench's step either
        *(f.name for f in fields(ObjectiveConfig) if f.name not in ("objective", "dpo_beta", "dpo_loss")),
    }
)


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure training throughput on synthetic data (or the first batch of --data)",
        description=(
            "Runs --warmup untimed and --steps timed training steps on one batch of synthetic tokens (with --data or "
            "--sft-data: the corpus's first batch, so document masks see real documents) and prints one row: tokens/s "
            "per GPU, TFLOP/s, MFU, peak memory, and a breakdown (forward, backward, exposed gradient sync, optimizer, "
            "pipeline bubble) measured on one extra instrumented step, so its parts need not add up to the timed "
            "step. The model, parallel, optimizer, precision, kernel and data flags of `train` apply and are listed "
            "here; its checkpoint, evaluation, logging and fault flags are not (given anyway, they are ignored with "
            "a warning). Run under torchrun (or --nproc-per-node) for several GPUs."
        ),
    )
    add_config_arguments(p, _TRAIN_ONLY)
    add_launch_argument(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps first: compilation, allocator (default: 3; --warmup-steps is the learning rate's warm-up)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table row")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError(
            f"--steps {args.steps} --warmup {args.warmup}: bench needs at least 1 timed step and "
            "0 or more warm-up steps"
        )
    cfg = load_config(args)
    ignored = sorted(cfg.explicit & _TRAIN_ONLY)
    cfg.objective.objective, cfg.data.preference_data = "lm", None
    cfg.data.mock_data = cfg.data.data is None and cfg.data.sft_data is None
    cfg.train.train_steps = args.warmup + args.steps + 2
    status = relaunch_if_asked(args, cfg)
    if status is not None:
        return status
    if ignored and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"llamatron bench: ignoring {', '.join('--' + k.replace('_', '-') for k in ignored)} (bench trains on "
            "one batch and saves, evaluates and logs nothing)",
            file=sys.stderr,
        )
    row = run_bench(cfg, args.steps, args.warmup)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(row) if args.json else format_row(row), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
