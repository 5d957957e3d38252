"""Attention kernels for each mask kind, forward + backward, on one GPU (RESULTS.md run 8).

llama-1b's attention shape at seq 8192 (batch 4, 32 query heads, 8 KV heads, head dim 64, bf16): plain causal
through cuDNN and FA4; a 1024-token sliding window through FA4's local kernel, flex attention's Triton kernel
and flex attention's FLASH backend (torch's CuTe DSL path into FA4's kernels); document masks (lengths drawn
around a mean of ~440 tokens, like benchmarks/doc_corpus.py's `defs`) through flex Triton and flex FLASH.
Each variant prints one JSON line: ms per forward + backward (median of 20 after 5 warm-up), or its error.

usage: python benchmarks/mask_kernels.py
"""

from __future__ import annotations

import json
import statistics

import torch
from torch.nn.attention.flex_attention import flex_attention

from llamatron.kernels.flash4_op import fa4_causal_attention
from llamatron.models.attention import _sdpa, attention_mask

B, S, HQ, HKV, D, WINDOW = 4, 8192, 32, 8, 64, 1024
DEV = torch.device("cuda")


def timed(fn, q, k, v, warmup: int = 5, reps: int = 20) -> float:
    """ms of one forward + backward of fn(q, k, v): the median of `reps` after `warmup`."""
    grad = torch.randn_like(q)
    times = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def documents() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(B):
        ids, doc = [], 0
        while len(ids) < S:
            ids += [doc] * int(torch.randint(20, 860, (1,), generator=gen))
            doc += 1
        rows.append(ids[:S])
    return torch.tensor(rows, device=DEV)


def main() -> None:
    torch.manual_seed(0)
    q = torch.randn(B, HQ, S, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, HKV, S, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    window = attention_mask(S, WINDOW, None, DEV).block
    docs = attention_mask(S, None, documents(), DEV).block
    flex = torch.compile(flex_attention, dynamic=False)

    def flex_with(mask, backend):
        options = None if backend is None else {"BACKEND": backend}
        return lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options)

    def bshd(fn):
        return lambda q, k, v: fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    variants = {
        "causal cudnn": lambda q, k, v: _sdpa(q, k, v, "cudnn", is_causal=True, enable_gqa=True),
        "causal fa4": bshd(fa4_causal_attention),
        "window fa4": bshd(lambda q, k, v: fa4_causal_attention(q, k, v, WINDOW)),
        "window flex triton": flex_with(window, None),
        "window flex FLASH": flex_with(window, "FLASH"),
        "documents flex triton": flex_with(docs, None),
        "documents flex FLASH": flex_with(docs, "FLASH"),
    }
    for name, fn in variants.items():
        try:
            row = {"variant": name, "ms": round(timed(fn, q, k, v), 3)}
        except Exception as e:  # one failing variant (an experimental backend) must not hide the others
            row = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(row), flush=True)
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
