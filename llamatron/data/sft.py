"""Instruction data: conversations -> tokens plus an assistant-only loss mask.

A record is a conversation: a ``messages`` list of ``{"role", "content"}``
(roles system, user, assistant; any number of turns), or a prompt/response
pair (``--prompt-key/--response-key``, optional ``--system-key``).

It is rendered (``ChatRenderer``) with the tokenizer's chat template when the
tokenizer directory has one (through transformers' ``apply_chat_template``),
else in Llama 3's format when the tokenizer has Llama 3's chat tokens
(``<|begin_of_text|>``, then per message
``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>``), else as
ChatML (per message ``<|im_start|>{role}\\n{content}<|im_end|>\\n``). The
rendering is cut into segments that are trained (an assistant reply and its
end-of-turn marker) or not (everything else), each segment is tokenized, and
the loss mask is 1 exactly on the tokens of trained segments.

Stored layout (``preprocess --sft --output-prefix OUT``):

    OUT_sft.bin/.idx        tokens, one document per conversation (a normal indexed dataset)
    OUT_sft_mask.bin/.idx   uint8 0/1 per token, same sizes: 1 = the model is trained to predict it

Train on it with ``llamatron train --sft-data OUT_sft`` (see sft_dataset.py).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llamatron.data.indexed import best_token_dtype, data_path
from llamatron.data.preprocess import RecordError, run_encoder
from llamatron.data.tokenizer import CONFIG_FILE, Tokenizer, load_tokenizer
from llamatron.errors import DataError, MissingPackageError

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
            raise RecordError(
                "missing key",
                f"missing key {messages_key!r} (records of a prompt and a response: name their keys with "
                "--prompt-key/--response-key; a list of messages under another key: --messages-key)",
            )
        messages = checked_messages(record[messages_key], messages_key, "message {i}")
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and not message["content"]:
            raise RecordError("empty document", f"empty document: assistant message {i} is empty")
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no assistant message", "conversation has no assistant message to train on")
    return messages


def checked_messages(raw: Any, key: str, label: str) -> list[Message]:
    """The messages of a record's ``key``, a non-empty list of ``{"role", "content"}`` (``label``: how an error
    names message ``{i}``), or RecordError saying what is wrong."""
    if not isinstance(raw, list) or not raw:
        raise RecordError("bad conversation", f"key {key!r} must be a non-empty list of messages")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RecordError("bad conversation", f"{label.format(i=i)} needs a role in {ROLES}: {str(message)[:80]}")
        if not isinstance(message.get("content"), str):
            raise RecordError("bad conversation", f"{label.format(i=i)} ({message['role']}) has no string content")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


# --- Rendering ---


@dataclass(frozen=True)
class ChatFormat:
    """A chat format llamatron renders itself: the text around each message.

    A conversation is ``begin``, then per message ``header`` (``{role}`` filled in), the content,
    ``end_of_turn`` and ``after_turn``; the generation prompt is the assistant's header. ``markers`` are the
    texts the format expects to be special tokens of the tokenizer.
    """

    name: str
    begin: str
    header: str
    end_of_turn: str
    after_turn: str
    markers: tuple[str, ...]

    def role_header(self, role: str) -> str:
        return self.header.replace("{role}", role)


CHATML = ChatFormat("chatml", "", CHATML_START + "{role}\n", CHATML_END, "\n", (CHATML_START, CHATML_END))
# Meta's Llama 3 (3.1, 3.2, 3.3) dialog format, as its reference chat_format encodes it (content as it is).
LLAMA3 = ChatFormat(
    "llama3",
    "<|begin_of_text|>",
    "<|start_header_id|>{role}<|end_header_id|>\n\n",
    "<|eot_id|>",
    "",
    ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
)
CHAT_FORMATS = {f.name: f for f in (CHATML, LLAMA3)}


def format_segments(fmt: ChatFormat, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[Segment]:
    """Segments of ``messages`` in ``fmt``: trained are each assistant content and its end-of-turn marker;
    ``add_generation_prompt`` ends with the assistant's header (untrained), for the model to continue."""
    segments: list[Segment] = [(fmt.begin, False)]
    for message in messages:
        header = fmt.role_header(message["role"])
        if message["role"] == "assistant":
            segments += [(header, False), (message["content"] + fmt.end_of_turn, True), (fmt.after_turn, False)]
        else:
            segments.append((header + message["content"] + fmt.end_of_turn + fmt.after_turn, False))
    if add_generation_prompt:
        segments.append((fmt.role_header("assistant"), False))
    return merge_segments(segments)


