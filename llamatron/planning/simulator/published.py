"""The published results of published.yaml, simulated: what docs/simulator.md's validation table shows."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from ..plan import Layout
from .evaluate import Simulation, simulate_layout
from .hardware import resolve_hardware
from .runs import run_model


@lru_cache(maxsize=1)
def published_cases() -> list[dict[str, Any]]:
    return yaml.safe_load(resources.files(__package__).joinpath("published.yaml").read_text())["cases"]


@dataclass
class Validation:
    case: dict[str, Any]
    sim: Simulation
    predicted: float  # in the published figure's unit (GPU-hours, or TFLOP/s per GPU as the paper counts them)
    published: float

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1


def megatron_flops_per_step(case: dict[str, Any]) -> float:
    """Narayanan et al.'s count with activation recomputation: 96 B s l h^2 (1 + s/6h + V/16lh)."""
    o, lay = case["model_overrides"], case["layout"]
    b, s, layers, h, v = (
        lay["global_batch_size"],
        case["seq_length"],
        o["num_layers"],
        o["hidden_size"],
        o["vocab_size"],
    )
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def validate_case(case: dict[str, Any]) -> Validation:
    lay = case["layout"]
    gpus = case["gpus"]
    tp, pp = lay["tp"], lay["pp"]
    layout = Layout(
        tp=tp,
        pp=pp,
        vpp=lay["vpp"],
        dp=gpus // (tp * pp),
        sequence_parallel=lay.get("sequence_parallel", tp > 1),
        distributed_optimizer=lay.get("distributed_optimizer", True),
        recompute=lay["recompute"],
        micro_batch_size=lay["micro_batch_size"],
        global_batch_size=lay["global_batch_size"],
    )
    sim = simulate_layout(run_model(case), layout, case["seq_length"], resolve_hardware(case["gpu"], case["network"]))
    if "published_gpu_hours" in case:
        predicted = float(case["tokens"]) / sim.result.tokens_per_sec_per_gpu / 3600
        return Validation(case, sim, predicted, case["published_gpu_hours"])
    predicted = megatron_flops_per_step(case) / sim.result.step_seconds / gpus / 1e12
    return Validation(case, sim, predicted, case["published_tflops_per_gpu"])
