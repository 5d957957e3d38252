"""What pins each number of llamatron/planning/simulator/calibration.yaml (tests/test_calibration_constants.py).

A witness takes a calibration table (the YAML as a dict) and returns the problems it sees; none when the table
agrees with what was recorded. Three kinds:
- derived: recomputed, with the formula written out, from the recorded measurement the YAML cites (a kernel
  profile, a benchmark's JSON rows, docs/gpu_facts.md, benchmarks/RESULTS.md), within DERIVED_TOLERANCE;
- fitted: fitted to recorded runs, so the runs it moves fit worse (root mean square of the log error) with it
  moved by FITTED_STEP either way;
- assumed: no run of ours measures it; inside the public range its source cites.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
DERIVED_TOLERANCE = 0.08
FITTED_STEP = 0.2
Table = dict[str, Any]
Path_ = tuple[str, ...]


def get(table: Table, path: Path_) -> Any:
    for key in path:
        table = table[key]
    return table


def leaves(table: Table, path: Path_ = ()) -> list[Path_]:
    """Every number of a table (the `source` texts are not numbers)."""
    out: list[Path_] = []
    for key, value in table.items():
        if isinstance(value, dict):
            out += leaves(value, (*path, key))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((*path, key))
    return out


# ---- the recorded measurements ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """A `benchmarks/profile_step.py` report: category and kernel times in ms per step."""

    categories: dict[str, float]
    kernels: dict[str, float]

    def kernel(self, pattern: str) -> float:
        return sum(ms for name, ms in self.kernels.items() if re.search(pattern, name))


@cache
def profile(name: str) -> Profile:
    text = (BENCH / name).read_text()
    categories = {m[1]: float(m[2]) for m in re.finditer(r"^(\w[\w/]*)\s+([\d.]+)\s+[\d.]+%$", text, re.M)}
    kernels = {m[3]: float(m[1]) for m in re.finditer(r"^\s+([\d.]+)\s+(\d+)\s+(.+)$", text, re.M)}
    return Profile(categories, kernels)


# run 6 call H: llama-1b, mbs 8, seq 4096, compiled, FA4, all Triton kernels (RESULTS.md "call H, commit 572ceda")
PROFILE_H = "results-2026-11-30-run6-profile-fa4-callH.txt"


@cache
def llama_1b() -> Any:
    from llamatron.planning.simulator.runs import run_model

    return run_model({"model": "llama-1b"})


@cache
def h200() -> Any:
    from llamatron.planning.simulator.hardware import resolve_hardware

    return resolve_hardware("h200")


@cache
def mixtral_1b() -> Any:
    from llamatron.planning.simulator.runs import run_model

    return run_model({"model": "mixtral-1b"})


TOKENS = 8 * 4096  # the profiled step: one micro-batch of 8 x 4096


def results_line(pattern: str) -> re.Match:
    found = re.search(pattern, (BENCH / "RESULTS.md").read_text())
    assert found, f"benchmarks/RESULTS.md has no line matching {pattern!r}"
    return found


def gpu_facts_nccl() -> dict[str, tuple[float, float]]:
    """docs/gpu_facts.md's NCCL row: bus GB/s at 64 and 512 MiB per collective."""
    row = next(line for line in (REPO / "docs" / "gpu_facts.md").read_text().splitlines() if "NCCL bus" in line)
    found = {
        "all_reduce": re.search(r"all-reduce (\d+) GB/s \(64 MiB\) / (\d+)", row),
        "reduce_scatter": re.search(r"reduce-scatter (\d+) / (\d+)", row),
        "all_gather": re.search(r"all-gather (\d+) / (\d+)", row),
    }
    return {k: (float(m[1]), float(m[2])) for k, m in found.items() if m}


def attention_flops(model: Any, seq: int, tokens: int) -> float:
    """The causal work, forward and backward: 3 x (QK^T and PV: 2 x 2 x heads x head_dim) x mean keys."""
    return 3 * 4 * model.num_heads * model.head_dim * (seq + 1) / 2 * tokens * model.num_layers


def gemm_flops(model: Any, tokens: int) -> float:
    """Forward + backward (3 x 2 x weights x tokens) of the decoder's linears and the output head."""
    h, f, hd = model.hidden_size, model.ffn_hidden_size, model.head_dim
    qkv = (model.num_heads + 2 * model.num_kv_heads) * hd
    per_layer = h * qkv + model.num_heads * hd * h + 3 * h * f
    return 6 * tokens * (model.num_layers * per_layer + h * model.vocab_size)


