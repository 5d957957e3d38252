"""Sliding window against plain causal, steps alternating in one process (issue 18's 1.3×).

    python benchmarks/window_ab.py --model llama-1b --seq-length 8192 --micro-batch-size 4 \\
        --global-batch-size 4 --compile --window 1024 --rounds 12

Two engines, one causal and one with `sliding_window: --window`, built from the same flags; after warm-up
each round times one step of each, the order swapped every round, so both see the same clocks and power
(on an H200 the SM clock moves between ~1.4 and ~1.9 GHz with the load, and back-to-back processes differ
by a few percent). Prints one JSON line: each side's per-step ms, their medians and the ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from profile_step import engine_and_batch  # noqa: E402

from llamatron.config.settings import add_config_arguments  # noqa: E402
from llamatron.training.engine import train_step  # noqa: E402
from llamatron.training.metrics import Timer, sync_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    steps = args.warmup + args.rounds
    sides = {
        "causal": engine_and_batch(args, steps),
        "window": engine_and_batch(args, steps, {"sliding_window": args.window}),
    }
    for engine, batch in sides.values():
        for step in range(args.warmup):
            train_step(engine, batch, step)
    ms: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in sorted(sides, reverse=bool(r % 2)):
            engine, batch = sides[name]
            sync_device(engine.device)
            timer = Timer(engine.device)
            train_step(engine, batch, args.warmup + r)
            ms[name].append(round(1000 * timer.elapsed(), 2))
    med = {name: statistics.median(v) for name, v in ms.items()}
    per_round = sorted(c / w for c, w in zip(ms["causal"], ms["window"]))
    print(
        json.dumps(
            {
                "median_ms": med,
                "ratio_of_medians": round(med["causal"] / med["window"], 4),
                "per_round_ratio_min_median_max": [
                    round(per_round[0], 4),
                    round(statistics.median(per_round), 4),
                    round(per_round[-1], 4),
                ],
                "ms": ms,
                "sliding_window": {name: engine.model_cfg.sliding_window for name, (engine, _) in sides.items()},
                "args": sys.argv[1:],
            }
        )
    )


if __name__ == "__main__":
    main()
