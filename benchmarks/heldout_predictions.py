"""Predicts the rows of a layouts file (published runs written down without their published throughput, e.g.
benchmarks/heldout-2026-12-03-layouts.yaml) with the step simulator as committed: issue 38's held-out third,
predicted before being added to llamatron/planning/simulator/published_runs.yaml.

usage: python benchmarks/heldout_predictions.py benchmarks/heldout-2026-12-03-layouts.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from llamatron.planning.simulator.published_runs import predict


def layout_text(r: dict) -> str:
    pp = f"pp {r['pp']}" + (f" x vpp {r['vpp']}" if r["vpp"] > 1 else "")
    dp = r["gpus"] // (r["tp"] * r["pp"] * r["cp"])
    parts = [f"tp {r['tp']}", pp, f"dp {dp}"] + [f"{k} {r[k]}" for k in ("cp", "ep") if r[k] > 1]
    return ", ".join(parts + [f"mb {r['micro_batch_size']}", f"gbs {r['global_batch_size']}", f"seq {r['seq_length']}"])


def main(path: str) -> None:
    rows = yaml.safe_load(Path(path).read_text())["runs"]
    print("| run | GPUs | layout | precision | predicted | unit | predicted MFU | step s | checked |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        # the published figure is not in the file: a placeholder of 1 in the unit the source gives (`measured`,
        # tokens/s per GPU unless it says tflops_per_gpu) leaves the prediction itself untouched
        unit = r.get("measured", "tokens_per_sec_per_gpu")
        p = predict({**r, unit: 1})
        res = p.sim.result
        checked = "no: " + r["excluded"].split(":")[0].split(" (")[0] if r.get("excluded") else "yes"
        print(
            f"| {r['name']} | {r['gpus']} | {layout_text(r)} | {r['precision']} | {p.predicted:,.1f} | {p.unit} | "
            f"{res.mfu:.1%} | {res.step_seconds:.3f} | {checked} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
