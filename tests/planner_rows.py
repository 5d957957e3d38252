"""The planner's closed-form speed model against recorded H200 runs: the compiled rows of
benchmarks/h200_peak_memory.json (tests/test_plan.py) and the FP8 rows of measured_runs.yaml."""

from __future__ import annotations

import argparse
import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

ROWS = json.loads((Path(__file__).parent.parent / "benchmarks" / "h200_peak_memory.json").read_text())["rows"]
SPEED_ROWS = [r for r in ROWS if r["tokens_per_sec_per_gpu"]]


def config_of(flags: str) -> Any:
    """The run configuration of a command line's train flags."""
    from llamatron.config.settings import add_config_arguments, load_config

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return load_config(parser.parse_args(flags.split()))


@lru_cache(maxsize=1)
def _cases() -> list[tuple[Any, Any, int, int, str, float]]:
    """(model, layout, seq, gpus, fp8, measured tokens/s per GPU) of every row."""
    from llamatron.planning import plan as P
    from llamatron.planning.simulator.runs import measured_runs, run_model
    from llamatron.training.validate import validate

    out = []
    for row in SPEED_ROWS:
        cfg = config_of(row["flags"])
        layout = P.run_layout(cfg, validate(cfg, row["gpus"], cuda_available=True).dp)
        out.append(
            (cfg.model_config(), layout, cfg.data.seq_length, row["gpus"], "none", row["tokens_per_sec_per_gpu"])
        )
    for r in measured_runs():
        if r.get("fp8") and not r.get("excluded"):
            layout = P.Layout(
                r["tp"],
                r["pp"],
                r["vpp"],
                r["dp"],
                r["sequence_parallel"],
                r["distributed_optimizer"],
                r["recompute"],
                r["micro_batch_size"],
                r["global_batch_size"],
                cp=r["cp"],
            )
            out.append((run_model(r), layout, r["seq_length"], r["gpus"], r["fp8"], r["tokens_per_sec_per_gpu"]))
    return out


def planner_log_errors(table: dict[str, Any]) -> list[float]:
    from llamatron.planning import plan as P
    from llamatron.planning.simulator.calibration import calibration_from

    speed = P.SpeedAssumptions.from_calibration(calibration_from(table))
    return [
        math.log(P.estimate_speed(model, lay, seq, gpus, 8, speed, fp8=fp8).tokens_per_sec_per_gpu / measured)
        for model, lay, seq, gpus, fp8, measured in _cases()
    ]