def chat_template(fmt: ChatFormat) -> str:
    """``fmt`` as a Jinja chat template (tokenizer_config.json): transformers' apply_chat_template then renders
    exactly the text of ``format_segments``."""
    q = json.dumps  # a JSON string is a Jinja string literal
    prefix, _, suffix = fmt.header.partition("{role}")
    turn = f"{q(prefix)} + message['role'] + {q(suffix)} + message['content'] + {q(fmt.end_of_turn + fmt.after_turn)}"
    return (
        f"{{{{ {q(fmt.begin)} }}}}{{% for message in messages %}}{{{{ {turn} }}}}{{% endfor %}}"
        f"{{% if add_generation_prompt %}}{{{{ {q(fmt.role_header('assistant'))} }}}}{{% endif %}}"
    )


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
            "to use llamatron's own format (Llama 3's or ChatML), or use a template whose renderings of "
            "successive turns extend each other"
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


def single_token_id(tokenizer: Tokenizer, text: str) -> int | None:
    """The id of ``text`` when the tokenizer encodes it as one token (a special token), else None."""
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else None


def builtin_format(tokenizer: Tokenizer) -> ChatFormat:
    """Llama 3's format for a tokenizer with Llama 3's chat tokens (Meta's tokenizer.model, or a Hugging Face
    Llama 3 tokenizer without a template), else ChatML."""
    llama3 = all(single_token_id(tokenizer, marker) is not None for marker in LLAMA3.markers)
    return LLAMA3 if llama3 else CHATML


