"""Preference data: records of a prompt and two responses, one preferred -> two token sequences with response masks.

A record (one JSON object per line, TRL's preference format) holds

- the prompt: ``"prompt"``, a string (one user message) or a list of ``{"role", "content"}`` messages, or
  ``"messages"``, a list of messages (the conversation so far);
- ``"chosen"`` and ``"rejected"``: each a string (one assistant reply) or a list of messages (the assistant's
  turns).

Each response is appended to the prompt and rendered like an SFT conversation (data/sft.py's ChatRenderer: the
tokenizer's chat template, else Llama 3's format or ChatML); the loss mask covers the response's assistant
replies only, never an assistant turn of the prompt.

Stored layout (``preprocess --preference --output-prefix OUT``), record i being document i of each:

    OUT_pref_chosen.bin/.idx     OUT_pref_chosen_mask.bin/.idx     the preferred response's tokens and 0/1 mask
    OUT_pref_rejected.bin/.idx   OUT_pref_rejected_mask.bin/.idx   the other one's

Train on it with ``llamatron train --objective dpo --preference-data OUT_pref`` (preference_dataset.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from llamatron.data.indexed import best_token_dtype
from llamatron.data.preprocess import RecordError, run_encoder
from llamatron.data.sft import ChatRenderer, Message, Segment, checked_messages, mask_prefix, tokens_and_mask
from llamatron.data.tokenizer import load_tokenizer

RESPONSES = ("chosen", "rejected")


def preference_output_prefix(output_prefix: str) -> str:
    return f"{output_prefix}_pref"


def response_prefix(prefix: str, response: str) -> str:
    """The token dataset of one response ("chosen" or "rejected") of the preference data ``prefix``."""
    return f"{prefix}_{response}"


def preference_outputs(prefix: str, dtype: np.dtype | type) -> dict[str, tuple[str, np.dtype]]:
    """The four datasets of preference data `prefix`, in the order of a record's arrays: name -> (their prefix,
    dtype): chosen, chosen_mask, rejected, rejected_mask."""
    out: dict[str, tuple[str, np.dtype]] = {}
    for response in RESPONSES:
        tokens = response_prefix(prefix, response)
        out[response] = (tokens, np.dtype(dtype))
        out[f"{response}_mask"] = (mask_prefix(tokens), np.dtype(np.uint8))
    return out


def _messages(value: Any, key: str, default_role: str) -> list[Message]:
    """A string as one message of ``default_role``, or a list of messages, checked; RecordError otherwise."""
    if isinstance(value, str):
        if not value:
            raise RecordError("empty document", f"key {key!r} is empty")
        return [{"role": default_role, "content": value}]
    if not isinstance(value, list):
        raise RecordError("bad conversation", f"key {key!r} must be a string or a non-empty list of messages")
    return checked_messages(value, key, key + "[{i}]")


def preference_from_record(record: dict) -> tuple[list[Message], list[Message], list[Message]]:
    """(prompt, chosen, rejected) messages of a record, or RecordError saying what is wrong."""
    prompt_key = "prompt" if "prompt" in record else "messages"
    missing = [k for k in (prompt_key, *RESPONSES) if k not in record]
    if missing:
        raise RecordError(
            "missing key",
            f"missing key {missing[0]!r} (a preference record holds prompt (or messages), chosen and rejected)",
        )
    prompt = _messages(record[prompt_key], prompt_key, "user")
    responses = [_messages(record[k], k, "assistant") for k in RESPONSES]
    for key, messages in zip(RESPONSES, responses):
        if not any(m["role"] == "assistant" and m["content"] for m in messages):
            raise RecordError("no assistant message", f"{key!r} has no assistant reply to train on")
    return prompt, responses[0], responses[1]


def response_segments(renderer: ChatRenderer, prompt: list[Message], response: list[Message]) -> list[Segment]:
    """Segments of prompt + response, trained only on the response's assistant replies: each assistant message
    is one trained segment, so the prompt's own (its first ones) are made untrained."""
    segments = renderer.segments(prompt + response)
    untrain = sum(m["role"] == "assistant" for m in prompt)
    out: list[Segment] = []
    for text, trained in segments:
        if trained and untrain:
            untrain -= 1
            trained = False
        out.append((text, trained))
    return out


class PreferenceEncoder:
    """Preprocess encoder for preference records: tokens and response masks of the chosen and rejected sequences."""

    def __init__(self, tokenizer_path: str) -> None:
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.renderer = ChatRenderer(tokenizer_path, self.tokenizer)
        self.dtype = best_token_dtype(self.tokenizer.vocab_size)
        self.token_outputs = RESPONSES

    def outputs(self, output_prefix: str) -> dict[str, tuple[str, np.dtype]]:
        return preference_outputs(preference_output_prefix(output_prefix), self.dtype)

    def _encode(self, segments: list[Segment]) -> list[np.ndarray]:
        return tokens_and_mask([(self.tokenizer.encode(text), trained) for text, trained in segments], self.dtype)

    def encode(self, records: list[dict]) -> list[list[np.ndarray] | RecordError]:
        out: list[Any] = []
        for record in records:
            try:
                prompt, chosen, rejected = preference_from_record(record)
                arrays = []
                for response in (chosen, rejected):
                    arrays += self._encode(response_segments(self.renderer, prompt, response))
                out.append(arrays)
            except RecordError as err:
                out.append(err)
        return out


def preprocess_preferences(
    inputs: str | Sequence[str],
    output_prefix: str,
    tokenizer_path: str,
    workers: int = 1,
    skip_bad_lines: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize preference records into ``{output_prefix}_pref_{chosen,rejected}`` (+ ``_mask``); return the
    preprocess summary with ``pairs`` and ``chat_format`` added."""
    renderer = ChatRenderer(tokenizer_path)  # in this process: the workers' would warn once each
    warning = renderer.missing_markers_warning(tokenizer_path)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    encoder = (PreferenceEncoder, (tokenizer_path,))
    summary = run_encoder(inputs, output_prefix, encoder, workers, skip_bad_lines, progress)
    summary["pairs"] = summary["documents"]
    summary["chat_format"] = renderer.format
    prefix = preference_output_prefix(output_prefix)
    summary["notes"] = {
        "chat format": renderer.format,
        "pairs": str(summary["pairs"]),
        "train with": f"--objective dpo --preference-data {prefix}",
    }
    return summary


__all__ = [
    "PreferenceEncoder",
    "preference_from_record",
    "preference_outputs",
    "preprocess_preferences",
    "response_prefix",
]
