"""`--nproc-per-node N`: a command that re-runs itself under torchrun (through `llamatron.local_launch`)."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import torch

from ..config.settings import RunConfig
from ..models import ModelConfig
from ..parent_watch import started_by_me
from ..training.validate import validate


def add_launch_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="start torchrun with this many processes on this machine (one per GPU)",
    )


def relaunch_if_asked(args: argparse.Namespace, cfg: RunConfig, model: ModelConfig | None = None) -> int | None:
    """With --nproc-per-node: check the settings once, here (rather than once per spawned rank), against `model`
    (default: --model's), then run this command under torchrun and return its exit status; without it, None."""
    if not args.nproc_per_node:
        return None
    validate(cfg, args.nproc_per_node, torch.cuda.is_available(), model)
    return relaunch_with_torchrun(args.nproc_per_node)


def _argv_without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    return out


def relaunch_with_torchrun(nproc: int) -> int:
    """This process's command line, minus --nproc-per-node, as `nproc` torchrun ranks; their exit status."""
    # --standalone: a single-node job with its own rendezvous on a free local port.
    cmd = [
        sys.executable,
        "-m",
        "llamatron.local_launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "llamatron",
        *_argv_without_nproc(sys.argv[1:]),
    ]
    launcher = subprocess.Popen(cmd, env=started_by_me())  # it stops when this process dies (parent_watch.py)
    # A stop signal to this process (a scheduler's SIGTERM, a Ctrl-C, an IDE's stop) goes on to the ranks, through
    # the launcher, and this process waits for them to save and exit.
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: launcher.send_signal(signum))
    return launcher.wait()
