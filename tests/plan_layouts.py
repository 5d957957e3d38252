"""The planner's Layout written as the planner's tests write it: its sizes in order (Layout itself, a ParallelLayout
with recompute and the batch, takes keywords only: parallel/layout.py)."""

from __future__ import annotations

from typing import Any

from llamatron.planning.layout import Layout


def planned(
    tp: int,
    pp: int,
    vpp: int,
    dp: int,
    sequence_parallel: bool,
    distributed_optimizer: bool,
    recompute: str,
    micro_batch_size: int,
    global_batch_size: int,
    **more: Any,
) -> Layout:
    """Layout(tp=tp, pp=pp, ...): the nine fields every planner layout gives, in order; `more` by name."""
    return Layout(
        tp=tp,
        pp=pp,
        vpp=vpp,
        dp=dp,
        sequence_parallel=sequence_parallel,
        distributed_optimizer=distributed_optimizer,
        recompute=recompute,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        **more,
    )