# ---- derived ------------------------------------------------------------------------------------------------


def _gemm(t: Table) -> dict[Path_, float]:
    m, g = llama_1b(), t["gemm"]
    shape = TOKENS / (TOKENS + g["tokens_half"]) * m.hidden_size / (m.hidden_size + g["width_half"])
    rate = gemm_flops(m, TOKENS) / (profile(PROFILE_H).categories["matmul"] / 1e3)
    return {("gemm", "efficiency"): rate / h200().gpu.peak_flops / shape}


# The two MoE profiles: RESULTS.md run 10 (mixtral-1b, 8 experts of ffn 5632, top 2) and run 21 call 1 (its shape
# with 64 experts of ffn 704, top 8); each mbs 4 x seq 4096, 2 micro-batches, 16 layers
MOE_PROFILE = "results-2026-12-03-run21-moe-fine-grained-kernels.txt"
MOE_TOKENS, MOE_MICRO_BATCHES = 4 * 4096, 2


def kernel_lines(name: str, pattern: str) -> float:
    """ms per step of a profile's kernel lines whose name matches, line by line (the report cuts names, so
    different kernels may print alike: Profile.kernels would keep one of them)."""
    lines = re.finditer(r"^\s+([\d.]+)\s+\d+\s+(.+)$", (BENCH / name).read_text(), re.M)
    return sum(float(m[1]) for m in lines if re.search(pattern, m[2]))


def _grouped_gemm(t: Table) -> dict[Path_, float]:
    """Each profile's grouped-GEMM rate over a dense GEMM's at the experts' width: rows/(rows + half) x efficiency,
    two points for the two unknowns."""
    g, peak = t["gemm"], h200().gpu.peak_flops
    points = []  # (token choices per expert, measured rate / (peak x efficiency x width factor))
    m = mixtral_1b()
    for experts, k, ffn, ms in (
        (8, 2, 5632, float(results_line(r"CUTLASS's sm90 grouped kernels, ([\d.]+) ms")[1])),
        (64, 8, 704, kernel_lines(MOE_PROFILE, r"GroupProblemShape")),
    ):
        flops = 6 * MOE_TOKENS * k * 3 * m.hidden_size * ffn * m.num_layers * MOE_MICRO_BATCHES
        width = min(m.hidden_size, ffn)
        rate = flops / (ms / 1e3) / (peak * g["efficiency"] * width / (width + g["width_half"]))
        points.append((MOE_TOKENS * k / experts, rate))
    (r1, y1), (r2, y2) = points
    q = y1 / y2  # = r1 (r2 + half) / (r2 (r1 + half))
    half = r1 * r2 * (q - 1) / (r1 - q * r2)
    return {("gemm", "grouped_rows_half"): half, ("gemm", "grouped_efficiency"): y1 * (r1 + half) / r1}


def _permutation(t: Table) -> dict[Path_, float]:
    """Run 21's permutation kernels (Inductor's gathers, index assignments, scatter-adds and the weighted sum) as
    passes over the layer's (tokens x k, hidden) bf16 rows at the elementwise bandwidth."""
    m, e = mixtral_1b(), t["elementwise"]
    ms = kernel_lines(MOE_PROFILE, r"^triton_\w*(index|scatter|new_zeros|sum_unsqueeze)")
    one_pass = MOE_TOKENS * 8 * m.hidden_size * 2 / (h200().gpu.hbm_bw * e["hbm_efficiency"])
    return {("moe", "permutation_passes"): ms / 1e3 / (m.num_layers * MOE_MICRO_BATCHES) / one_pass}


