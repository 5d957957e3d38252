"""FlashAttention 4's Hopper tile configurations for a sliding window, forward and backward timed apart.

Issue 18's 1.3× (llama-1b, seq 8192, window 1024) needs the window's attention at <= 2.7 ms a layer; FA4's
default SM90 tiles give 2.99 (RESULTS.md run 8). FA4 picks its SM90 tiles from a table tuned for causal and
full attention (`_tile_size_fwd_sm90`, `_tile_size_bwd_sm90`); this measures the feasible alternatives its own
`sm90_config_search.py` lists for head dim 64 on the window shape, and the fixed cost the backward pays
whatever the mask (its preprocess and postprocess kernels), from a profile.

llama-1b's attention at seq 8192: batch 4, 32 query heads, 8 KV heads, head dim 64, bf16. One JSON line per
variant (ms, median of 20 after 5 warm-up), or its error.

usage: python benchmarks/fa4_window_tiles.py [--deadline SECONDS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

B, S, HQ, HKV, D, WINDOW = 4, 8192, 32, 8, 64, 1024

# (tile_m, tile_n, SdP_swapAB, dKV_swapAB, dQ_swapAB, AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ): the best
# of each tile size in `python flash_attn/cute/sm90_config_search.py --mode bwd --headdim 64`; the first is
# FA4's default. Its 80, 96 and 112-row tiles (dQ_swapAB) abort the process in FA4 4.0.0b36 (RESULTS.md run 11).
BWD = [
    (128, 128, True, False, False, 1, 2, 2),
    (64, 128, True, False, False, 1, 2, 1),
    (128, 96, False, True, False, 2, 2, 2),
    (64, 96, False, True, False, 1, 2, 1),
    (128, 112, False, True, False, 2, 2, 2),
]
# (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap); the first is FA4's default for head dim 64.
FWD = [
    (192, 128, True, True),
    (128, 128, True, True),
    (128, 192, True, True),
    (128, 160, True, True),
    (128, 96, True, True),
    (192, 96, True, True),
    (192, 192, True, False),
    (64, 128, True, True),
]


def median_ms(fn, reps: int = 20) -> float:
    times = []
    for i in range(reps + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return round(statistics.median(times), 4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deadline", type=float, default=420.0, help="stop starting new variants after this")
    args = parser.parse_args()
    began = time.monotonic()
    from flash_attn.cute import interface as fa

    torch.manual_seed(0)
    dev = torch.device("cuda")
    q = torch.randn(B, S, HQ, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    default_bwd = fa._tile_size_bwd_sm90

    def emit(row: dict) -> None:
        row["t"] = round(time.monotonic() - began, 1)
        print(json.dumps(row), flush=True)

    def run(kind: str, mask: str, cfg: tuple, call) -> None:
        if time.monotonic() - began > args.deadline:
            emit({"kind": kind, "mask": mask, "cfg": cfg, "error": "skipped: past the deadline"})
            return
        try:
            emit({"kind": kind, "mask": mask, "cfg": cfg, "ms": median_ms(call)})
        except Exception as e:  # a configuration the kernel rejects must not hide the others
            emit({"kind": kind, "mask": mask, "cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})

    def left(mask: str) -> int | None:
        return WINDOW - 1 if mask == "window" else None

    ref = {}
    for mask in ("window", "causal"):
        out, lse, *_ = fa._flash_attn_fwd(q, k, v, causal=True, window_size_left=left(mask), return_lse=True)
        ref[mask] = (out, lse)

    def grads(mask: str) -> tuple:
        out, lse = ref[mask]
        return fa._flash_attn_bwd(q, k, v, out, dout, lse, causal=True, window_size_left=left(mask))[:3]

    def bwd_call(mask: str):
        out, lse = ref[mask]
        return lambda: fa._flash_attn_bwd(q, k, v, out, dout, lse, causal=True, window_size_left=left(mask))

    # where the default backward's time goes: the main kernel against the fixed pre/postprocess
    for mask in ("window", "causal"):
        call = bwd_call(mask)
        call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
                name = "main" if "FlashAttentionBackwardSm90" in e.key else e.key[:60]
                kernels[name] = round(kernels.get(name, 0.0) + e.device_time_total / 1e3 / 10, 4)
        emit({"kind": "bwd-profile", "mask": mask, "ms_per_call": kernels})
    for mask in ("window", "causal"):
        for cfg in FWD if mask == "window" else FWD[:1]:
            tm, tn, rs, ol = cfg

            def fwd(tm=tm, tn=tn, rs=rs, ol=ol, mask=mask):
                fa._flash_attn_fwd(
                    q,
                    k,
                    v,
                    causal=True,
                    window_size_left=left(mask),
                    tile_mn=(tm, tn),
                    mma_pv_is_rs=rs,
                    intra_wg_overlap=ol,
                    return_lse=True,
                )

            run("fwd", mask, cfg, fwd)
        for cfg in BWD if mask == "window" else BWD[:2]:
            tm, tn, sdp, dkv, dq, a_sdp, a_dkv, a_dq = cfg
            chosen = fa.BwdConfig(
                m_block_size=tm,
                n_block_size=tn,
                num_stages_Q=2,
                num_stages_dO=2,
                num_stages_PdS=2,
                SdP_swapAB=sdp,
                dKV_swapAB=dkv,
                dQ_swapAB=dq,
                AtomLayoutMSdP=a_sdp,
                AtomLayoutNdKV=a_dkv,
                AtomLayoutMdQ=a_dq,
            )
            fa._tile_size_bwd_sm90 = lambda *a, chosen=chosen, **kw: chosen
            try:
                # the gradients must still be right: compare with the default configuration's
                got = grads(mask)
                fa._tile_size_bwd_sm90 = default_bwd
                want = grads(mask)
                err = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))
                fa._tile_size_bwd_sm90 = lambda *a, chosen=chosen, **kw: chosen
                emit({"kind": "bwd-check", "mask": mask, "cfg": cfg, "max_abs_diff_vs_default": err})
                run("bwd", mask, cfg, bwd_call(mask))
            except Exception as e:
                emit({"kind": "bwd", "mask": mask, "cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            finally:
                fa._tile_size_bwd_sm90 = default_bwd

    emit({"torch": torch.__version__, "device": torch.cuda.get_device_name()})


if __name__ == "__main__":
    main()
