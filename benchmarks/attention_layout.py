"""Causal GQA attention (SDPA, default backend) forward + backward, by memory layout of q/k/v.

    python benchmarks/attention_layout.py [--batch 8 --heads 32 --kv-heads 8 --seq 4096 --head-dim 64]

"bhsd": contiguous (batch, heads, seq, dim) tensors (what microbenchmarks usually pass); "bshd": contiguous
(batch, seq, heads, dim) tensors viewed as (batch, heads, seq, dim); "packed": q, k, v as views of one
(batch, seq, heads + 2·kv_heads, dim) tensor (a fused QKV projection's output) and a (batch, seq, heads, dim)
output gradient, as a model without copies would pass them. "fa4" (CUDA, when flash-attn-4 is installed):
FlashAttention 4 on contiguous (batch, seq, heads, dim) tensors (in the model q and k are contiguous so, v a
view of the QKV output), with its largest difference from SDPA's output and gradients on the same inputs. Prints one JSON line per
layout: ms per forward+backward and TFLOP/s of the causal work (half the score matrix).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from llamatron.kernels.flash4_op import available as fa4_available
from llamatron.kernels.flash4_op import fa4_causal_attention


def make(layout: str, b: int, h: int, kv: int, s: int, d: int, device: str, dtype: torch.dtype):
    """q, k, v (leaves) and the output gradient in the given layout."""

    def bhsd(heads):
        return torch.randn(b, heads, s, d, device=device, dtype=dtype)

    def bshd(heads):
        return torch.randn(b, s, heads, d, device=device, dtype=dtype).transpose(1, 2)

    if layout == "packed":  # q, k, v: views of one (batch, seq, heads + 2 kv, dim) projection output
        qkv = torch.randn(b, s, h + 2 * kv, d, device=device, dtype=dtype, requires_grad=True)
        q, k, v = qkv.split([h, kv, kv], dim=2)
        return qkv, (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)), bshd(h)
    make_one = bhsd if layout == "bhsd" else bshd
    leaves = tuple(make_one(n).requires_grad_() for n in (h, kv, kv))
    return leaves, leaves, make_one(h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="sequences (default: 8)")
    parser.add_argument("--heads", type=int, default=32, help="query heads (default: 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads, dividing --heads (default: 8)")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (default: 4096)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension (default: 64)")
    parser.add_argument("--iters", type=int, default=20, help="timed forward+backward passes (default: 20)")
    args = parser.parse_args()
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads} (grouped-query attention)")
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    b, h, kv, s, d = args.batch, args.heads, args.kv_heads, args.seq, args.head_dim
    flops = 3.5 * 4 * b * h * s * s * d / 2  # forward 2 matmuls of 2·s²·d per head, causal half; backward 2.5×
    layouts = ["bhsd", "bshd", "packed"]
    if cuda and fa4_available():
        layouts.append("fa4")
    for layout in layouts:
        leaves, (q, k, v), grad = make("bshd" if layout == "fa4" else layout, b, h, kv, s, d, device, dtype)
        extra = {}
        if layout == "fa4":
            extra = fa4_difference(q, k, v, grad)

        def step():
            if layout == "fa4":  # (batch, seq, heads, dim) in and out
                out = fa4_causal_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
            torch.autograd.grad(out, leaves, grad, retain_graph=layout == "packed")

        for _ in range(3):
            step()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(args.iters):
                step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / args.iters
        else:
            import time

            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            ms = 1000 * (time.perf_counter() - t0) / args.iters
        print(
            json.dumps(
                {
                    "layout": layout,
                    "shape": [b, h, kv, s, d],
                    "ms_fwd_bwd": round(ms, 3),
                    "tflops": round(flops / ms / 1e9, 1),
                    **extra,
                }
            ),
            flush=True,
        )


def fa4_difference(q, k, v, grad) -> dict[str, float]:
    """Largest |FA4 - SDPA| of the output and each input gradient, and the largest |SDPA| value for scale."""
    results = []
    for run_fa4 in (False, True):
        if run_fa4:
            out = fa4_causal_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    names = ("out", "dq", "dk", "dv")
    diff = {f"max_diff_{n}": float((a.float() - b.float()).abs().max()) for n, a, b in zip(names, *results)}
    return {**diff, "max_abs_sdpa_dq": float(results[0][1].abs().max())}


if __name__ == "__main__":
    main()