def _attention(t: Table) -> dict[Path_, float]:
    """FA4's time from the profile; cuDNN's from run 3's (RESULTS.md); flex from docs/gpu_facts.md's kernel alone
    scaled by what the model loses against the kernel alone (cuDNN: in the model / alone)."""
    m, peak, p = llama_1b(), h200().gpu.peak_flops, profile(PROFILE_H)
    work = attention_flops(m, 4096, TOKENS)
    cudnn = results_line(r"\| attention \| ([\d.]+) \| cuDNN bprop ([\d.]+), fprop ([\d.]+)")
    cudnn_ms, cudnn_bwd, cudnn_fwd = (float(x) for x in cudnn.groups())
    fa4_fwd, fa4_bwd = p.kernel(r"FlashAttentionForwardSm90"), p.kernel(r"FlashAttentionBackwardSm90")
    facts = (REPO / "docs" / "gpu_facts.md").read_text()
    alone = {k: float(v) for k, v in re.findall(r"(cuDNN|flex attention) [\w ]*?([\d.]+) ms", facts)}  # one layer
    in_model = work / (cudnn_ms / 1e3) / peak
    kept = alone["cuDNN"] / (cudnn_ms / m.num_layers)  # the kernel's speed alone that it keeps in the model
    out = {
        ("attention", "efficiency", "fa4"): work / (p.categories["attention"] / 1e3) / peak,
        ("attention", "efficiency", "cudnn"): in_model,
        ("attention", "efficiency", "flex"): in_model * alone["cuDNN"] / alone["flex attention"],
        ("attention", "forward_share"): (fa4_fwd / (fa4_fwd + fa4_bwd) + cudnn_fwd / (cudnn_fwd + cudnn_bwd)) / 2,
    }
    lines = (BENCH / "results-2026-12-01-run11-head-dim.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "seq" in r]
    for backend in ("cudnn", "fa4"):
        ratios = []
        for seq in sorted({r["seq"] for r in rows}):
            by_dim = {"128" in r["shape"]: r["tflops"] for r in rows if r["seq"] == seq and r["backend"] == backend}
            ratios.append(by_dim[True] / by_dim[False])
        out[("attention", "head_dim_128", backend)] = statistics.mean(ratios)
    # A100: FlashAttention-2's low end on A100, 50% of the peak forward + backward alone (Dao 2023, arXiv
    # 2307.08691, which counts the backward as 2.5 forwards where we count 2), times what the model keeps.
    for gpu in t["attention"]["other_gpus"]:
        out[("attention", "other_gpus", gpu)] = 0.50 * 3 / 3.5 * kept
    return out


def _elementwise(t: Table) -> dict[Path_, float]:
    """Each kernel family's time in the profile, as bytes moved at the table's HBM efficiency: SwiGLU per FFN
    element, the fused q/k/v rotary per q/k/v element, the rest of the layers' elementwise kernels per hidden
    element (norms, residual adds, copies); the loss per logit; the gradient kernel per parameter."""
    m, p, e = llama_1b(), profile(PROFILE_H), t["elementwise"]
    bandwidth = h200().gpu.hbm_bw * e["hbm_efficiency"]
    ffn, qkv = p.kernel(r"^swiglu_"), p.kernel(r"^qkv_rope_")
    loss, grad = p.kernel(r"^cross_entropy_"), p.kernel(r"^accumulate_grad_kernel")
    hidden = p.categories["elementwise/other"] - ffn - qkv - loss - grad
    per_element = bandwidth / 1e3 / (2 * TOKENS * m.num_layers)  # bf16 elements per ms of each kind, per layer
    qkv_width = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    from llamatron.models.inventory import num_params

    return {
        ("elementwise", "per_ffn"): ffn * per_element / m.ffn_hidden_size,
        ("elementwise", "per_qkv"): qkv * per_element / qkv_width,
        ("elementwise", "per_hidden"): hidden * per_element / m.hidden_size,
        ("elementwise", "loss_bytes_per_logit"): loss / 1e3 * bandwidth / (TOKENS * m.vocab_size),
        ("elementwise", "grad_accumulate_bytes"): grad / 1e3 * bandwidth / num_params(m),
    }


def _optimizer(t: Table) -> dict[Path_, float]:
    """Llama 2 7B's optimizer time on one H200 (run 9 call C): bytes per parameter / (HBM x efficiency)."""
    from llamatron.models.inventory import num_params
    from llamatron.planning.simulator.runs import run_model

    row = json.loads((BENCH / "results-2026-12-01-run9-fp8.jsonl").read_text().splitlines()[0])
    assert (row["_call"], row["model"], row["fp8"]) == ("C", "llama2-7b", "none")
    per_param = row["optimizer_ms"] / 1e3 / num_params(run_model({"model": "llama2-7b"}))
    o = t["optimizer"]
    return {
        ("optimizer", "hbm_efficiency"): o["bytes_per_owned_param"] / (per_param * h200().gpu.hbm_bw),
        ("optimizer", "bytes_per_owned_param"): per_param * h200().gpu.hbm_bw * o["hbm_efficiency"],
    }


def _nccl(t: Table) -> dict[Path_, float]:
    """Each curve through docs/gpu_facts.md's two points: bus = link x efficiency x size / (size + half)."""
    link, out = h200().link.bandwidth / 1e9, {}
    for kind, (b64, b512) in gpu_facts_nccl().items():
        r = b512 / b64  # = (512 / (512 + half)) / (64 / (64 + half))
        half = 512 * 64 * (r - 1) / (512 - 64 * r)
        out[("collectives", "nvlink", kind, "half_mib")] = half
        out[("collectives", "nvlink", kind, "efficiency")] = b64 / link * (64 + half) / 64
    rs, ag = gpu_facts_nccl()["reduce_scatter"][0], gpu_facts_nccl()["all_gather"][0]
    out[("planner", "nvlink_gbps")] = (rs + ag) / 2  # the closed-form model's one link speed: 64 MiB buckets
    return out


def _idle(t: Table) -> dict[Path_, float]:
    """Each profile's header: wall ms per step against the sum of its kernels."""
    shares = []
    for name in sorted(BENCH.glob("results-*-profile-*.txt")):
        found = re.match(r"wall ([\d.]+) ms/step, kernels ([\d.]+) ms/step", name.read_text())
        assert found, name
        shares.append(1 - float(found[2]) / float(found[1]))
    assert len(shares) >= 4
    return {("step", "idle_share"): statistics.mean(shares)}


# NVIDIA NeMo nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py,
# userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192: the SMs each overlapped GEMM's collective takes (ring-exchange
# ones none: qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad; bulk: qkv_dgrad 4, qkv_wgrad 24, fc1_dgrad 2, fc1_wgrad 4;
# pipelined: proj_fprop 24, fc2_fprop 16), and an H100 SXM's SMs (NVIDIA H100 datasheet: 132).
USERBUFFERS_SMS = [0, 0, 0, 0, 4, 24, 2, 4, 24, 16]
H100_SMS = 132


# nccl-tests all_reduce_perf, 2 nodes x 8 H100 (GCP A3 Mega: 8 x 200 Gb/s = 200 GB/s per node),
# github.com/lessizzmore/create-a3mega-ztan-fork, ztan-NCCL-test-result: algorithm bandwidth (GB/s) by size (MiB)
A3MEGA_ALL_REDUCE_ALGBW = {1024: 158.86, 8192: 180.71}
A3MEGA_NODE_GBPS = 200.0


def _network_all_reduce(t: Table) -> dict[Path_, float]:
    """The tree's curve through the two points: algbw = node x efficiency x size / (size + half)."""
    (s1, b1), (s2, b2) = sorted(A3MEGA_ALL_REDUCE_ALGBW.items())
    r = b2 / b1  # = (s2 / (s2 + half)) / (s1 / (s1 + half))
    half = s1 * s2 * (r - 1) / (s2 - s1 * r)
    return {
        ("collectives", "network_all_reduce", "half_mib"): half,
        ("collectives", "network_all_reduce", "efficiency"): b2 / A3MEGA_NODE_GBPS * (s2 + half) / s2,
    }


# nccl-tests all_reduce_perf at 2-4 GiB on one node of 8 H100-SXM (github.com/NVIDIA/nccl issue 1455): bus GB/s
# with NCCL_ALGO=RING (365-370 for 2 to 8 GPUs: its midpoint) and with NCCL_ALGO=NVLS by GPUs in the group.
NVLS_RING_BUSBW = 367.5
NVLS_BUSBW = {5: 420.0, 6: 440.0, 7: 460.0, 8: 480.0}


def _nvls(t: Table) -> dict[Path_, float]:
    return {("collectives", "nvls_all_reduce", "nvlink4", str(n)): b / NVLS_RING_BUSBW for n, b in NVLS_BUSBW.items()}


def _userbuffers(t: Table) -> dict[Path_, float]:
    return {("tensor_parallel", "userbuffers_sm_share"): statistics.mean(USERBUFFERS_SMS) / H100_SMS}


DERIVATIONS: list[Callable[[Table], dict[Path_, float]]] = [
    _gemm,
    _grouped_gemm,
    _permutation,
    _attention,
    _elementwise,
    _optimizer,
    _nccl,
    _idle,
    _userbuffers,
    _network_all_reduce,
    _nvls,
]
# Numbers that only the derivations read: moving one moves what they derive (the per_* are bytes at this efficiency).
DERIVATION_INPUTS: list[Path_] = [("elementwise", "hbm_efficiency")]


def derived(t: Table) -> dict[Path_, float]:
    out: dict[Path_, float] = {}
    for derive in DERIVATIONS:
        out.update(derive(t))
    return out


def derived_problems(t: Table, paths: list[Path_] | None = None) -> list[str]:
    values = derived(t)
    return [
        f"{'.'.join(p)} = {get(t, p)}, derived {v:.4g}"
        for p, v in values.items()
        if (paths is None or p in paths) and abs(get(t, p) / v - 1) > DERIVED_TOLERANCE
    ]


# ---- assumed ------------------------------------------------------------------------------------------------

# path: (low, high, the public source of the range)
ASSUMED: dict[Path_, tuple[float, float, str]] = {
    ("collectives", "network", "efficiency"): (
        0.80,
        0.90,
        "nccl-tests on InfiniBand reach 80-90% of a NIC's line rate for large messages",
    ),
}


def assumed_problems(t: Table) -> list[str]:
    return [
        f"{'.'.join(p)} = {get(t, p)} outside {lo}-{hi} ({why})"
        for p, (lo, hi, why) in ASSUMED.items()
        if not lo <= get(t, p) <= hi
    ]


# ---- fitted -------------------------------------------------------------------------------------------------


def _simulator_errors(t: Table) -> list[float]:
    from llamatron.planning.simulator.calibration import calibration_from
    from llamatron.planning.simulator.runs import measured_runs, simulate_run

    cal = calibration_from(t)
    return [
        math.log(simulate_run(r, cal).tokens_per_sec_per_gpu / r["tokens_per_sec_per_gpu"])
        for r in measured_runs()
        if not r.get("excluded")
    ]


def _planner_errors(t: Table) -> list[float]:
    """The closed-form ranking model against the compiled H200 rows of benchmarks/h200_peak_memory.json and the
    FP8 rows of measured_runs.yaml."""
    from planner_rows import planner_log_errors

    return planner_log_errors(t)


FITTED: dict[Path_, Callable[[Table], list[float]]] = {
    **{
        p: _simulator_errors
        for p in [
            ("gemm", "tokens_half"),
            ("gemm", "width_half"),
            ("moe", "routing_us"),
            ("attention", "efficiency", "flash"),
            ("attention", "long_sequence_half"),
            ("attention", "window_factor"),
            ("elementwise", "eager_factor"),
            ("fp8", "gemm_speedup", "tensorwise"),
            ("fp8", "gemm_speedup", "rowwise"),
            ("collectives", "contention_gbps"),
            ("tensor_parallel", "slowdown"),
        ]
    },
    ("planner", "base_mfu"): _planner_errors,
    ("planner", "fp8_gemm_speedup", "tensorwise"): _planner_errors,
    ("planner", "fp8_gemm_speedup", "rowwise"): _planner_errors,
}


def scaled(t: Table, path: Path_, factor: float) -> Table:
    out = json.loads(json.dumps(t))
    parent = get(out, path[:-1])
    parent[path[-1]] = parent[path[-1]] * factor
    return out


_ERRORS: dict[tuple[Callable, str], list[float]] = {}


def _errors_of(errors: Callable[[Table], list[float]], t: Table) -> list[float]:
    """errors(t), remembered: the fitted tests and their moved-by-20% twins evaluate the same tables again."""
    key = (errors, json.dumps(t, sort_keys=True))
    if key not in _ERRORS:
        _ERRORS[key] = errors(t)
    return _ERRORS[key]


def fit_error(t: Table, path: Path_) -> tuple[float, float, float]:
    """RMS log error of the runs `path` moves, with it at x(1 - step), x1 and x(1 + step)."""
    errors = FITTED[path]
    at = [_errors_of(errors, scaled(t, path, f)) for f in (1 - FITTED_STEP, 1.0, 1 + FITTED_STEP)]
    moved = [i for i in range(len(at[1])) if len({round(a[i], 12) for a in at}) > 1]
    assert moved, f"{'.'.join(path)} moves no recorded run"
    rms = [math.sqrt(sum(a[i] ** 2 for i in moved) / len(moved)) for a in at]
    return rms[0], rms[1], rms[2]


def fitted_problems(t: Table, path: Path_) -> list[str]:
    low, here, high = fit_error(t, path)
    if here < low and here < high:
        return []
    return [f"{'.'.join(path)} = {get(t, path)}: rms {here:.4f} here, {low:.4f} / {high:.4f} at -/+{FITTED_STEP}"]
