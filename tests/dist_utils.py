"""Run a function in N gloo processes (in-process tests of collectives)."""

from __future__ import annotations

import os
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp
from layout import free_port


def _worker(rank: int, world: int, port: int, fn, args, errors) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world: int, *args) -> None:
    """Run fn(rank, world, *args) on `world` gloo ranks; re-raise the first failure with its traceback."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    if not errors.empty():
        raise AssertionError(errors.get())
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}"
