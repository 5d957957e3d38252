"""`llamatron <command>`: builds the parser from the command modules (llamatron/commands/) and turns the errors a
user can fix into one line and an exit status."""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TextIO

from . import __version__
from .commands import COMMANDS
from .config.megatron_flags import not_aliased_hint
from .dependency_noise import quiet_dependency_noise
from .errors import CheckpointError, ConfigError, DataError, TrainingAborted
from .models.families import CONFIG_FIELDS
from .parent_watch import stop_with_parent
from .training.faults import NO_FAULTS, FaultInjection


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
    model_fields = set(CONFIG_FIELDS)
    hints = []
    for arg in unknown:
        flag = arg.split("=")[0]
        close = difflib.get_close_matches(flag, known, n=2, cutoff=0.6)
        field = flag.lstrip("-").replace("-", "_")
        megatron_hint = not_aliased_hint(flag, known)
        if megatron_hint:
            hints.append(megatron_hint)
        elif arg.startswith("--") and field in model_fields:  # the model's shape is the preset's, changed by these
            flag_way = f"with --model-override {field}=VALUE or " if "--model-override" in known else ""
            hints.append(
                f"{flag}: {field} is a field of the model; set it {flag_way}in a YAML file given with --config, "
                f"as `model_overrides: {{{field}: VALUE}}`"
            )
        elif arg.startswith("--") and close:
            hints.append(f"{flag}: did you mean {' or '.join(close)}?")
    target.error(f"unrecognized arguments: {' '.join(unknown)}" + ("\n" + "\n".join(hints) if hints else ""))


def _torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def _is_out_of_memory(e: BaseException) -> bool:
    torch = sys.modules.get("torch")  # not imported: nothing ran on a GPU
    return torch is not None and isinstance(e, torch.OutOfMemoryError)


def out_of_memory_message(e: BaseException, recompute_on: bool = False) -> str:
    """One line for a GPU that ran out of memory mid-run: torch's first sentences (what was asked for, what the
    GPU holds) and the fixes. Nothing saved is touched: checkpoints are written whole or not at all."""
    sentences = str(e).replace("\n", " ").split(". ")
    what = ". ".join(s for s in sentences[:3] if not s.startswith(("If reserved", "See documentation", "Including")))
    rank = os.environ.get("RANK")
    recompute = "" if recompute_on else ", add --recompute full"
    return (
        f"out of GPU memory{f' on rank {rank}' if rank is not None else ''} ({what.rstrip('.')}). Lower "
        f"--micro-batch-size or --seq-length{recompute}, or spread the model over more GPUs "
        "(--tp, --pp, --cp, --distributed-optimizer); `llamatron plan` estimates each layout's memory"
    )


class Console:
    """stdout or stderr that outlives its reader: once a write fails because the reader went away (a closed pipe,
    `llamatron train ... | head`; a hung-up terminal's EIO), the stream's file descriptor is pointed at
    /dev/null and the command goes on. A run is not its console: it keeps training, saving and writing its
    metrics file, and its exit status says how it ended (a dead console used to end it early with status 0,
    which a scheduler would have called a success)."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.lost = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            self._lose(e)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self._lose(e)

    def _lose(self, error: OSError) -> None:
        if error.errno not in (errno.EPIPE, errno.EIO):  # a full disk behind a redirect is the user's to hear of
            raise error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())  # C-level writes (torch's warnings) and the exit's flush too
        os.close(devnull)
        self.lost = True

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self.stream, name)


def guard_console() -> None:
    """Make sys.stdout and sys.stderr Consoles (once)."""
    if not isinstance(sys.stdout, Console):
        sys.stdout = Console(sys.stdout)
    if not isinstance(sys.stderr, Console):
        sys.stderr = Console(sys.stderr)


def main(argv: list[str] | None = None, faults: FaultInjection = NO_FAULTS) -> None:
    """faults: what a test injects into a run (tests/inject_faults.py); none otherwise."""
    guard_console()
    quiet_dependency_noise()
    stop_with_parent()  # a rank of `--nproc-per-node`: stop if the launcher dies (parent_watch.py)
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
            print(f"llamatron {args.command}: checkpoint error: {e.for_command(args.command)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C outside training's steps (which stop at the step's end and save instead)
        if first_rank:
            print(f"llamatron {args.command}: interrupted (Ctrl-C); nothing more was done", file=sys.stderr)
        sys.exit(130)
    except TrainingAborted as e:  # too many non-finite steps, a hung rank: the message says what to do
        if e.rank_specific or first_rank:
            print(f"llamatron {args.command}: stopped: {e}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as e:
        if not _is_out_of_memory(e):
            raise
        # rank-specific (one rank's GPU fills first): every rank that hits it says so
        recompute_on = getattr(args, "recompute", None) == "full"
        print(f"llamatron {args.command}: {out_of_memory_message(e, recompute_on)}", file=sys.stderr)
        sys.exit(1)
