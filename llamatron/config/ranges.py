"""The allowed values of numeric settings: a `Range` declared on each field of config.py, checked in one place.

A number can be of the right type and still make no sense: `--lr -1` trains and diverges, `--lr nan` makes every
step non-finite, `--seed -1` fails deep inside numpy. config.py attaches a Range to every int and float field
(its `_f(..., allowed=...)`) and refuses to import when one lacks it, so a new setting cannot skip the check;
`config.settings.range_problems` calls `problem` for each of them, the first check of `training.validate`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

# Integer settings end up in torch and numpy int64 values (sample counts, steps, sizes): no bigger ones.
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Range:
    """`low <= value <= high` (`<` with low_open / high_open); None: unbounded on that side, except that an
    integer is never above INT64_MAX and a float is always finite. `note` says what a bound means to a user."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def allows(self, value: float, integer: bool) -> bool:
        if not integer and not math.isfinite(value):
            return False
        high = self.high if self.high is not None else (INT64_MAX if integer else None)
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return high is None or (value < high if self.high_open else value <= high)

    def describe(self, integer: bool) -> str:
        """The range in words, e.g. '>= 1', '> 0', 'in [0, 1)', 'in 0..4294967295'."""
        low, high = _text(self.low), _text(self.high)
        if integer and self.low is not None and self.high is not None and not (self.low_open or self.high_open):
            text = f"in {low}..{high}"
        elif self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {low}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {high}"
        else:
            text = ""  # unbounded (a float must still be finite)
        return " ".join(part for part in (text, f"({self.note})" if self.note else "") if part)


def _text(bound: float | None) -> str:
    return "" if bound is None else (f"{bound:g}" if isinstance(bound, float) else str(bound))


def at_least(low: float, note: str = "") -> Range:
    return Range(low=low, note=note)


def above(low: float, note: str = "") -> Range:
    return Range(low=low, low_open=True, note=note)


def problem(flag: str, value: float, allowed: Range, integer: bool) -> str | None:
    """Why `value` of `flag` is out of its range (None when it is in range), naming the range."""
    if allowed.allows(value, integer):
        return None
    if not integer and not math.isfinite(value):
        return " ".join(part for part in (f"{flag} {value} must be a finite number", allowed.describe(integer)) if part)
    if integer and allowed.high is None and value > INT64_MAX:
        return f"{flag} {value} is too large: at most {INT64_MAX}"
    return f"{flag} {value} must be {allowed.describe(integer)}"


def number_arg(kind: type, allowed: Range):
    """An argparse `type=` for the commands' own numeric flags (train's come from config.py): parses `kind` and
    refuses a value outside `allowed`, so argparse prints one line and exits 2."""
    integer = kind is int

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if integer else 'a number'}") from None
        if not allowed.allows(value, integer):
            finite = "" if integer or math.isfinite(value) else "a finite number "
            raise argparse.ArgumentTypeError(f"{text} must be {finite}{allowed.describe(integer)}".rstrip())
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


SEED = Range(low=0, high=2**32 - 1, note="numpy's seed range")

__all__ = ["INT64_MAX", "SEED", "Range", "above", "at_least", "number_arg", "problem"]


def setting(
    default: Any, help: str, choices: tuple | None = None, allowed: Range | None = None, words: bool = False
) -> Any:
    """A setting's dataclass field: its default, help and choices; `allowed`: the range of a number (every int and
    float has one); `words`: a text of several words (a blend's W1 P1 W2 P2) that its flag also takes unquoted, as
    Megatron-LM's --data-path does. config/settings.py makes each such field a flag and a YAML key."""
    meta: dict[str, Any] = {"help": help}
    if words:
        meta["words"] = True
    if choices:
        meta["choices"] = choices
    if allowed is not None:
        meta["allowed"] = allowed
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
