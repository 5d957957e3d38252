"""Is FA4's GQA backward what slows the sliding window? Its variants on llama-1b's window, timed apart.

FA4's backward has no packed-GQA mode: with 4 query heads a KV head, each key tile's block adds its dK and dV
into fp32 buffers by atomics and a postprocess converts them (`interface._flash_attn_bwd`, "GQA ... needs dK/dV
accum+postprocess"). With a window each block walks ~9 query tiles instead of causal's ~33, so that fixed
epilogue weighs ~4× more. This times, for the window and for causal:
- forward with FA4's packed GQA (its default) and without;
- the backward as the model calls it (GQA: 8 KV heads);
- the backward on K and V repeated to 32 heads (no atomics, dK/dV stored directly), with the repeat and the
  sum over each group of 4 heads counted in;
and checks the repeated-heads gradients against the GQA ones.

usage: python benchmarks/fa4_window_gqa.py   (one JSON line per variant, ms, median of 20 after 5 warm-up)
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fa4_window_tiles import HKV, HQ, WINDOW, B, D, S, median_ms  # noqa: E402

GROUP = HQ // HKV


def main() -> None:
    from flash_attn.cute import interface as fa

    torch.manual_seed(0)
    dev = torch.device("cuda")
    q = torch.randn(B, S, HQ, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    for mask, left in (("window", WINDOW - 1), ("causal", None)):
        row: dict = {"mask": mask}
        for pack in (True, False):
            row[f"fwd_pack_gqa_{pack}"] = median_ms(
                lambda pack=pack: fa._flash_attn_fwd(
                    q, k, v, causal=True, window_size_left=left, pack_gqa=pack, return_lse=True
                )
            )
        out, lse, *_ = fa._flash_attn_fwd(q, k, v, causal=True, window_size_left=left, return_lse=True)

        def gqa_bwd():
            return fa._flash_attn_bwd(q, k, v, out, dout, lse, causal=True, window_size_left=left)[:3]

        def repeated_bwd():
            k32, v32 = (t.repeat_interleave(GROUP, dim=2) for t in (k, v))
            dq, dk32, dv32 = fa._flash_attn_bwd(q, k32, v32, out, dout, lse, causal=True, window_size_left=left)[:3]
            dk, dv = (t.view(B, S, HKV, GROUP, D).sum(3, dtype=torch.float32).to(t.dtype) for t in (dk32, dv32))
            return dq, dk, dv

        k32, v32 = (t.repeat_interleave(GROUP, dim=2) for t in (k, v))
        row["bwd_gqa"] = median_ms(gqa_bwd)
        row["bwd_repeated_kernel_only"] = median_ms(
            lambda: fa._flash_attn_bwd(q, k32, v32, out, dout, lse, causal=True, window_size_left=left)
        )
        row["bwd_repeated_total"] = median_ms(repeated_bwd)
        row["max_abs_diff_repeated_vs_gqa"] = max(
            float((a.float() - b.float()).abs().max()) for a, b in zip(repeated_bwd(), gqa_bwd())
        )
        print(json.dumps(row), flush=True)
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
