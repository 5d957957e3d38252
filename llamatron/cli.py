"""`llamatron <command>`: builds the parser from the command modules (llamatron/commands/) and turns the errors a
user can fix into one line and an exit status."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from . import __version__
from .commands import COMMANDS
from .errors import CheckpointError, ConfigError, DataError, TrainingAborted
from .faults import NO_FAULTS, FaultInjection


class _Parser(argparse.ArgumentParser):
    """Errors as two lines (the error, where the options are) instead of argparse's full usage first, which
    for train and bench is ~50 lines that push the error out of sight."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help` for the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="llamatron", description="Distributed trainer for LLaMA-family models.")
    parser.add_argument("--version", action="version", version=f"llamatron {__version__} (torch {_torch_version()})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="`llamatron COMMAND --help` lists its flags")
    for command in COMMANDS:
        command.register(sub)
    return parser


def _reject_unknown(parser: argparse.ArgumentParser, command: str | None, unknown: list[str]) -> None:
    sub_action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    target = sub_action.choices.get(command, parser) if command else parser
    known = [opt for action in target._actions for opt in action.option_strings]
    hints = []
    for arg in unknown:
        close = difflib.get_close_matches(arg.split("=")[0], known, n=2, cutoff=0.6)
        if arg.startswith("--") and close:
            hints.append(f"{arg.split('=')[0]}: did you mean {' or '.join(close)}?")
    target.error(f"unrecognized arguments: {' '.join(unknown)}" + ("\n" + "\n".join(hints) if hints else ""))


def _torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None, faults: FaultInjection = NO_FAULTS) -> None:
    """faults: what a test injects into a run (tests/inject_faults.py); none otherwise."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    args.faults = faults
    if unknown:  # report against the command's own usage, with the nearest real flags
        _reject_unknown(parser, args.command, unknown)
    if args.command is None:
        parser.print_help()
        sys.exit(0)
    first_rank = os.environ.get("RANK", "0") == "0"  # under torchrun every rank fails alike: say it once
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        # Growable segments instead of fixed blocks: far less fragmentation when activations of
        # changing sizes come and go (read at CUDA's first allocation, inherited by torchrun's workers).
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        sys.exit(args.func(args))
    except ConfigError as e:
        if first_rank:
            print(f"llamatron {args.command}: configuration error: {e}", file=sys.stderr)
        sys.exit(2)
    except DataError as e:  # a bad input or data file (also a missing one): the message names it
        print(f"llamatron {args.command}: data error: {e}", file=sys.stderr)
        sys.exit(2)
    except FileNotFoundError as e:  # an input path that does not exist
        if first_rank:
            print(f"llamatron {args.command}: file not found: {e.filename or e}", file=sys.stderr)
        sys.exit(2)
    except CheckpointError as e:
        if first_rank or not e.same_on_every_rank:
            print(f"llamatron {args.command}: checkpoint error: {e}", file=sys.stderr)
        sys.exit(2)
    except TrainingAborted as e:  # too many non-finite steps, a hung rank: the message says what to do
        if e.rank_specific or first_rank:
            print(f"llamatron {args.command}: stopped: {e}", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:  # the reader went away (`llamatron plan --json | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
        sys.exit(0)
