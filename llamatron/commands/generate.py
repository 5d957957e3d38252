"""`llamatron generate`: sample text from a checkpoint (one process)."""

from __future__ import annotations

import argparse
import math
import os

from ..checkpoint import read_meta
from ..config_ranges import SEED, number_arg
from ..data.tokenizer import load_tokenizer
from ..errors import ConfigError
from ..generate import load_for_generation, sample


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("--load", required=True, help="checkpoint directory (DIR or DIR/step-N)")
    p.add_argument(
        "--prompt",
        default="",
        help="text to continue (may be empty only when the tokenizer has a "
        "beginning-of-sequence token: sampling then starts from it)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the one recorded in the checkpoint)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to sample (default: 100)")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0: greedy (default: 0.8)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=50,
        help="sample among the k likeliest tokens (default: 50)",
    )
    p.add_argument("--seed", type=number_arg(int, SEED), default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.set_defaults(func=cmd_generate)


def _check_sampling_args(args: argparse.Namespace) -> None:
    if not 0 <= args.temperature < math.inf:  # also NaN
        raise ConfigError(f"--temperature {args.temperature}: must be >= 0 (0: greedy) and finite")
    if args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: must be >= 1 (1: always the likeliest token)")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")


def cmd_generate(args: argparse.Namespace) -> int:
    _check_sampling_args(args)
    meta = read_meta(args.load)  # tokenizer and prompt are checked before the weights are read
    tokenizer = args.tokenizer or meta.get("tokenizer") or (meta.get("config") or {}).get("data", {}).get("tokenizer")
    if tokenizer is None:
        raise ConfigError(
            f"checkpoint {args.load} records no tokenizer (trained on --mock-data?); pass --tokenizer PATH"
        )
    if not os.path.exists(tokenizer):
        raise ConfigError(f"tokenizer {tokenizer} (recorded in the checkpoint) not found; pass --tokenizer PATH")
    tok = load_tokenizer(tokenizer)
    vocab_size = meta["model_config"]["vocab_size"]
    if tok.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer} has {tok.vocab_size} tokens but the model only "
            f"{vocab_size}: it is not this model's tokenizer"
        )
    prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        if tok.bos_id is None:
            raise ConfigError(
                f"--prompt is empty and tokenizer {tokenizer} has no beginning-of-sequence token to "
                f"start from; give --prompt TEXT"
            )
        prompt_ids = [tok.bos_id]  # as transformers' generate does without input
    model, _ = load_for_generation(args.load, args.device)
    ids = sample(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + tok.decode(ids))
    return 0