class ChatRenderer:
    """How conversations become text for one tokenizer; ``format`` says which way:

    - ``"chat template"``: the tokenizer directory's own template (transformers' ``apply_chat_template``);
    - ``"llama3"``: Llama 3's format, for a tokenizer with its chat tokens (<|start_header_id|>, <|eot_id|>...);
    - ``"chatml"``: ChatML, the fallback; ``missing_markers`` lists those of its markers the tokenizer
      lacks as special tokens (they are then tokenized as ordinary text).

    API (SFT preprocessing and ``generate --chat`` use the same renderer):

    - ``segments(messages, add_generation_prompt=False)``: ``[(text, trained)]`` whose texts joined are the
      rendering; trained are the assistant replies and their end-of-turn marker. With
      ``add_generation_prompt`` it ends with the opening of an assistant turn.
    - ``prompt(messages)``: the text for a model to continue as the assistant (messages ending with a user
      turn): the rendering followed by the generation prompt.
    - ``end_of_turn``: the text that closes an assistant turn (``<|eot_id|>``, ``<|im_end|>``; a template's:
      what it writes after a reply, else the tokenizer's EOS token), where sampling a reply stops;
      ``end_of_turn_id``: its token id, None when the tokenizer does not have it as one token (ChatML's markers on a
      plain BPE: then stop when the decoded text ends with ``end_of_turn``).
    """

    def __init__(self, tokenizer_path: str, tokenizer: Tokenizer | None = None) -> None:
        tokenizer = tokenizer or load_tokenizer(tokenizer_path)
        self._hf = None
        self._builtin: ChatFormat | None = None
        if has_chat_template(tokenizer_path):
            try:
                import transformers
            except ImportError as err:
                raise MissingPackageError(
                    f"{tokenizer_path} has a chat template; rendering it needs transformers: pip install transformers"
                ) from err
            self._hf = transformers.AutoTokenizer.from_pretrained(_tokenizer_directory(tokenizer_path))
            self.format = "chat template"
            self.end_of_turn: str = self._template_end_of_turn() or str(self._hf.eos_token or "")
            self.end_of_turn_id: int | None = single_token_id(tokenizer, self.end_of_turn) if self.end_of_turn else None
        else:
            self._builtin = builtin_format(tokenizer)
            self.format = self._builtin.name
            self.end_of_turn = self._builtin.end_of_turn
            self.end_of_turn_id = single_token_id(tokenizer, self.end_of_turn)
        markers = self._builtin.markers if self._builtin is not None else ()
        self.missing_markers = [m for m in markers if single_token_id(tokenizer, m) is None]

    def _template_end_of_turn(self) -> str | None:
        """What the template writes after an assistant reply's content (Llama 3 Instruct's <|eot_id|>, Llama 2's
        </s>), found by rendering a probe reply; None if nothing or the template rejects the probe."""
        probe = "llamatron reply"
        try:
            segments = self.segments([{"role": "user", "content": "?"}, {"role": "assistant", "content": probe}])
        except (DataError, RecordError):
            return None
        reply = next((text for text, trained in segments if trained), "")
        return reply.rsplit(probe, 1)[-1].strip() or None

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        assert self._hf is not None  # set by __init__ for the chat-template format, the only one rendering here
        return str(self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt))

    def segments(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[Segment]:
        if self._builtin is not None:
            return format_segments(self._builtin, messages, add_generation_prompt)
        try:
            segments = template_segments(self._render, messages)
            if add_generation_prompt:
                full, prompt = self._render(list(messages), False), self._render(list(messages), True)
                _check_prefix(full, prompt, len(messages))
                segments = merge_segments([*segments, (prompt[len(full) :], False)])
            return segments
        except DataError:
            raise
        except Exception as err:  # jinja's TemplateError, or raise_exception() inside a template
            raise RecordError("chat template error", f"the chat template rejected this conversation: {err}") from err

    def prompt(self, messages: Sequence[Message]) -> str:
        return "".join(text for text, _ in self.segments(messages, add_generation_prompt=True))

    def missing_markers_warning(self, tokenizer_path: str) -> str | None:
        """One line saying that the format's markers are no special tokens of the tokenizer, and the fix."""
        if not self.missing_markers:
            return None
        return (
            f"warning: tokenizer {tokenizer_path} has no special tokens for {self.format}'s "
            f"{', '.join(self.missing_markers)}: they are split into ordinary tokens (the model learns them as "
            "text); to avoid it, use a tokenizer with a chat template (tokenizer_config.json chat_template) or "
            "one that has these markers as special tokens, within the model's vocabulary"
        )


# --- Encoding records (runs in preprocess workers) ---


def tokens_and_mask(pieces: Sequence[tuple[Sequence[int], bool]], dtype: np.dtype) -> list[np.ndarray]:
    """[tokens, 0/1 loss mask] of tokenized segments (ids, trained), joined."""
    tokens = np.fromiter((t for piece, _ in pieces for t in piece), dtype=dtype)
    mask = np.concatenate([np.full(len(piece), trained, dtype=np.uint8) for piece, trained in pieces])
    return [tokens, mask]


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
        self.renderer = ChatRenderer(tokenizer_path, self.tokenizer)
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
            out.append(tokens_and_mask([(next(ids), trained) for _, trained in result], self.dtype))
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
    renderer = ChatRenderer(tokenizer_path)  # in this process: the workers' would warn once each
    warning = renderer.missing_markers_warning(tokenizer_path)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    make_encoder = (ConversationEncoder, (tokenizer_path, messages_key, prompt_key, response_key, system_key))
    summary = run_encoder(inputs, output_prefix, make_encoder, workers, skip_bad_lines, progress)
    mask_file = data_path(summary["outputs"]["mask"])
    summary["trained_tokens"] = _count_ones(mask_file)
    summary["chat_format"] = renderer.format
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
