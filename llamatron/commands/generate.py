"""`llamatron generate`: text from a checkpoint saved under any layout, for one prompt or a batch of them (decoded
together: inference/decode.py); one process, or tensor-parallel ranks under
`torchrun --nproc-per-node N -m llamatron generate --tp N`."""

from __future__ import annotations

import argparse
import json
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
from ..inference.generate import StopStrings, generate_batch, load_for_generation, sample
from ..inference.sampling import Sampling
from ..inference.stops import eos_ids_of
from ..parallel.layout import LayoutChoice
from ..parallel.mesh import Mesh, build_mesh, init_distributed
from ..training.validate import resolve_device


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a checkpoint",
        description="Sample text from a checkpoint saved under any layout, for one prompt or many decoded together. "
        "One process, or tensor-parallel: torchrun --nproc-per-node N -m llamatron generate --tp N ...",
    )
    p.add_argument("--load", required=True, help="checkpoint directory (DIR or DIR/step-N)")
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="text to continue (repeatable: the prompts are decoded together, and each result is printed as a JSON "
        "line); may be empty only when the tokenizer has a beginning-of-sequence token: sampling then starts from "
        "it (the default, with no --prompt); with --chat: the user's message",
    )
    p.add_argument(
        "--prompts-file",
        default=None,
        metavar="FILE.jsonl",
        help='prompts, one a line: a JSON string or an object with a "prompt" string (after any --prompt)',
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="prompts decoded together, at most (default: 32); more run in several batches",
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
        "token and those of an imported generation_config.json always stop",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the one recorded in the checkpoint)")
    _add_sampling_flags(p)
    p.add_argument("--seed", type=number_arg(int, SEED), default=0, help="sampling seed (default: 0)")
    p.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto (default): cuda when available"
    )
    p.add_argument(
        "--precision", default="auto", choices=("auto", *DTYPES), help="weights' dtype (auto: bf16 on GPU, fp32 on CPU)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (launch as many with torchrun)")
    p.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_false",
        help="on GPU, run each decoding step eagerly instead of replaying its captured CUDA graph",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decoding step before its CUDA graph is captured (fewer, fused kernels; "
        "compiling takes a minute)",
    )
    p.add_argument(
        "--no-kv-cache",
        dest="kv_cache",
        action="store_false",
        help="recompute the whole sequence for every token, one prompt at a time (the reference the KV cache is "
        "tested against)",
    )
    p.set_defaults(func=cmd_generate)


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to sample (default: 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0: greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (default: 50)")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the likeliest tokens that together hold probability p, in (0, 1] (default: 1, no cut)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide the logit of a token already in the prompt or output by this (multiply where negative), as "
        "transformers does; > 1 repeats less (default: 1, none)",
    )


def _sampling(args: argparse.Namespace) -> Sampling:
    return Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty)


def _check_args(args: argparse.Namespace) -> None:
    problems = _sampling(args).problems(flags=True)
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if args.batch_size < 1:
        problems.append(f"--batch-size {args.batch_size}: must be >= 1")
    if problems:
        raise ConfigError("; ".join(problems))
    if args.system is not None and not args.chat:
        raise ConfigError("--system is a chat message: add --chat")
    if "" in args.stop:
        raise ConfigError("--stop '': an empty stop string would stop before the first token; give a text")
    texts = [("--prompt", p) for p in args.prompt or []] + [("--system", args.system)]
    for flag, text in texts + [("--stop", s) for s in args.stop]:
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


