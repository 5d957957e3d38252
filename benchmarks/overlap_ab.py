"""Overlapped vs non-overlapped data-parallel communication, A/B in one process.

    torchrun --nproc-per-node 2 benchmarks/overlap_ab.py --model llama-1b --seq-length 4096 \
        --micro-batch-size 8 --global-batch-size 16 --distributed-optimizer --compile --rounds 4 --steps 8

One engine is built (and compiled) once; then rounds alternate a block of steps with overlap on
(gradient reduce during backward, parameter gather during the next forward) and a block with it off,
so drift of clocks or temperature hits both alike. Prints one JSON line: the median step time of each
mode over the rounds, every round's numbers, and the speed-up. Any `llamatron train` flag is accepted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from llamatron.config.settings import add_config_arguments, load_config  # noqa: E402
from llamatron.data.batches import (
    micro_batches_for_step,  # noqa: E402
    to_device,  # noqa: E402
)
from llamatron.data.mock import MockDataset  # noqa: E402
from llamatron.parallel.mesh import build_mesh, init_distributed  # noqa: E402
from llamatron.training.bench import state_memory  # noqa: E402
from llamatron.training.engine import build_engine, train_step  # noqa: E402
from llamatron.training.metrics import sync_device  # noqa: E402
from llamatron.training.validate import validate  # noqa: E402


def set_overlap(engine, on: bool) -> None:
    engine.cfg.parallel = dataclasses.replace(engine.cfg.parallel, overlap_grad_reduce=on, overlap_param_gather=on)
    for buf in engine.buffers:
        buf.overlap_grad_reduce = on and buf.dp > 1


def timed_block(engine, batch, first_step: int, steps: int) -> float:
    """Milliseconds per step over `steps` steps, after one untimed step in the new mode."""
    train_step(engine, batch, first_step)
    sync_device(engine.device)
    start = time.perf_counter()
    for i in range(steps):
        out = train_step(engine, batch, first_step + 1 + i)
    float(out["loss"])
    sync_device(engine.device)
    return 1000 * (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config(args)
    cfg.data.mock_data = True
    cfg.train.train_steps = args.warmup + 2 * args.rounds * (args.steps + 1) + 1
    derived = validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), torch.cuda.is_available())
    init_distributed(derived.device)
    mesh = build_mesh(cfg.parallel, cfg.parallel.dp_comm_max_ctas)
    engine = build_engine(cfg, derived, mesh)
    t = cfg.train
    data = MockDataset(engine.model_cfg.vocab_size, cfg.data.seq_length, t.seed)
    batch = to_device(
        micro_batches_for_step(data, 0, t.global_batch_size, t.micro_batch_size, mesh.layout.dp, mesh.dp_rank),
        engine.device,
    )
    for step in range(args.warmup):
        train_step(engine, batch, step)
    step = args.warmup
    times: dict[str, list[float]] = {"overlapped": [], "not_overlapped": []}
    for r in range(args.rounds):
        # Alternate which mode goes first so neither always follows the other.
        order = (True, False) if r % 2 == 0 else (False, True)
        for on in order:
            set_overlap(engine, on)
            times["overlapped" if on else "not_overlapped"].append(timed_block(engine, batch, step, args.steps))
            step += args.steps + 1
    state = state_memory(engine)  # weights + gradients + optimizer state vs the bytes-per-parameter formula
    on, off = statistics.median(times["overlapped"]), statistics.median(times["not_overlapped"])
    row = {
        "model": t.model,
        "gpus": mesh.world_size,
        "dp": mesh.layout.dp,
        "dist_opt": cfg.parallel.distributed_optimizer,
        "grad_reduce_dtype": cfg.parallel.grad_reduce_dtype,
        "dp_comm_max_ctas": cfg.parallel.dp_comm_max_ctas,
        "mbs": t.micro_batch_size,
        "gbs": t.global_batch_size,
        "seq": cfg.data.seq_length,
        "overlapped_ms": on,
        "not_overlapped_ms": off,
        "speedup": off / on,
        "rounds": times,
        **state,
        "torch": torch.__version__,
    }
    if mesh.rank == 0:
        print(json.dumps(row), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
