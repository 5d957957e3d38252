"""A small Llama 3-style tokenizer.model (tiktoken BPE ranks), built for the tests that load one."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import tokenizers
from tokenizers import pre_tokenizers

from llamatron.data.tokenizer import LLAMA3_PATTERN

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock, isn't it?",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé text, émoji 🦙 and\ttabs; 日本語のテキスト.",
    "You are terse. Name a colour. Blue. Another one? Green, obviously.",
]


def write_tiktoken_model(directory: Path, vocab_size: int = 360) -> Path:
    """`directory/tokenizer.model`: the 256 single bytes (ranks 0-255), then the merges of a byte-level BPE
    that `tokenizers` trains on TEXTS with Llama 3's split, each merged token ranked by when it was made."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # byte-level BPE's byte <-> character map

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(LLAMA3_PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(TEXTS * 10, trainer=trainer)
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(backend.to_str())["model"]["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        ranks.setdefault(bytes(byte_of[c] for c in left + right), len(ranks))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.model"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    return path
