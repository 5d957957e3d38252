"""Does the host keep ahead of the GPU? Per step: the host's time to enqueue train_step, and the step's time.

    python benchmarks/host_time.py --model llama-1b --seq-length 8192 --micro-batch-size 4 \\
        --global-batch-size 4 --compile [--config window.yaml]

train_step makes no host sync, so when enqueueing a step takes as long as running it, the GPU waited on the
host (launch overhead) rather than the other way round. Prints one JSON line: per-step host and wall ms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from profile_step import engine_and_batch  # noqa: E402

from llamatron.config.settings import add_config_arguments  # noqa: E402
from llamatron.training.engine import train_step  # noqa: E402
from llamatron.training.metrics import sync_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    engine, batch = engine_and_batch(args, args.warmup + args.steps)
    for step in range(args.warmup):
        train_step(engine, batch, step)
    host, wall = [], []
    for step in range(args.steps):
        sync_device(engine.device)
        start = time.perf_counter()
        train_step(engine, batch, args.warmup + step)
        host.append(1000 * (time.perf_counter() - start))
        sync_device(engine.device)
        wall.append(1000 * (time.perf_counter() - start))
    print(json.dumps({"host_ms": [round(h, 1) for h in host], "wall_ms": [round(w, 1) for w in wall]}))


if __name__ == "__main__":
    main()
