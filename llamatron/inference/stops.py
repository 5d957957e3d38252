"""When generation stops: a token of the end-of-sequence list, or a rule on the new tokens (stop strings).

The end-of-sequence ids of a checkpoint imported from Hugging Face are those its generation_config.json names
(`eos_token_id`: one id or a list; Llama 3's instruct models list <|eot_id|> beside <|end_of_text|>), which
import-hf keeps in meta.json; without one, config.json's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ..errors import CheckpointError


class StopStrings:
    """Stop once the generated text holds one of `strings`; `cut` ends the text before the first of them."""

    def __init__(self, decode: Callable[[list[int]], str], strings: Sequence[str]):
        if any(not s for s in strings):
            raise ValueError("a stop string is empty: it would stop before the first token")
        self.decode, self.strings = decode, list(strings)

    def __call__(self, ids: list[int]) -> bool:
        text = self.decode(ids)
        return any(s in text for s in self.strings)

    def cut(self, text: str) -> str:
        ends = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return text[: min(ends)] if ends else text


def stop_length(
    new: list[int], checked: int, stop_ids: Collection[int], stop: Callable[[list[int]], bool] | None
) -> int | None:
    """The number of tokens of `new` to keep when a stopping rule ends it after its first `checked` tokens (which
    did not): through the first token in `stop_ids`, or the shortest prefix `stop` holds for. `stop` is asked
    of the whole first, then of each prefix only if it holds there: a rule that holds for a prefix holds for every
    longer one (stop strings do), and the text is decoded once per check, not once per token."""
    eos = next((n for n in range(checked, len(new)) if new[n] in stop_ids), None)
    end = len(new) if eos is None else eos + 1
    if stop is not None and end > checked and stop(new[:end]):
        end = next(n for n in range(checked + 1, end + 1) if stop(new[:n]))
        return end
    return None if eos is None else end


def eos_ids_of(meta: Mapping[str, Any]) -> set[int]:
    """The end-of-sequence ids a checkpoint's meta.json names (an import's generation_config.json, else its
    config.json); none for a checkpoint trained from scratch (the tokenizer's EOS is the command's)."""
    hf = meta.get("hf") or {}
    for source, name in ((hf.get("generation_config"), "generation_config.json"), (hf.get("config"), "config.json")):
        if not isinstance(source, Mapping) or source.get("eos_token_id") is None:
            continue
        value = source["eos_token_id"]
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise CheckpointError(
                f"the imported {name} has eos_token_id {value!r}: not a token id or a list of them; "
                "fix it in the Hugging Face directory and import it again"
            )
        return set(ids)
    return set()
