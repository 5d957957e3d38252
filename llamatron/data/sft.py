"""Instruction data: conversations -> tokens plus an assistant-only loss mask.

A record is a conversation: a ``messages`` list of ``{"role", "content"}``
(roles system, user, assistant; any number of turns), or a prompt/response
pair (``--prompt-key/--response-key``, optional ``--system-key``).

It is rendered with the tokenizer's chat template when the tokenizer
directory has one (through transformers' ``apply_chat_template``), else as
ChatML. The rendering is cut into segments that are trained (an assistant
reply and its end-of-turn marker) or not (everything else), each segment is
tokenized, and the loss mask is 1 exactly on the tokens of trained segments.

Stored layout (``preprocess --sft --output-prefix OUT``):

    OUT_sft.bin/.idx        tokens, one document per conversation (a normal indexed dataset)
    OUT_sft_mask.bin/.idx   uint8 0/1 per token, same sizes: 1 = the model is trained to predict it

Train on it with ``llamatron train --sft-data OUT_sft`` (see sft_dataset.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from llamatron.data.indexed import best_token_dtype, data_path
from llamatron.data.preprocess import RecordError, run_encoder
from llamatron.data.tokenizer import CONFIG_FILE, load_tokenizer
from llamatron.errors import DataError

ROLES = ("system", "user", "assistant")
CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"

Segment = tuple[str, bool]  # (text, trained)
Message = dict[str, str]


def sft_output_prefix(output_prefix: str) -> str:
    return f"{output_prefix}_sft"


def mask_prefix(prefix: str) -> str:
    """The loss-mask dataset that goes with the SFT token dataset ``prefix``."""
    return f"{prefix}_mask"


# --- Conversations from records ---


def conversation_from_record(
    record: dict,
    messages_key: str = "messages",
    prompt_key: str | None = None,
    response_key: str | None = None,
    system_key: str | None = None,
) -> list[Message]:
    """The record's messages as [{"role", "content"}], or RecordError saying what is wrong."""
    if prompt_key is not None:
        messages = []
        if system_key is not None and record.get(system_key):
            if not isinstance(record[system_key], str):
                raise RecordError("bad conversation", f"key {system_key!r} is not a string")
            messages.append({"role": "system", "content": record[system_key]})
        for key, role in ((prompt_key, "user"), (response_key, "assistant")):
            if key not in record:
                raise RecordError("missing key", f"missing key {key!r}")
            if not isinstance(record[key], str):
                raise RecordError("bad conversation", f"key {key!r} is not a string")
            messages.append({"role": role, "content": record[key]})
    else:
        if messages_key not in record:
            raise RecordError("missing key", f"missing key {messages_key!r}")
        raw = record[messages_key]
        if not isinstance(raw, list) or not raw:
            raise RecordError("bad conversation", f"key {messages_key!r} must be a non-empty list of messages")
        messages = []
        for i, message in enumerate(raw):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise RecordError("bad conversation", f"message {i} needs a role in {ROLES}: {str(message)[:80]}")
            if not isinstance(message.get("content"), str):
                raise RecordError("bad conversation", f"message {i} ({message['role']}) has no string content")
            messages.append({"role": message["role"], "content": message["content"]})
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and not message["content"]:
            raise RecordError("empty document", f"empty document: assistant message {i} is empty")
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no assistant message", "conversation has no assistant message to train on")
    return messages


# --- Rendering ---


def chatml_segments(messages: Sequence[Message]) -> list[Segment]:
    """ChatML: ``<|im_start|>role\\ncontent<|im_end|>\\n``; trained: assistant content and its <|im_end|>."""
    segments: list[Segment] = []
    for message in messages:
        header = f"{CHATML_START}{message['role']}\n"
        if message["role"] == "assistant":
            segments += [(header, False), (message["content"] + CHATML_END, True), ("\n", False)]
        else:
            segments.append((header + message["content"] + CHATML_END + "\n", False))
    return merge_segments(segments)


