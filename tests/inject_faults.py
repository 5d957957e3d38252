"""Runs a llamatron command with faults injected, for the tests of what a run does when things go wrong:

    python tests/inject_faults.py [--nan-steps 3,4] [--hang RANK:STEP:SECONDS] [--fail-save STEP:RANK] -- train ...

(also as torchrun's script, once per rank). llamatron itself never looks for faults to inject: this builds a
`FaultInjection` and passes it to `llamatron.cli.main`.
"""

from __future__ import annotations

import argparse
import sys

from llamatron import cli
from llamatron.training.faults import FaultInjection


def _ints(text: str, sep: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(sep))


def parse(argv: list[str]) -> tuple[FaultInjection, list[str]]:
    """The injection named before `--`, and the llamatron command line after it."""
    if "--" not in argv:
        raise SystemExit("usage: inject_faults.py [FAULTS] -- COMMAND ARGS (see the docstring)")
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="inject_faults.py")
    p.add_argument("--nan-steps", default="", help="1-based steps whose loss becomes NaN, e.g. 2,4,5")
    p.add_argument("--hang", default=None, help="RANK:STEP:SECONDS: that rank sleeps before that step")
    p.add_argument("--fail-save", default=None, help="STEP:RANK: that rank's write of that checkpoint fails")
    args = p.parse_args(argv[:split])
    hang = None
    if args.hang:
        rank, step, seconds = args.hang.split(":")
        hang = (int(rank), int(step), float(seconds))
    fail_save = _ints(args.fail_save, ":") if args.fail_save else None
    nan_steps = frozenset(_ints(args.nan_steps, ",")) if args.nan_steps else frozenset()
    return FaultInjection(nan_steps=nan_steps, hang=hang, fail_save=fail_save), argv[split + 1 :]


if __name__ == "__main__":
    faults, command = parse(sys.argv[1:])
    cli.main(command, faults=faults)
