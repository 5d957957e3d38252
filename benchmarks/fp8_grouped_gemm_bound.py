"""How much FP8 can speed up a mixture of experts' grouped GEMMs on this GPU: the bound behind issue 34's target.

    python benchmarks/fp8_grouped_gemm_bound.py [--shape mixtral-1b|fine-grained] [--json]

For one MoE layer and one micro-batch (seq 4096 x micro-batch 4, experts loaded evenly) it times, with CUDA
events, the experts' six GEMMs (gate_up and down; forward, input gradient, weight gradient) three ways:
- bf16: torch._grouped_mm, as models/moe.py runs them;
- FP8 GEMMs alone: torch._scaled_grouped_mm on operands quantised beforehand (the quantisation free);
- FP8 as trained: training/fp8_experts.py's functions, torchao's quantisation kernels included.
The second is what any quantisation scheme could at best reach; the ratio bf16 / FP8-alone bounds the experts'
speed-up, and with the step's other time (a profile) the step's. Needs torchao and compute capability 9.0/10.0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from llamatron.training import fp8_experts as fx  # noqa: E402

SHAPES = {  # hidden, experts, expert ffn, top k
    "mixtral-1b": (2048, 8, 5632, 2),
    "fine-grained": (2048, 64, 704, 8),
}


def _time(fn, iters: int = 20) -> float:
    """Milliseconds per call, after warm-up."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _gemms(rows: int, experts: int, k_in: int, n_out: int) -> dict[str, float]:
    """One expert projection (weight (experts, n_out, k_in)) over `rows` rows: ms of its three GEMMs each way."""
    dev = torch.device("cuda")
    x = torch.randn(rows, k_in, device=dev, dtype=torch.bfloat16)
    w = torch.randn(experts, n_out, k_in, device=dev, dtype=torch.bfloat16) * 0.02
    g = torch.randn(rows, n_out, device=dev, dtype=torch.bfloat16)
    offsets = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * (rows // experts)
    out: dict[str, float] = {}
    out["bf16 forward"] = _time(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets))
    out["bf16 input grad"] = _time(lambda: torch._grouped_mm(g, w, offs=offsets))
    out["bf16 weight grad"] = _time(lambda: torch._grouped_mm(g.t(), x, offs=offsets))
    k = fx._kernels
    x8, xs = k.triton_fp8_rowwise_2d_scale_and_cast(x, output_dtype=fx.FP8, round_scales_to_power_of_2=True)
    w8, ws = k.triton_fp8_colwise_3d_scale_and_cast(
        w.transpose(-2, -1), output_dtype=fx.FP8, round_scales_to_power_of_2=True
    )
    g8, gs = k.triton_fp8_rowwise_2d_scale_and_cast(g, output_dtype=fx.FP8, round_scales_to_power_of_2=True)
    wt8, wts = k.triton_fp8_rowwise_3d_transpose_rhs(
        w.transpose(-2, -1), output_dtype=fx.FP8, round_scales_to_power_of_2=True
    )
    gc8, gcs, xc8, xcs = k.triton_fp8_per_group_colwise_scales_dual(
        g, x, offsets, fx.FP8, round_scales_to_power_of_2=True
    )
    out["fp8 GEMM forward"] = _time(
        lambda: fx._scaled_grouped_mm(x8, w8, xs.squeeze(-1), ws.squeeze(1), offsets, fast_accumulation=True)
    )
    out["fp8 GEMM input grad"] = _time(
        lambda: fx._scaled_grouped_mm(g8, wt8, gs.squeeze(-1), wts.squeeze(1), offsets, fast_accumulation=False)
    )
    out["fp8 GEMM weight grad"] = _time(
        lambda: fx._scaled_grouped_mm(gc8.t(), xc8, gcs.t(), xcs, offsets, fast_accumulation=False)
    )
    out["fp8 trained forward"] = _time(lambda: fx._fp8_forward(x, w, offsets))
    out["fp8 trained input grad"] = _time(lambda: fx._fp8_input_grad(g, w, offsets))
    out["fp8 trained weight grad"] = _time(lambda: fx._fp8_weight_grad(g, x, offsets))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-1b")
    parser.add_argument("--tokens", type=int, default=4 * 4096, help="tokens per micro-batch")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    hidden, experts, ffn, top_k = SHAPES[args.shape]
    fx._load_kernels()
    rows = args.tokens * top_k
    gate_up = _gemms(rows, experts, hidden, 2 * ffn)
    down = _gemms(rows, experts, ffn, hidden)
    total = {key: gate_up[key] + down[key] for key in gate_up}
    sums = {
        way: sum(v for key, v in total.items() if key.startswith(way)) for way in ("bf16", "fp8 GEMM", "fp8 trained")
    }
    result = {
        "shape": args.shape,
        "rows": rows,
        "gpu": torch.cuda.get_device_name(),
        "ms": {key: round(v, 4) for key, v in total.items()},
        "ms_per_layer_microbatch": {way: round(v, 4) for way, v in sums.items()},
        "bound_gemm_only": round(sums["bf16"] / sums["fp8 GEMM"], 3),
        "as_trained": round(sums["bf16"] / sums["fp8 trained"], 3),
    }
    if args.json:
        print(json.dumps(result))
        return
    for key, v in total.items():
        print(f"{key:26s} {v:8.3f} ms")
    print(
        f"bf16 {sums['bf16']:.3f} ms, FP8 GEMMs alone {sums['fp8 GEMM']:.3f} ms "
        f"({result['bound_gemm_only']}x), FP8 as trained {sums['fp8 trained']:.3f} ms ({result['as_trained']}x)"
    )


if __name__ == "__main__":
    main()
