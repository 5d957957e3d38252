"""GRPO's reward functions: built-in verifiable rewards, and a user's own named on the command line.

A reward function is called as TRL calls one: `f(prompts=[...], completions=[...], completion_ids=[...],
**fields)`, every list one entry per completion, `fields` each other field of the prompts' records (one value per
completion: `answer=[...]`), and returns one number per completion. `--reward` names each: a built-in below, or
`FILE.py:FUNCTION` (the only code a run executes on the user's behalf; a prompts file's fields are data, never
looked up as code). The completions' reward is the sum of the functions' rewards times `--reward-weights`.

Built-ins:
    exact_answer   1 if the completion's final answer equals the record's `answer`, else 0: the last \\boxed{...}
                   or else the last number of the completion, against the record's \\boxed{} or what follows
                   its #### (GSM8K's) or all of it; compared as numbers where both are (1,000 = 1000.0 = 1000 =
                   \\frac{2000}{2}), else as text with spaces and a trailing period dropped
    format         1 if the completion is `<think>...</think>` then `<answer>...</answer>` (DeepSeek-R1's), else 0
    regex:PATTERN  1 if PATTERN matches the completion (re.search, dot matches newlines), else 0
    length         -(completion tokens) / --max-completion-length: a penalty on length, in [-1, 0]
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..errors import ConfigError, DataError

RewardFunction = Callable[..., Sequence[Any]]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"^\\d?frac\{(-?\d+)\}\{(\d+)\}$")
_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


class RewardError(DataError):
    """A reward function that raised or returned something other than one number per completion."""


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces nested inside it kept)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """A text's final answer: its last \\boxed{...}, else its last number, else None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _reference_answer(answer: Any) -> str:
    """A record's answer: its \\boxed{...}, else what follows its last #### (GSM8K's), else all of it."""
    text = str(answer)
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    return text.rsplit("####", 1)[-1].strip()


def _as_number(text: str) -> Fraction | None:
    text = _FRAC.sub(r"\1/\2", text)
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(completion: str, answer: Any) -> bool:
    """Whether the completion's final answer is `answer` (its own final answer where it is a worked solution)."""
    mine, theirs = final_answer(completion), _reference_answer(answer)
    if mine is None:
        return False
    a, b = _as_number(mine), _as_number(theirs)
    if a is not None and b is not None:
        return a == b
    return " ".join(mine.split()).rstrip(".") == " ".join(theirs.split()).rstrip(".")


def completion_text(completion: Any) -> str:
    """A completion's text: itself, or a conversational one's last message's content (TRL's
    [{"role": "assistant", "content": ...}])."""
    return completion if isinstance(completion, str) else str(completion[-1]["content"])


def exact_answer(completions: Sequence[Any], answer: Sequence[Any], **_: Any) -> list[float]:
    return [float(same_answer(completion_text(c), a)) for c, a in zip(completions, answer)]


def format_reward(completions: Sequence[Any], **_: Any) -> list[float]:
    return [float(bool(_FORMAT.match(completion_text(c)))) for c in completions]


def _regex_reward(pattern: re.Pattern) -> RewardFunction:
    def regex(completions: Sequence[Any], **_: Any) -> list[float]:
        return [float(bool(pattern.search(completion_text(c)))) for c in completions]

    return regex


def _length_reward(limit: int) -> RewardFunction:
    def length(completion_ids: Sequence[Sequence[int]], **_: Any) -> list[float]:
        return [-len(ids) / limit for ids in completion_ids]

    return length


# built-in name -> the record fields it reads
BUILTIN_FIELDS: dict[str, tuple[str, ...]] = {"exact_answer": ("answer",), "format": (), "length": ()}


@dataclass(frozen=True)
class Reward:
    name: str  # as --reward names it
    function: RewardFunction
    fields: tuple[str, ...]  # the record fields it needs (a built-in's; a user's function: none known)


def load_reward(spec: str, max_completion_length: int) -> Reward:
    """The reward --reward `spec` names (ConfigError, one line, for one that cannot be loaded)."""
    if spec == "exact_answer":
        return Reward(spec, exact_answer, BUILTIN_FIELDS[spec])
    if spec == "format":
        return Reward(spec, format_reward, ())
    if spec == "length":
        return Reward(spec, _length_reward(max_completion_length), ())
    if spec.startswith("regex:"):
        try:
            return Reward(spec, _regex_reward(re.compile(spec[len("regex:") :], re.DOTALL)), ())
        except re.error as e:
            raise ConfigError(f"--reward {spec}: not a regular expression ({e})") from None
    if ":" not in spec or not spec.rsplit(":", 1)[0].endswith(".py"):
        raise ConfigError(
            f"--reward {spec}: not a reward; give one of {', '.join(BUILTIN_FIELDS)}, regex:PATTERN or FILE.py:FUNCTION"
        )
    return Reward(spec, _user_function(spec), ())


def _user_function(spec: str) -> RewardFunction:
    """FILE.py:FUNCTION, imported from that file (its top level runs: the user named it)."""
    path, name = spec.rsplit(":", 1)
    if not os.path.isfile(path):
        raise ConfigError(f"--reward {spec}: no file {path}; give an existing FILE.py:FUNCTION")
    module_spec = importlib.util.spec_from_file_location(f"llamatron_reward_{abs(hash(path))}", path)
    assert module_spec is not None and module_spec.loader is not None  # a .py file always has one
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"--reward {spec}: importing {path} failed: {type(e).__name__}: {e}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"--reward {spec}: {path} has no function {name}")
    return function


def load_rewards(specs: Sequence[str], weights: Sequence[float], max_completion_length: int) -> list[Reward]:
    """--reward's functions; --reward-weights must give one weight each (or none)."""
    if not specs:
        raise ConfigError("--objective grpo needs --reward (exact_answer, format, length, regex:P or FILE.py:FN)")
    if weights and len(weights) != len(specs):
        raise ConfigError(f"--reward-weights gives {len(weights)} weights for {len(specs)} --reward; give one each")
    return [load_reward(s, max_completion_length) for s in specs]


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    records: Sequence[dict[str, Any]],
    record_numbers: Sequence[int],
) -> list[list[float]]:
    """Each reward's values (one list per reward, one number per completion); RewardError, naming the reward and
    the record (its line in the prompts file), for a function that raises or returns other than a number each."""
    fields = {k: [r.get(k) for r in records] for k in records[0] if k != "prompt"}
    out = []
    for reward in rewards:
        try:
            values = list(
                reward.function(
                    prompts=list(prompts), completions=list(completions), completion_ids=completion_ids, **fields
                )
            )
        except Exception as e:
            raise RewardError(
                f"reward {reward.name} raised {type(e).__name__}: {e} (on the completions of prompts-file lines "
                f"{_lines(record_numbers)})"
            ) from None
        if len(values) != len(completions):
            raise RewardError(
                f"reward {reward.name} returned {len(values)} values for {len(completions)} completions: give one each"
            )
        for value, line in zip(values, record_numbers):
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardError(
                    f"reward {reward.name} returned {value!r} for a completion of prompts-file line {line}: "
                    "a reward must be a finite number"
                )
        out.append([float(v) for v in values])
    return out


def _lines(numbers: Sequence[int]) -> str:
    unique = sorted(set(numbers))
    return f"{unique[0]}-{unique[-1]}" if len(unique) > 1 else str(unique[0])


__all__ = ["Reward", "RewardError", "exact_answer", "final_answer", "load_rewards", "same_answer", "score"]