def _read_prompts_file(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--prompts-file {path} cannot be read ({e}); give a UTF-8 JSON-lines file") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        if isinstance(value, dict):
            value = value.get("prompt")
        if not isinstance(value, str):
            raise DataError(
                f'--prompts-file {path}, line {number}: not a JSON string or an object with a "prompt" string'
            )
        prompts.append(value)
    if not prompts:
        raise DataError(f"--prompts-file {path} holds no prompts; give one JSON string per line")
    return prompts


def _prompt_texts(args: argparse.Namespace) -> list[str]:
    texts = list(args.prompt or [])
    if args.prompts_file is not None:
        texts += _read_prompts_file(args.prompts_file)
    return texts if texts or args.prompts_file is not None else [""]  # no prompt given: start from BOS


def _tokenizer(args: argparse.Namespace, meta: dict) -> tuple[Tokenizer, str]:
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


def _encode(args: argparse.Namespace, text: str, tok: Tokenizer, path: str, renderer: ChatRenderer | None) -> list[int]:
    if renderer is not None:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        try:
            return tok.encode(renderer.prompt([*messages, {"role": "user", "content": text}]))
        except RecordError as err:
            raise DataError(f"--chat with tokenizer {path}: {err}") from None
    ids = tok.encode(text)
    if ids:
        return ids
    if tok.bos_id is None:
        raise ConfigError(
            f"--prompt is empty and tokenizer {path} has no beginning-of-sequence token to start from; "
            f"give --prompt TEXT"
        )
    return [tok.bos_id]  # as transformers' generate does without input


def _prompts_and_stops(
    args: argparse.Namespace, texts: list[str], tok: Tokenizer, path: str, meta: dict
) -> tuple[list[list[int]], set[int], list[str]]:
    """The prompts' token ids, the ids that stop (the tokenizer's EOS, an imported generation_config.json's
    eos_token_id list, the chat format's end of turn where it is one token) and the stop strings (--stop; the end
    of turn where it is several tokens)."""
    stop_ids = ({tok.eod_id} if tok.eod_id is not None else set()) | eos_ids_of(meta)
    stop_strings = list(args.stop)
    renderer = None
    if args.chat:
        renderer = ChatRenderer(path)
        warning = renderer.missing_markers_warning(path)
        if warning:  # the model can hardly have learnt a format its tokenizer cannot even spell as tokens
            print(warning, file=sys.stderr, flush=True)
        if renderer.end_of_turn_id is not None:
            stop_ids.add(renderer.end_of_turn_id)
        elif renderer.end_of_turn:
            stop_strings.append(renderer.end_of_turn)
    prompts = [_encode(args, text, tok, path, renderer) for text in texts]
    context = meta["model_config"]["max_seq_length"]
    longest = max(len(p) for p in prompts)
    if args.kv_cache and longest + args.max_new_tokens > context:
        raise ConfigError(
            f"--max-new-tokens {args.max_new_tokens} after a prompt of {longest} tokens passes the model's context "
            f"of {context} tokens; give at most {max(context - longest, 0)} (or a shorter prompt)"
        )
    return prompts, stop_ids, stop_strings


def _mesh(tp: int, device: str) -> Mesh | None:
    if tp == 1:
        return None
    init_distributed(device)
    return build_mesh(LayoutChoice(tp=tp))


def _generate(args: argparse.Namespace, model, prompts: list[list[int]], stop_ids: set[int], stops) -> list[list[int]]:
    sampling = _sampling(args)
    if not args.kv_cache:  # the reference: one prompt at a time, the whole sequence recomputed per token
        a = args
        return [
            sample(
                model,
                p,
                a.max_new_tokens,
                a.temperature,
                a.top_k,
                a.seed,
                stop_ids,
                stops,
                use_cache=False,
                top_p=a.top_p,
                repetition_penalty=a.repetition_penalty,
            )
            for p in prompts
        ]
    graph = None if args.cuda_graph else False  # None: where it runs (inference/decode.py)
    return generate_batch(
        model, prompts, args.max_new_tokens, sampling, args.seed, stop_ids=stop_ids, stop=stops, cuda_graph=graph,
        compile=args.compile, batch_size=args.batch_size,
    )  # fmt: skip


def cmd_generate(args: argparse.Namespace) -> int:
    _check_args(args)
    device, dtype_name = resolve_device(args.device, args.precision, torch.cuda.is_available())
    meta = read_meta(args.load)  # tokenizer and prompts are checked before the weights are read
    texts = _prompt_texts(args)
    tok, path = _tokenizer(args, meta)
    prompts, stop_ids, stop_strings = _prompts_and_stops(args, texts, tok, path, meta)
    stops = StopStrings(tok.decode, stop_strings) if stop_strings else None
    mesh = _mesh(args.tp, device)
    try:
        if mesh is not None and device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        model, _ = load_for_generation(args.load, device, DTYPES[dtype_name], mesh)
        outputs = _generate(args, model, prompts, stop_ids, stops)
    finally:
        if mesh is not None:
            dist.destroy_process_group()
    results = []
    for text, ids in zip(texts, outputs):
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        out = tok.decode(ids)
        results.append((text, stops.cut(out) if stops is not None else out))
    if mesh is None or mesh.rank == 0:
        if len(results) == 1 and args.prompts_file is None:
            text, out = results[0]
            print(out if args.chat else text + out)
        else:  # one JSON line per prompt, in order: texts with newlines stay one line each
            for text, out in results:
                print(json.dumps({"prompt": text, "text": out}, ensure_ascii=False))
    return 0
