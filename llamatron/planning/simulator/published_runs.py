"""Published large runs with a known layout (published_runs.yaml) and the simulator's prediction of each: what
tests/test_simulator_published_runs.py checks and docs/simulator.md tabulates (issue 38)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from ...models import ModelConfig
from ...models.inventory import attention_flops, flops_per_token
from ..plan import Layout, Precision
from .calibration import Calibration
from .evaluate import SimSettings, Simulation, simulate_layout
from .hardware import resolve_hardware
from .runs import run_model


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    return yaml.safe_load(resources.files(__package__).joinpath("published_runs.yaml").read_text())


def published_runs() -> list[dict[str, Any]]:
    return _table()["runs"]


def published_sources() -> dict[str, str]:
    return _table()["sources"]


def usable_runs() -> list[dict[str, Any]]:
    return [r for r in published_runs() if not r.get("excluded")]


def run_layout(run: dict[str, Any]) -> Layout:
    tp, pp, cp = run["tp"], run["pp"], run["cp"]
    dp = run["gpus"] // (tp * pp * cp)
    return Layout(
        tp=tp,
        pp=pp,
        vpp=run["vpp"],
        dp=dp,
        sequence_parallel=tp > 1,  # sequence parallelism with tensor parallelism, as Megatron-core's recipes run it
        distributed_optimizer=True,  # the distributed optimizer
        recompute=run.get("recompute", "none"),
        micro_batch_size=run["micro_batch_size"],
        global_batch_size=run["global_batch_size"],
        cp=cp,
        # Megatron-core's expert-parallel size counts the tp ranks that expert tensor parallelism 1 folds in; --ep
        # counts data-parallel ranks only
        ep=run["ep"] // tp if run.get("etp") == 1 else run["ep"],
        fsdp=run.get("fsdp", False),
        pp_layers=run.get("pp_layers"),
        etp=run.get("etp"),
    )


@dataclass
class Prediction:
    run: dict[str, Any]
    sim: Simulation
    predicted: float  # in the published unit: tokens/s per GPU, or TFLOP/s per GPU by flops_per_token
    published: float

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1

    @property
    def unit(self) -> str:
        return "tokens/s/GPU" if "tokens_per_sec_per_gpu" in self.run else "TFLOP/s/GPU"


def predict(run: dict[str, Any], cal: Calibration | None = None) -> Prediction:
    model = run_model(run)
    hw = resolve_hardware(run.get("gpu", "h100-sxm"), run.get("network", "8x400Gb-ndr"))
    precision = Precision(fp8="tensorwise" if run["precision"] == "fp8" else "none")
    megatron = run["source"].startswith(("nemo", "megatron"))
    settings = SimSettings(
        tp_overlap_all=run.get("tp_overlap") == "all",
        fused_grad_accumulation=run.get("fused_grad_accumulation", megatron),  # unless the recipe turns it off
        fp8_experts=megatron,  # Transformer Engine's FP8 grouped GEMMs
        ep_dispatcher=run.get("dispatcher", "alltoall"),
        grad_reduce_dtype=run.get("grad_reduce_dtype", "fp32"),  # a recipe's grad_sync_dtype where it gives one
        fp8_param_gather=run.get("param_gather") == "fp8",  # a recipe's fp8_param_gather where it sets one
    )
    sim = simulate_layout(model, run_layout(run), run["seq_length"], hw, precision, settings, cal)
    per_gpu = sim.result.tokens_per_sec_per_gpu
    if "tokens_per_sec_per_gpu" in run:
        return Prediction(run, sim, per_gpu, float(run["tokens_per_sec_per_gpu"]))
    tflops = per_gpu * counted_flops_per_token(model, run["seq_length"], run.get("attention_flops", "full")) / 1e12
    return Prediction(run, sim, tflops, float(run["tflops_per_gpu"]))


def counted_flops_per_token(model: ModelConfig, seq_length: int, attention: str) -> float:
    """Model FLOPs per token as the source counts them: flops_per_token (full attention: 12 x layers x attention
    width x keys) or, for "causal", half the attention's score and value products (Megatron-LM's
    num_floating_point_operations since 2025-03: the causal mask's zero half left out)."""
    full = flops_per_token(model, seq_length)
    if attention == "causal":
        return full - 6.0 * attention_flops(model, seq_length)
    return full


def summary(predictions: list[Prediction]) -> dict[str, float]:
    errors = [abs(p.error) for p in predictions]
    return {"rows": len(errors), "max": max(errors), "median": statistics.median(errors)}
