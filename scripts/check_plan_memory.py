"""Measured vs predicted peak GPU memory: a few synthetic training steps against `llamatron.planning.plan`.

    python scripts/check_plan_memory.py --model llama-1b --seq-length 4096 --micro-batch-size 4 \
        --global-batch-size 8 [--nproc-per-node 2 --tp 2 --sequence-parallel ...] [--dry-run]

Any `llamatron train` flag is accepted. The run uses --mock-data and a few steps; the measured figure is the
largest `peak_mem_gib` (torch.cuda.max_memory_allocated) of the metrics file, compared with the planner's
`allocated` (what the allocator should have handed out at the peak). Prints one JSON line. With several
processes the metrics come from the logging rank, which need not be the busiest pipeline stage (`stage`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from llamatron.config.settings import add_config_arguments, load_config  # noqa: E402
from llamatron.planning.plan import predict_peak_memory  # noqa: E402


def _without(argv: list[str], drop: dict[str, int]) -> list[str]:
    """argv minus this script's own options (name -> number of values it takes)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg.split("=")[0] in drop:
            skip = 0 if "=" in arg else drop[arg]
        else:
            out.append(arg)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes (GPUs) to run on")
    parser.add_argument("--steps", type=int, default=3, help="training steps to measure over")
    parser.add_argument("--dry-run", action="store_true", help="print the prediction only")
    args, _ = parser.parse_known_args()
    train_flags = _without(sys.argv[1:], {"--dry-run": 0, "--steps": 1})
    cfg = load_config(args)
    cfg.data.mock_data = True
    cfg.train.train_steps = args.steps
    predicted = predict_peak_memory(cfg, args.nproc_per_node)
    row = {
        "stage": predicted["stage"],
        "predicted_allocated_gib": round(predicted["allocated_gib"], 2),
        "predicted_total_gib": round(predicted["total_gib"], 2),
        "breakdown_gib": {
            k: round(predicted[k] / 2**30, 2) for k in ("weights", "gradients", "optimizer", "activations", "buffers")
        },
        "buffers_gib": {k: round(v / 2**30, 2) for k, v in predicted["buffer_parts"].items()},
        "flags": train_flags,
    }
    if not args.dry_run:
        with tempfile.TemporaryDirectory() as tmp:
            metrics = Path(tmp) / "metrics.jsonl"
            cmd = [
                sys.executable,
                "-m",
                "llamatron",
                "train",
                *train_flags,
                "--mock-data",
                "--train-steps",
                str(args.steps),
                "--no-progress",
                "--eval-iters",
                "1",
                "--metrics-file",
                str(metrics),
            ]
            subprocess.run(cmd, check=True)
            steps = [json.loads(line) for line in metrics.read_text().splitlines()]
            measured = max(r["peak_mem_gib"] for r in steps if r.get("split") is None)
        row.update(measured_gib=round(measured, 2), ratio=round(predicted["allocated_gib"] / measured, 3))
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
