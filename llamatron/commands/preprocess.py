"""`llamatron preprocess`: jsonl/parquet (text or conversations) -> Megatron-format .bin/.idx."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config.output_paths import check_output_prefix
from ..data.preference import preprocess_preferences
from ..data.preprocess import format_summary, preprocess
from ..data.sft import preprocess_conversations
from ..errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser(
        "preprocess", help="tokenize jsonl/parquet (text or conversations) into Megatron-format .bin/.idx"
    )
    add_preprocess_arguments(p)
    p.set_defaults(func=lambda a: run_preprocess(a) and 0)  # the summary is printed, not an exit status


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``llamatron preprocess`` flags on ``parser``."""
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help=".jsonl, .jsonl.gz, .jsonl.zst or .parquet files, globs (quote them) or directories",
    )
    parser.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX_{key}_document.bin/.idx (with --sft: PREFIX_sft and PREFIX_sft_mask)",
    )
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="Hugging Face directory, tokenizer.json, or tokenizer.model (SentencePiece, or Llama 3's tiktoken ranks)",
    )
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="JSON keys to tokenize, one output dataset each (default: text)",
    )
    parser.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the tokenizer's EOS token to every document (default: on)",
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip and count unusable records (malformed JSON, missing key, empty document) instead of failing",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    sft = parser.add_argument_group(
        "instruction tuning (--sft)",
        description="Each conversation is rendered with the tokenizer's chat template when its directory has one "
        "(tokenizer_config.json chat_template, chat_template.jinja); else in Llama 3's format when the tokenizer "
        "has Llama 3's chat tokens (Meta's tokenizer.model, a Hugging Face Llama 3 tokenizer): <|begin_of_text|>, "
        "then per message <|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>; else as ChatML, per "
        "message <|im_start|>ROLE\\nCONTENT<|im_end|>\\n (a warning says when <|im_start|>/<|im_end|> are not "
        "special tokens of the tokenizer and so are split into ordinary tokens). The loss mask covers each "
        "assistant reply and its end-of-turn marker.",
    )
    sft.add_argument(
        "--sft", action="store_true", help="records are conversations: store tokens and an assistant-only loss mask"
    )
    sft.add_argument(
        "--messages-key", default="messages", help="key of the list of {role, content} messages (default: messages)"
    )
    sft.add_argument("--prompt-key", default=None, help="instead of messages: key of a user prompt")
    sft.add_argument("--response-key", default=None, help="with --prompt-key: key of the assistant response")
    sft.add_argument("--system-key", default=None, help="with --prompt-key: optional key of a system prompt")
    preference = parser.add_argument_group(
        "preference pairs (--preference)",
        description='Each record holds a prompt ("prompt": a string or a list of messages, or "messages") and '
        'two responses, "chosen" and "rejected" (a string or a list of assistant messages), TRL\'s preference '
        "format. Each response follows the prompt, rendered as for --sft; the loss mask covers the response only.",
    )
    preference.add_argument(
        "--preference",
        action="store_true",
        help="records are preference pairs: writes PREFIX_pref_chosen, PREFIX_pref_rejected and their _mask "
        "(train with --objective dpo --preference-data PREFIX_pref)",
    )
    return parser


def run_preprocess(args: argparse.Namespace) -> dict[str, Any]:
    progress = not getattr(args, "no_progress", False)
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: need at least 1 tokenizer process (default: 1)")
    if getattr(args, "preference", False) and getattr(args, "sft", False):
        raise ConfigError("--preference and --sft are two kinds of records: give one")
    check_output_prefix(args.output_prefix, "--output-prefix")  # before the tokenizer loads and the input is read
    if getattr(args, "preference", False):
        summary = preprocess_preferences(
            args.input,
            args.output_prefix,
            args.tokenizer,
            workers=args.workers,
            skip_bad_lines=args.skip_bad_lines,
            progress=progress,
        )
    elif getattr(args, "sft", False):
        summary = preprocess_conversations(
            args.input,
            args.output_prefix,
            args.tokenizer,
            messages_key=args.messages_key,
            prompt_key=args.prompt_key,
            response_key=args.response_key,
            system_key=args.system_key,
            workers=args.workers,
            skip_bad_lines=args.skip_bad_lines,
            progress=progress,
        )
    else:
        summary = preprocess(
            args.input,
            args.output_prefix,
            args.tokenizer,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            skip_bad_lines=args.skip_bad_lines,
            progress=progress,
        )
    print(format_summary(summary), file=sys.stderr)
    return summary
