"""GRPO's prompts: a JSONL file of records, each a `prompt` text and the fields its rewards read (`answer`, ...).

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
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Prompts:
    records: list[dict[str, Any]]
    ids: list[list[int]]  # each prompt's tokens (BOS first where the tokenizer adds one)
    lines: list[int]  # each record's line in the file (1-based)


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
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
                raise DataError(f'{where}: needs a non-empty "prompt" text')
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
    records: list[dict[str, Any]], lines: list[int], tokenizer: Tokenizer, path: str, room: int, completion: int
) -> Prompts:
    """The records with their tokens; DataError for a prompt longer than `room` - `completion` tokens."""
    ids = tokenizer.encode_batch([r["prompt"] for r in records])
    bos = tokenizer.bos_id
    if tokenizer.adds_bos and bos is not None:
        ids = [[bos, *p] for p in ids]
    for tokens, line in zip(ids, lines):
        if not tokens:
            raise DataError(f"--prompts {path} line {line}: the prompt encodes to no tokens")
        if len(tokens) + completion > room:
            raise DataError(
                f"--prompts {path} line {line}: a prompt of {len(tokens)} tokens and --max-completion-length "
                f"{completion} exceed --seq-length {room}; raise --seq-length or shorten the prompt"
            )
    return Prompts(records, ids, lines)
