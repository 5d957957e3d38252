"""A Llama 3 (tiktoken) tokenizer as the Hugging Face files transformers loads: export-hf ships these.

tokenizer.json is a byte-level BPE built from the ranks by transformers' own tiktoken converter
(`TikTokenConverter`: the vocabulary from the token bytes, merges derived from the ranks, Llama 3's split as
the pre-tokenizer), with the special tokens at their ids and `<|begin_of_text|>` prepended as Meta's Hugging
Face release does. tokenizer_config.json names bos/eos and carries the Llama 3 chat template
(`data/sft.py`'s format, so a chat rendered by transformers is the text llamatron trained on).
"""

from __future__ import annotations

import json
from typing import Any

from ..data.sft import LLAMA3, chat_template
from ..data.tokenizer import CONFIG_FILE, TiktokenTokenizer
from ..errors import HFConversionError

# Encoded by both tokenizers once the conversion is done: a converter that drifted from tiktoken fails here,
# not silently in a published model. Spaces, newlines, digits, case-folded contractions, several scripts,
# an emoji and special tokens.
_PROBE = (
    "<|begin_of_text|>Hello, world! I'M here; it's 12345 o'clock.\n\n  Indented\ttabs\r\n"
    "Ünïcödé, 日本語のテキスト, émoji 🦙🦙.<|eot_id|> trailing   "
)


def hf_tokenizer_files(tokenizer: TiktokenTokenizer) -> dict[str, str]:
    """The contents of tokenizer.json, tokenizer_config.json and special_tokens_map.json for `tokenizer`."""
    backend = _converted(tokenizer)
    bos, eos = _named_token(tokenizer, tokenizer.bos_id), _named_token(tokenizer, tokenizer.eod_id)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "clean_up_tokenization_spaces": False,  # decode gives back the text as tiktoken does
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": chat_template(LLAMA3),
    }
    special_map = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    return {
        "tokenizer.json": backend.to_str(pretty=True),
        CONFIG_FILE: json.dumps({k: v for k, v in config.items() if v is not None}, indent=2, ensure_ascii=False),
        "special_tokens_map.json": json.dumps(special_map, indent=2, ensure_ascii=False),
    }


def _named_token(tokenizer: TiktokenTokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.decode([token_id])


def _converted(tokenizer: TiktokenTokenizer) -> Any:
    try:
        from tokenizers import AddedToken, processors
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        raise HFConversionError(
            f"{tokenizer.source} is a Llama 3 (tiktoken) tokenizer; exporting it as tokenizer.json needs "
            "transformers (its tiktoken converter): pip install transformers"
        ) from None

    ranks = tokenizer.ranks

    class _FromRanks(TikTokenConverter):
        """The converter, given the ranks already read (and checked) by data/tokenizer.py."""

        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    backend = _FromRanks(vocab_file=tokenizer.source, pattern=tokenizer.pattern).converted()
    specials = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text, _ in specials])
    wrong = [(text, i, backend.token_to_id(text)) for text, i in specials if backend.token_to_id(text) != i]
    if wrong or backend.get_vocab_size(with_added_tokens=True) != tokenizer.vocab_size:
        raise HFConversionError(
            f"{tokenizer.source}: the Hugging Face tokenizer built from it numbers its tokens differently "
            f"(first: {wrong[:1]}, {backend.get_vocab_size(with_added_tokens=True)} tokens, tiktoken "
            f"{tokenizer.vocab_size}); are the BPE ranks consecutive from 0?"
        )
    if tokenizer.bos_id is not None:
        bos = _named_token(tokenizer, tokenizer.bos_id)
        backend.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tokenizer.bos_id)]
                ),
            ]
        )
    expected = tokenizer.encode(_PROBE)
    if backend.encode(_PROBE, add_special_tokens=False).ids != expected:
        raise HFConversionError(
            f"{tokenizer.source}: transformers' tiktoken converter gives other token ids than tiktoken on a test "
            "text; upgrade transformers and tokenizers (pip install -U transformers tokenizers)"
        )
    return backend


__all__ = ["hf_tokenizer_files"]
