"""GRPO's prompts: a JSONL file of records, each a `prompt` and the fields its rewards read (`answer`, ...).

A prompt is a text, encoded as it is, or (conversational, as TRL's) a list of {"role", "content"} messages,
rendered with the tokenizer's chat template (else Llama 3's format or ChatML: data/sft.ChatRenderer) and followed
by the opening of the assistant's turn; its completions then stop at the format's end of turn.

Read whole (a prompts file is small next to a corpus) and checked before the model is built: every line a JSON
object with a non-empty prompt text and every field the built-in rewards need, each prompt short enough to leave
--max-completion-length tokens within --seq-length.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ..errors import DataError, MissingDataError
from .preprocess import RecordError
from .sft import ChatRenderer
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Prompts:
    records: list[dict[str, Any]]
    ids: list[list[int]]  # each prompt's tokens (BOS first where the tokenizer adds one)
    lines: list[int]  # each record's line in the file (1-based)
    end_of_turn_id: int | None = None  # conversational prompts: the chat format's end of turn, as one token
    end_of_turn: str | None = None  # ... or as text, where it is several tokens


def conversational(prompt: Any) -> bool:
    """A list of {"role", "content"} messages (TRL's conversational format)."""
    return isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    )


def read_prompt_records(path: str, needed: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of a prompts file and their line numbers; DataError (one line) for the first bad one."""
    if not os.path.isfile(path):
        raise MissingDataError(f'--prompts {path}: no such file; give a JSONL file of {{"prompt": ...}} records')
    records, lines = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--prompts {path} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not JSON ({e.msg}); give one JSON object a line") from None
            prompt = record.get("prompt") if isinstance(record, dict) else None
            if not (isinstance(prompt, str) or conversational(prompt)) or not prompt:
                kinds = 'a non-empty text or a list of {"role", "content"} messages'
                raise DataError(f'{where}: needs a "prompt": {kinds}')
            missing = [k for k in needed if k not in record]
            if missing:
                raise DataError(
                    f"{where}: has no {', '.join(missing)} field, which --reward needs; add it to each record"
                )
            records.append(record)
            lines.append(number)
    if not records:
        raise DataError(f"--prompts {path}: holds no records")
    return records, lines


def encode_prompts(
    records: list[dict[str, Any]],
    lines: list[int],
    tokenizer: Tokenizer,
    path: str,
    room: tuple[int, str],
    completion: int,
) -> Prompts:
    """The records with their tokens; DataError for a prompt longer than `room` - `completion` tokens (room: the
    tokens a sequence holds, and the limit that sets it, as the message names it)."""
    renderer = ChatRenderer(tokenizer.source, tokenizer) if any(conversational(r["prompt"]) for r in records) else None
    texts = [_text(r["prompt"], renderer, path, line) for r, line in zip(records, lines)]
    ids = tokenizer.encode_batch(texts)
    bos = tokenizer.bos_id
    if tokenizer.adds_bos and bos is not None and renderer is None:  # a chat format writes its own BOS
        ids = [[bos, *p] for p in ids]
    for tokens, line in zip(ids, lines):
        if not tokens:
            raise DataError(f"--prompts {path} line {line}: the prompt encodes to no tokens")
        if len(tokens) + completion > room[0]:
            raise DataError(
                f"--prompts {path} line {line}: a prompt of {len(tokens)} tokens and --max-completion-length "
                f"{completion} exceed {room[1]}; shorten the prompt or the completions"
            )
    if renderer is None:
        return Prompts(records, ids, lines)
    several = renderer.end_of_turn if renderer.end_of_turn_id is None and renderer.end_of_turn else None
    return Prompts(records, ids, lines, renderer.end_of_turn_id, several)


def _text(prompt: Any, renderer: ChatRenderer | None, path: str, line: int) -> str:
    if renderer is None or isinstance(prompt, str):
        return prompt
    try:
        return renderer.prompt(prompt)
    except RecordError as e:
        raise DataError(f"--prompts {path} line {line}: {e}") from None