def template_segments(render: Callable[[list[Message], bool], str], messages: Sequence[Message]) -> list[Segment]:
    """Segments of a chat-template rendering: ``render(messages, add_generation_prompt)``.

    An assistant reply is what rendering messages[:i+1] adds to rendering
    messages[:i] with the generation prompt; everything else is untrained. This
    needs a template whose renderings of successive prefixes extend each other,
    which holds for the usual ones (Llama 2/3, Mistral, ChatML, Zephyr...).
    """
    segments: list[Segment] = []
    previous = ""
    for i, message in enumerate(messages):
        full = render(list(messages[: i + 1]), False)
        if message["role"] == "assistant":
            prompt = render(list(messages[:i]), True) if i else ""
            _check_prefix(previous, prompt, i)
            _check_prefix(prompt, full, i)
            segments += [(prompt[len(previous) :], False), (full[len(prompt) :], True)]
        else:
            _check_prefix(previous, full, i)
            segments.append((full[len(previous) :], False))
        previous = full
    return merge_segments(segments)


def _check_prefix(prefix: str, text: str, index: int) -> None:
    if not text.startswith(prefix):
        # Not a property of one record (no --skip-bad-lines): the template itself cannot be cut this way.
        raise DataError(
            f"the tokenizer's chat template renders message {index} in a way that changes the text of earlier "
            "messages, so assistant tokens cannot be located; remove chat_template from the tokenizer directory "
            "to use ChatML, or use a template whose renderings of successive turns extend each other"
        )


def merge_segments(segments: Sequence[Segment]) -> list[Segment]:
    """Join neighbours with the same flag and drop empty ones (fewer tokenization boundaries)."""
    merged: list[Segment] = []
    for text, trained in segments:
        if not text:
            continue
        if merged and merged[-1][1] == trained:
            merged[-1] = (merged[-1][0] + text, trained)
        else:
            merged.append((text, trained))
    return merged


def _tokenizer_directory(tokenizer_path: str) -> str:
    return tokenizer_path if os.path.isdir(tokenizer_path) else (os.path.dirname(tokenizer_path) or ".")


def has_chat_template(tokenizer_path: str) -> bool:
    """Whether the tokenizer directory carries a chat template (tokenizer_config.json or chat_template.jinja)."""
    directory = _tokenizer_directory(tokenizer_path)
    if os.path.isfile(os.path.join(directory, "chat_template.jinja")):
        return True
    if os.path.isfile(os.path.join(directory, "chat_template.json")):
        return True
    config = os.path.join(directory, CONFIG_FILE)
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))
    return False


def _template_call(fn: Callable, *args: Any) -> Any:
    try:
        return fn(*args)
    except DataError:
        raise
    except Exception as err:  # jinja's TemplateError, or raise_exception() inside a template
        raise RecordError("chat template error", f"the chat template rejected this conversation: {err}") from err


class ChatRenderer:
    """Renders conversations as segments with the tokenizer's chat template, else ChatML."""

    def __init__(self, tokenizer_path: str) -> None:
        self.format = "chatml"
        self._hf = None
        if has_chat_template(tokenizer_path):
            try:
                import transformers
            except ImportError as err:
                raise ImportError(
                    f"{tokenizer_path} has a chat template; rendering it needs transformers: pip install transformers"
                ) from err
            self._hf = transformers.AutoTokenizer.from_pretrained(_tokenizer_directory(tokenizer_path))
            self.format = "chat template"

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        assert self._hf is not None  # set by __init__ for the chat-template format, the only one rendering here
        return str(self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt))

    def segments(self, messages: Sequence[Message]) -> list[Segment]:
        if self._hf is None:
            return chatml_segments(messages)
        return _template_call(template_segments, self._render, messages)

    def prompt_text(self, messages: Sequence[Message]) -> str:
        """The conversation rendered up to where the assistant's reply begins (with the generation prompt)."""
        if self._hf is None:
            return "".join(text for text, _ in chatml_segments(messages)) + f"{CHATML_START}assistant\n"
        return _template_call(self._render, list(messages), True)

    @property
    def end_of_turn(self) -> str | None:
        """The text that ends an assistant reply (ChatML: <|im_end|>; a template: what it renders after a reply's
        content, None if nothing)."""
        if self._hf is None:
            return CHATML_END
        probe = "llamatron reply"
        segments = self.segments([{"role": "user", "content": "?"}, {"role": "assistant", "content": probe}])
        reply = next((text for text, trained in segments if trained), "")
        return reply.rsplit(probe, 1)[-1].strip() or None


