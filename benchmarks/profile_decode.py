"""Where one decoding step's time goes (issue 37): llama-1b (or --model), bf16, the step run eagerly under the
torch profiler (its kernels are those a CUDA graph replays), kernels summed by name, the largest first.

    python3 benchmarks/profile_decode.py [--model llama-1b] [--batch 1] [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llamatron.inference.decode import Decoder  # noqa: E402
from llamatron.models import build_model, get_preset, materialize  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    cfg = get_preset(args.model)
    model = materialize(build_model(cfg), cfg, 0, "cuda", torch.bfloat16).eval()
    decoder = Decoder(model, args.batch, 16 + 256, cuda_graph=False)
    prompts = [[1 + i] * 16 for i in range(args.batch)]
    decoder.generate(prompts, 8)  # warm-up: Triton compiles, cuBLAS workspaces
    decoder.generate(prompts, 2)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            decoder._step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events)
    print(f"{args.model} batch {args.batch}: {total / args.steps / 1e3:.3f} ms of kernels per step")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:25]:
        print(f"{e.device_time_total / args.steps:9.1f} us  {e.count // args.steps:4d}x  {e.key[:90]}")


if __name__ == "__main__":
    main()
