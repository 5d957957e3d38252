"""The planner's closed-form speed model against recorded H200 runs: the compiled rows of
benchmarks/h200_peak_memory.json (tests/test_plan.py) and the FP8 rows of measured_runs.yaml."""

from __future__ import annotations

import argparse
import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from plan_layouts import planned

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
    """(model, layout, seq, gpus, fp8, measured tokens/s per GPU) of every compiled bf16 row."""
    from llamatron.planning import plan as P
    from llamatron.training.validate import validate

    out = []
    for row in SPEED_ROWS:
        cfg = config_of(row["flags"])
        layout = P.run_layout(cfg, validate(cfg, row["gpus"], cuda_available=True).dp)
        out.append(
            (cfg.model_config(), layout, cfg.data.seq_length, row["gpus"], "none", row["tokens_per_sec_per_gpu"])
        )
    return out


@lru_cache(maxsize=1)
def fp8_pairs() -> list[tuple[dict, dict]]:
    """RESULTS.md run 9's FP8 rows with the default kernels, each with the bf16 row of the same call and model."""
    path = Path(__file__).parent.parent / "benchmarks" / "results-2026-12-01-run9-fp8.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    plain = [r for r in rows if r["_tag"] in (f"--fp8 {r['fp8']}", f"fp8-{r['fp8']}")]
    bf16 = {(r["_call"], r["model"]): r for r in plain if r["fp8"] == "none"}
    return [
        (r, bf16[(r["_call"], r["model"])]) for r in plain if r["fp8"] != "none" and (r["_call"], r["model"]) in bf16
    ]


def planner_log_errors(table: dict[str, Any]) -> list[float]:
    """The log error of each compiled row's speed, and of each FP8 row's speed-up over its bf16 pair."""
    from llamatron.models.families import get_preset
    from llamatron.planning import plan as P
    from llamatron.planning.simulator.calibration import calibration_from

    speed = P.SpeedAssumptions.from_calibration(calibration_from(table))
    out = [
        math.log(P.estimate_speed(model, lay, seq, gpus, 8, speed, fp8=fp8).tokens_per_sec_per_gpu / measured)
        for model, lay, seq, gpus, fp8, measured in _cases()
    ]
    for r, base in fp8_pairs():
        lay = planned(1, 1, 1, 1, False, False, "none", r["mbs"], r["gbs"])
        model = get_preset(r["model"])
        pred = [
            P.estimate_speed(model, lay, r["seq"], 1, 8, speed, fp8=f).tokens_per_sec_per_gpu
            for f in ("none", r["fp8"])
        ]
        out.append(math.log(pred[1] / pred[0] / (r["tokens_per_sec"] / base["tokens_per_sec"])))
    return out
