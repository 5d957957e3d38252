"""Causal attention's efficiency at head dim 64 (llama-1b: 32 query heads, 8 KV heads) against head dim 128
(Llama 2 7B: 32 heads, no GQA), forward + backward, FA4 and cuDNN, at seq 8192 and 32768 (RESULTS.md run 11).

The simulator's attention efficiency was measured on llama-1b (head dim 64); this measures how much faster per
FLOP the same kernels run at head dim 128. One JSON line per case: ms (median of 10 after 3 warm-up) and
TFLOP/s counted as the causal work, 3.5 x 4 x B x H x D x S^2 / 2 (forward 1, backward 2.5).

usage: python benchmarks/attention_head_dim.py
"""

from __future__ import annotations

import json

import torch
from mask_kernels import timed  # this script's folder is on sys.path

from llamatron.kernels.flash4_op import available, fa4_causal_attention
from llamatron.models.attention import _sdpa

TOKENS = 32768
SHAPES = {"head dim 64 (llama-1b)": (32, 8, 64), "head dim 128 (llama2-7b)": (32, 32, 128)}


def main() -> None:
    dev = torch.device("cuda")
    backends = {"cudnn": lambda q, k, v: _sdpa(q, k, v, "cudnn", is_causal=True, enable_gqa=True)}
    if available():  # FA4 takes (batch, seq, heads, dim): the projection's own layout
        backends["fa4"] = lambda q, k, v: fa4_causal_attention(q, k, v)
    for seq in (8192, 32768):
        batch = TOKENS // seq
        for name, (hq, hkv, d) in SHAPES.items():
            for backend, fn in backends.items():
                bshd = backend == "fa4"
                shape_q = (batch, seq, hq, d) if bshd else (batch, hq, seq, d)
                shape_kv = (batch, seq, hkv, d) if bshd else (batch, hkv, seq, d)
                q = torch.randn(shape_q, device=dev, dtype=torch.bfloat16, requires_grad=True)
                k, v = (torch.randn(shape_kv, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
                ms = timed(fn, q, k, v, warmup=3, reps=10)
                flops = 3.5 * 4 * batch * hq * d * seq * seq / 2
                row = {"seq": seq, "shape": name, "backend": backend, "ms": round(ms, 3)}
                print(json.dumps({**row, "tflops": round(flops / ms / 1e9, 1)}), flush=True)
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
