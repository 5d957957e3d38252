"""The speed assumptions of the planner and the step simulator, read from calibration.yaml (shipped in the
package; each number there names the measured run it comes from, or says it is assumed and why)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

MiB = 2**20


@dataclass(frozen=True)
class Curve:
    """NCCL bus bandwidth of one collective kind: link x efficiency x size/(size + half)."""

    efficiency: float
    half_bytes: float

    def bus_bandwidth(self, link_bandwidth: float, size: float) -> float:
        return link_bandwidth * self.efficiency * size / (size + self.half_bytes)


@dataclass(frozen=True)
class Calibration:
    reference_gpu: str
    gemm_efficiency: float
    gemm_tokens_half: float
    gemm_width_half: float
    grouped_gemm_efficiency: float
    grouped_rows_half: float
    attention_efficiency: dict[str, float]
    attention_forward_share: float
    attention_long_half: float
    attention_window_factor: float
    attention_head_dim_128: dict[str, float]
    attention_other_gpus: dict[str, float]
    elementwise_per_hidden: float
    elementwise_per_ffn: float
    elementwise_per_qkv: float
    elementwise_hbm_efficiency: float
    eager_factor: float
    permutation_passes: float  # bf16 passes over a MoE layer's (tokens x k, hidden) rows, forward + backward
    routing_seconds: float  # per MoE layer and micro-batch, whatever the tokens
    loss_bytes_per_logit: float
    grad_accumulate_bytes: float
    optimizer_bytes_per_owned_param: float
    optimizer_hbm_efficiency: float
    fp8_gemm_speedup: dict[str, float]
    nvlink: dict[str, Curve]
    network: Curve
    network_all_reduce: Curve  # NCCL's tree across nodes: each node sends and receives the buffer once
    nvls_all_reduce: dict[str, dict[int, float]]  # per link: an in-node all-reduce's bus bandwidth over the ring's
    contention_bandwidth: float
    tp_slowdown: float
    tp_userbuffers_sm_share: float  # of the GPU's SMs an overlapped userbuffers collective takes from the GEMM
    idle_share: float
    planner: dict[str, Any]

    def attention(self, gpu: str, backend: str, seq: int, head_dim: int = 64) -> float:
        """In-model attention efficiency of a backend at a sequence length and head dim ('auto' is cuDNN, flex
        for masks: FA4 runs only where installed); measured at 4096 and head dim 64: longer sequences amortise
        more of each tile, and wider heads do more work per tile (linear from 64 to 128, flat beyond)."""
        backend = "cudnn" if backend == "auto" else backend
        assumed = self.attention_other_gpus.get(gpu)  # an assumed figure already covers the head dims
        base = assumed or self.attention_efficiency.get(backend, self.attention_efficiency["cudnn"])
        h = self.attention_long_half
        wider = 0.0 if assumed else min(max((head_dim - 64) / 64, 0.0), 1.0)
        head = 1.0 + (self.attention_head_dim_128.get(backend, 1.0) - 1.0) * wider  # unmeasured: no gain
        return base * head * (seq / (seq + h)) / (4096 / (4096 + h))


def _curve(entry: dict) -> Curve:
    return Curve(float(entry["efficiency"]), float(entry["half_mib"]) * MiB)


def _planner(d: dict) -> dict[str, Any]:
    return {
        "base_mfu": float(d["base_mfu"]),
        "nvlink_bw": float(d["nvlink_gbps"]) * 1e9,
        "fp8_gemm_speedup": {k: float(v) for k, v in d["fp8_gemm_speedup"].items()},
    }


def _nvlink(c: dict) -> dict[str, Curve]:
    """The measured curves; p2p and all-to-all take the all-gather's: on the two GPUs measured, each of the three
    is every rank sending its share over the one link to the other."""
    curves = {k: _curve(v) for k, v in c.items()}
    return {**curves, "p2p": curves["all_gather"], "all_to_all": curves["all_gather"]}


def calibration_table() -> dict[str, Any]:
    """calibration.yaml as read (a fresh copy: tests perturb it)."""
    return yaml.safe_load(resources.files(__package__).joinpath("calibration.yaml").read_text())


@lru_cache(maxsize=1)
def load_calibration() -> Calibration:
    return calibration_from(calibration_table())


def calibration_from(d: dict[str, Any]) -> Calibration:
    """The Calibration of a table shaped as calibration.yaml."""
    g, a, e, o, c, t = (
        d["gemm"],
        d["attention"],
        d["elementwise"],
        d["optimizer"],
        d["collectives"],
        d["tensor_parallel"],
    )
    return Calibration(
        reference_gpu=d["reference_gpu"],
        gemm_efficiency=float(g["efficiency"]),
        gemm_tokens_half=float(g["tokens_half"]),
        gemm_width_half=float(g["width_half"]),
        grouped_gemm_efficiency=float(g["grouped_efficiency"]),
        grouped_rows_half=float(g["grouped_rows_half"]),
        attention_efficiency={k: float(v) for k, v in a["efficiency"].items()},
        attention_forward_share=float(a["forward_share"]),
        attention_long_half=float(a["long_sequence_half"]),
        attention_window_factor=float(a["window_factor"]),
        attention_head_dim_128={k: float(v) for k, v in a["head_dim_128"].items()},
        attention_other_gpus={k: float(v) for k, v in a["other_gpus"].items()},
        elementwise_per_hidden=float(e["per_hidden"]),
        elementwise_per_ffn=float(e["per_ffn"]),
        elementwise_per_qkv=float(e["per_qkv"]),
        elementwise_hbm_efficiency=float(e["hbm_efficiency"]),
        eager_factor=float(e["eager_factor"]),
        permutation_passes=float(d["moe"]["permutation_passes"]),
        routing_seconds=float(d["moe"]["routing_us"]) / 1e6,
        loss_bytes_per_logit=float(e["loss_bytes_per_logit"]),
        grad_accumulate_bytes=float(e["grad_accumulate_bytes"]),
        optimizer_bytes_per_owned_param=float(o["bytes_per_owned_param"]),
        optimizer_hbm_efficiency=float(o["hbm_efficiency"]),
        fp8_gemm_speedup={k: float(v) for k, v in d["fp8"]["gemm_speedup"].items()},
        nvlink=_nvlink(c["nvlink"]),
        # NCCL's message-size curve is its protocol's (chunks in flight), not the link's: the network's takes
        # the measured all-gather's half-bandwidth size.
        network=Curve(float(c["network"]["efficiency"]), float(c["nvlink"]["all_gather"]["half_mib"]) * MiB),
        network_all_reduce=_curve(c["network_all_reduce"]),
        nvls_all_reduce={
            link: {int(n): float(g) for n, g in gains.items()} for link, gains in c["nvls_all_reduce"].items()
        },
        contention_bandwidth=float(c["contention_gbps"]) * 1e9,
        tp_slowdown=float(t["slowdown"]),
        tp_userbuffers_sm_share=float(t["userbuffers_sm_share"]),
        idle_share=float(d["step"]["idle_share"]),
        planner=_planner(d["planner"]),
    )
