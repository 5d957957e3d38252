"""llamatron's own recorded runs (measured_runs.yaml) and the simulator's prediction of each: what the
calibration test checks, and what `docs/simulator.md` tabulates."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from ...config.settings import RunConfig
from ...models import ModelConfig
from .calibration import Calibration
from .costs import Shape, StepOptions
from .fsdp import FsdpOptions
from .hardware import resolve_hardware
from .step import StepResult, simulate_step


@lru_cache(maxsize=1)
def measured_runs() -> list[dict[str, Any]]:
    return yaml.safe_load(resources.files(__package__).joinpath("measured_runs.yaml").read_text())["runs"]


def run_model(run: dict[str, Any]) -> ModelConfig:
    cfg = RunConfig(model_overrides=dict(run.get("model_overrides") or {}))
    cfg.train.model = run["model"]
    return cfg.model_config()


def simulate_run(run: dict[str, Any], cal: Calibration | None = None) -> StepResult:
    """The simulated step of one recorded run (all were on H200s of one node)."""
    dp = run["dp"]
    shape = Shape(
        tp=run["tp"],
        cp=run["cp"],
        dp=dp,
        pp=run["pp"],
        micro_batch_size=run["micro_batch_size"],
        seq_length=run["seq_length"],
        sequence_parallel=run["sequence_parallel"],
        vpp=run["vpp"],
        distributed_optimizer=run["distributed_optimizer"],
        recompute=run["recompute"],
        recompute_layers=run.get("recompute_layers"),
        compiled=run["compile"],
        fp8=run.get("fp8", "none"),
        attention=run.get("attention", "auto"),
    )
    overlap = run.get("overlap", True)
    options = StepOptions(
        micro_batches=run["global_batch_size"] // (run["micro_batch_size"] * dp),
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        grad_reduce_bytes=2 if run.get("grad_reduce_dtype") == "bf16" else 4,
        fsdp=FsdpOptions(run.get("fsdp_shard_group") or dp * run["cp"]) if run.get("fsdp") else None,
    )
    return simulate_step(run_model(run), shape, resolve_hardware("h200"), options, cal)