# --- Encoding records (runs in preprocess workers) ---


class ConversationEncoder:
    """Preprocess encoder for conversations: outputs tokens and the 0/1 loss mask."""

    def __init__(
        self,
        tokenizer_path: str,
        messages_key: str = "messages",
        prompt_key: str | None = None,
        response_key: str | None = None,
        system_key: str | None = None,
    ) -> None:
        if (prompt_key is None) != (response_key is None):
            raise ValueError("--prompt-key and --response-key go together")
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.renderer = ChatRenderer(tokenizer_path)
        self.keys = (messages_key, prompt_key, response_key, system_key)
        self.dtype = best_token_dtype(self.tokenizer.vocab_size)
        self.token_outputs = ("tokens",)

    def outputs(self, output_prefix: str) -> dict[str, tuple[str, np.dtype]]:
        prefix = sft_output_prefix(output_prefix)
        return {"tokens": (prefix, self.dtype), "mask": (mask_prefix(prefix), np.dtype(np.uint8))}

    def encode(self, records: list[dict]) -> list[list[np.ndarray] | RecordError]:
        results: list[Any] = []
        texts: list[str] = []
        for record in records:
            try:
                segments = self.renderer.segments(conversation_from_record(record, *self.keys))
                results.append(segments)
                texts.extend(text for text, _ in segments)
            except RecordError as err:
                results.append(err)
        ids = iter(self.tokenizer.encode_batch(texts)) if texts else iter(())
        out: list[Any] = []
        for result in results:
            if isinstance(result, RecordError):
                out.append(result)
                continue
            pieces = [(next(ids), trained) for _, trained in result]
            tokens = np.fromiter((t for piece, _ in pieces for t in piece), dtype=self.dtype)
            mask = np.concatenate([np.full(len(piece), trained, dtype=np.uint8) for piece, trained in pieces])
            out.append([tokens, mask])
        return out


def preprocess_conversations(
    inputs: str | Sequence[str],
    output_prefix: str,
    tokenizer_path: str,
    messages_key: str = "messages",
    prompt_key: str | None = None,
    response_key: str | None = None,
    system_key: str | None = None,
    workers: int = 1,
    skip_bad_lines: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize conversations into ``{output_prefix}_sft`` (+ ``_mask``); return the preprocess summary
    with ``trained_tokens`` (tokens under the loss mask) and ``chat_format`` added."""
    make_encoder = (ConversationEncoder, (tokenizer_path, messages_key, prompt_key, response_key, system_key))
    summary = run_encoder(inputs, output_prefix, make_encoder, workers, skip_bad_lines, progress)
    mask_file = data_path(summary["outputs"]["mask"])
    summary["trained_tokens"] = _count_ones(mask_file)
    summary["chat_format"] = "chat template" if has_chat_template(tokenizer_path) else "chatml"
    summary["notes"] = {
        "chat format": summary["chat_format"],
        "assistant (trained) tokens": f"{summary['trained_tokens']} of {summary['tokens']}",
        "train with": f"--sft-data {summary['outputs']['tokens']}",
    }
    return summary


def _count_ones(path: str, chunk_bytes: int = 64 << 20) -> int:
    total = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            total += int(np.frombuffer(chunk, dtype=np.uint8).sum(dtype=np.int64))
    return total
