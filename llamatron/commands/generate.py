"""`llamatron generate`: sample text from a checkpoint saved under any layout; one process, or tensor-parallel
ranks under `torchrun --nproc-per-node N -m llamatron generate --tp N`."""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

from ..checkpoint import read_meta
from ..config.ranges import SEED, number_arg
from ..data.preprocess import RecordError
from ..data.sft import ChatRenderer
from ..data.tokenizer import Tokenizer, load_tokenizer
from ..dtypes import DTYPES
from ..errors import ConfigError, DataError
from ..inference.generate import StopStrings, load_for_generation, sample
from ..parallel.mesh import Mesh, build_mesh, init_distributed
from ..training.validate import resolve_device


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a checkpoint",
        description="Sample text from a checkpoint saved under any layout. One process, or tensor-parallel: "
        "torchrun --nproc-per-node N -m llamatron generate --tp N ...",
    )
    p.add_argument("--load", required=True, help="checkpoint directory (DIR or DIR/step-N)")
    p.add_argument(
        "--prompt",
        default="",
        help="text to continue (may be empty only when the tokenizer has a "
        "beginning-of-sequence token: sampling then starts from it); with --chat: the user's message",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="render --prompt as a user message in the SFT chat format (the tokenizer's chat template, else "
        "ChatML), sample the assistant's reply, stop at the format's end of turn",
    )
    p.add_argument("--system", default=None, help="with --chat: a system message before the user's")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="stop once the output holds STR, and cut it there (repeatable); the tokenizer's end-of-sequence "
        "token always stops",
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
    p.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto (default): cuda when available"
    )
    p.add_argument(
        "--precision", default="auto", choices=("auto", *DTYPES), help="weights' dtype (auto: bf16 on GPU, fp32 on CPU)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (launch as many with torchrun)")
    p.add_argument(
        "--no-kv-cache",
        dest="kv_cache",
        action="store_false",
        help="recompute the whole sequence for every token (the reference the KV cache is tested against)",
    )
    p.set_defaults(func=cmd_generate)


def _check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.temperature < math.inf:  # also NaN
        raise ConfigError(f"--temperature {args.temperature}: must be >= 0 (0: greedy) and finite")
    if args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: must be >= 1 (1: always the likeliest token)")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if args.system is not None and not args.chat:
        raise ConfigError("--system is a chat message: add --chat")
    if "" in args.stop:
        raise ConfigError("--stop '': an empty stop string would stop before the first token; give a text")
    texts = [("--prompt", args.prompt), ("--system", args.system)] + [("--stop", s) for s in args.stop]
    for flag, text in texts:
        if text is None:
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a byte of the command line that is not UTF-8 (a lone surrogate here)
            raise ConfigError(f"{flag} holds bytes that are not UTF-8 (character {e.start}); give UTF-8 text") from None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp < 1 or world != args.tp:
        raise ConfigError(
            f"--tp {args.tp} with {world} process(es): generate runs one process per tensor-parallel rank; "
            f"launch `torchrun --nproc-per-node {max(args.tp, 1)} -m llamatron generate --tp {max(args.tp, 1)} ...`"
        )


def _tokenizer(args: argparse.Namespace) -> tuple[Tokenizer, str]:
    meta = read_meta(args.load)  # tokenizer and prompt are checked before the weights are read
    path = args.tokenizer or meta.get("tokenizer") or (meta.get("config") or {}).get("data", {}).get("tokenizer")
    if path is None:
        raise ConfigError(
            f"checkpoint {args.load} records no tokenizer (trained on --mock-data?); pass --tokenizer PATH"
        )
    if not os.path.exists(path):
        raise ConfigError(f"tokenizer {path} (recorded in the checkpoint) not found; pass --tokenizer PATH")
    tok = load_tokenizer(path)
    vocab_size = meta["model_config"]["vocab_size"]
    if tok.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {path} has {tok.vocab_size} tokens but the model only {vocab_size}: "
            "it is not this model's tokenizer"
        )
    return tok, path


def _prompt_and_stops(args: argparse.Namespace, tok: Tokenizer, path: str) -> tuple[list[int], set[int], list[str]]:
    """The prompt's token ids, the ids that stop (EOS; the chat format's end of turn where it is one token) and
    the stop strings (--stop; the end of turn where it is several tokens)."""
    stop_ids = {tok.eod_id} if tok.eod_id is not None else set()
    stop_strings = list(args.stop)
    if args.chat:
        renderer = ChatRenderer(path)
        warning = renderer.missing_markers_warning(path)
        if warning:  # the model can hardly have learnt a format its tokenizer cannot even spell as tokens
            print(warning, file=sys.stderr, flush=True)
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        try:
            prompt_ids = tok.encode(renderer.prompt([*messages, {"role": "user", "content": args.prompt}]))
        except RecordError as err:
            raise DataError(f"--chat with tokenizer {path}: {err}") from None
        if renderer.end_of_turn_id is not None:
            stop_ids.add(renderer.end_of_turn_id)
        elif renderer.end_of_turn:
            stop_strings.append(renderer.end_of_turn)
        return prompt_ids, stop_ids, stop_strings
    prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        if tok.bos_id is None:
            raise ConfigError(
                f"--prompt is empty and tokenizer {path} has no beginning-of-sequence token to start from; "
                f"give --prompt TEXT"
            )
        prompt_ids = [tok.bos_id]  # as transformers' generate does without input
    return prompt_ids, stop_ids, stop_strings


def _mesh(tp: int, device: str) -> Mesh | None:
    if tp == 1:
        return None
    init_distributed(device)
    return build_mesh(tp=tp)


def cmd_generate(args: argparse.Namespace) -> int:
    _check_args(args)
    device, dtype_name = resolve_device(args.device, args.precision, torch.cuda.is_available())
    tok, path = _tokenizer(args)
    prompt_ids, stop_ids, stop_strings = _prompt_and_stops(args, tok, path)
    stops = StopStrings(tok.decode, stop_strings) if stop_strings else None
    mesh = _mesh(args.tp, device)
    try:
        if mesh is not None and device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        model, _ = load_for_generation(args.load, device, DTYPES[dtype_name], mesh)
        ids = sample(
            model,
            prompt_ids,
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            args.seed,
            stop_ids=stop_ids,
            stop=stops,
            use_cache=args.kv_cache,
        )
    finally:
        if mesh is not None:
            dist.destroy_process_group()
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    text = tok.decode(ids)
    if stops is not None:
        text = stops.cut(text)
    if mesh is None or mesh.rank == 0:
        print(text if args.chat else args.prompt + text)
    return 0
