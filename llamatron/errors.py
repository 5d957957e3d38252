"""The errors llamatron reports to a user: one type per kind of input, each message naming the fix.

A leaf module (it imports only the standard library), so any module may raise these without pulling in torch or
another package. `llamatron.cli.main` turns each into one line and an exit code.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# The exit status of a training run that stopped before --train-steps (a stop signal, --exit-duration-mins) after
# saving what it could: not 0, as the run did not finish; not 1 or 2 (a failure, bad input), so that a job script
# can tell "resubmit with --load" from "fix something first".
STOPPED_EARLY_EXIT = 3


def did_you_mean(name: object, names: Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest of `names` to a misspelt `name`; '' when none is near."""
    if not isinstance(name, str):  # a YAML key such as 1
        return ""
    near = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


class ConfigError(ValueError):
    """Settings (flags, YAML, a model shape, a layout) that cannot work; the message says how to fix them."""


class MissingPackageError(ConfigError, ImportError):
    """An optional package a setting or file needs is not installed; the message names it and the pip command."""


class DataError(ValueError):
    """A data file that cannot be used; the message names the file, the problem and the fix."""


class MissingDataError(DataError, FileNotFoundError):
    """A data file that does not exist."""


class CheckpointError(ValueError):
    """A checkpoint (or imported weights) that cannot be read, written or used for this model.

    `same_on_every_rank`: every rank raises this same message (a save's outcome): only rank 0 prints it.
    """

    same_on_every_rank = False

    def for_command(self, command: str) -> str:
        """The message as `llamatron COMMAND` reports it (the same for every command unless a subclass says)."""
        return str(self)


class ForeignCheckpointError(CheckpointError):
    """A directory of a format llamatron converts (`what`, converted by `convert`), given where a llamatron
    checkpoint is needed; the way to use the converted one differs per command."""

    def __init__(self, path: str, what: str, convert: str):
        self.path, self.what, self.convert = path, what, convert
        super().__init__(self.for_command("train"))

    def for_command(self, command: str) -> str:
        # the conversions write weights only: training starts from them with --finetune; verify and export-hf take
        # the checkpoint as their first argument
        if command == "train":
            then = "--load OUT --finetune"
        elif command in ("verify", "export-hf"):
            then = f"`llamatron {command} OUT ...`"
        else:
            then = "--load OUT"
        return (
            f"{self.path} is {self.what}, not a llamatron checkpoint: convert it first with {self.convert}, then {then}"
        )


class HFConversionError(CheckpointError):
    """A Hugging Face model llamatron cannot represent, or weights that do not fit their config."""


class TrainingAborted(Exception):
    """The run cannot usefully continue; the message says why and what to do.

    `rank_specific`: the message differs between ranks (then every rank prints it, else only rank 0).
    """

    rank_specific = False


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "ForeignCheckpointError",
    "HFConversionError",
    "MissingDataError",
    "MissingPackageError",
    "TrainingAborted",
    "did_you_mean",
]
