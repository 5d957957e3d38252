"""One setting of config/settings.py's sections: its dataclass field, with the help, choices and range its flag and
YAML key are checked against."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from .ranges import Range


def setting(
    default: Any, help: str, choices: tuple | None = None, allowed: Range | None = None, words: bool = False
) -> Any:
    """A setting: its default, help and choices; `allowed`: the range of a number (every int and float has one);
    `words`: a text of several words (a blend's W1 P1 W2 P2) that its flag also takes unquoted, as Megatron-LM's
    --data-path does."""
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
