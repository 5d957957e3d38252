"""Generation speed: tokens/s of greedy decoding with the KV cache and with the whole sequence recomputed per token.

A preset with random weights (speed does not depend on them), or a checkpoint with --load; no stopping rule, so
every run makes exactly --new-tokens tokens. One untimed warm-up run of each mode first (allocations, kernels).

    python benchmarks/generate_speed.py --model llama-tiny --new-tokens 256               # CPU: both modes
    python benchmarks/generate_speed.py --model llama-1b --new-tokens 256 --modes cache   # one GPU, bf16
"""

from __future__ import annotations

import argparse
import time

import torch

from llamatron.dtypes import DTYPES
from llamatron.inference.generate import load_for_generation, sample
from llamatron.models import build_model, get_preset, materialize
from llamatron.training.validate import resolve_device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-tiny", help="preset with random weights (default: llama-tiny)")
    p.add_argument("--load", default=None, help="a checkpoint instead of --model")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--modes", default="cache,full", help="cache, full or both (default: cache,full)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--precision", default="auto", choices=("auto", *DTYPES))
    args = p.parse_args()
    device, dtype_name = resolve_device(args.device, args.precision, torch.cuda.is_available())
    dtype = DTYPES[dtype_name]
    if args.load:
        model, _ = load_for_generation(args.load, device, dtype)
        name = args.load
    else:
        cfg = get_preset(args.model)
        model = materialize(build_model(cfg), cfg, 0, device, dtype).eval()
        name = f"{args.model} (random weights)"
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    print(f"{name}, {device} {dtype_name}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy")
    for mode in args.modes.split(","):
        if mode not in ("cache", "full"):
            p.error(f"--modes: {mode!r} is not cache or full")
        seconds = []
        for _ in range(2):  # warm-up, then the timed run
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = sample(model, prompt.tolist(), args.new_tokens, temperature=0, use_cache=mode == "cache")
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        assert len(out) == args.new_tokens
        print(
            f"{mode:>5}: {args.new_tokens / seconds[-1]:8.1f} tokens/s ({seconds[-1]:.2f} s; warm-up {seconds[0]:.2f} s)"
        )


if __name__ == "__main__":
    main()
