"""The pipeline part of a step as a timeline: every rank runs llamatron's schedule (parallel/schedules.py:
1F1B, or interleaved with vpp > 1) with real durations, each action as soon as its rank is free and its
input has arrived (the neighbour's output plus the point-to-point transfer).

ZB-H1 (zero bubble, Qi et al. 2023, arXiv 2401.10241): the backward is split into B (input gradients, which
the previous stage waits for) and W (weight gradients, which nobody waits for). A rank runs its F and B in the
1F1B order and a pending W whenever it would otherwise wait, or before a forward that would hold more
micro-batches than 1F1B's first rank does (ZB-H1's peak activation memory is 1F1B's); the Ws left drain. Not built
in the trainer: the simulator predicts what it would gain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ...parallel.schedules import Action, max_alive, rank_order


@dataclass(frozen=True)
class Event:
    rank: int
    kind: str  # "F", "B" (the whole backward, or its input half under ZB-H1), "W", "dp-rs", "dp-ag", "opt"
    chunk: int
    micro_batch: int
    start: float
    end: float
    issued: float = -1.0  # collectives: when issued (they may wait for the stream); -1: at start

    @property
    def issue_time(self) -> float:
        return self.start if self.issued < 0 else self.issued


@dataclass
class ChunkDurations:
    forward: float
    backward: float  # under ZB-H1 the input-gradient part only (recompute included)
    weight: float  # ZB-H1's W (0 otherwise: it is inside backward)


def run_pipeline(
    pp: int,
    vpp: int,
    micro_batches: int,
    chunks: list[ChunkDurations],
    p2p: float,
    zero_bubble: bool = False,
    first_forward: Callable[[int, float], float] | None = None,
    forward_only: bool = False,
) -> list[Event]:
    """Every rank's actions with their start and end times. first_forward(chunk, start) -> end: the first
    forward of each chunk, which waits layer by layer for its parameters' all-gather. forward_only: the
    forward-only schedule (evaluation's, global-batch balancing's routing pass), which holds nothing."""
    orders = [deque(rank_order(pp, vpp, r, micro_batches, forward_only)) for r in range(pp)]
    # ZB-H1 lets every rank hold as many micro-batches as 1F1B's first rank (its peak memory): later ranks defer Ws
    caps = [max_alive(pp, vpp, 0 if zero_bubble else r, micro_batches) for r in range(pp)]
    if forward_only:
        caps = [micro_batches * vpp] * pp
    free, held = [0.0] * pp, [0] * pp
    pending: list[deque[Action]] = [deque() for _ in range(pp)]
    end: dict[tuple[bool, int, int], float] = {}
    started: set[int] = set()
    events: list[Event] = []
    last = pp * vpp - 1
    while any(orders) or any(pending):
        choice = None
        for r in range(pp):
            a = orders[r][0] if orders[r] else None
            ready = _ready(a, end, p2p, last) if a is not None else None
            idle = a is None or ready is None or ready > free[r] or (a.forward and held[r] >= caps[r])
            if zero_bubble and pending[r] and idle:
                cand = (free[r], r, "W")
            elif a is not None and ready is not None:
                cand = (max(free[r], ready), r, "A")
            else:
                continue
            if choice is None or cand < choice:
                choice = cand
        if choice is None:
            raise RuntimeError(f"the simulated pipeline deadlocks (pp={pp}, vpp={vpp}, m={micro_batches})")
        start, r, what = choice
        if what == "W":
            w = pending[r].popleft()
            stop = start + chunks[w.chunk].weight
            held[r] -= 1
            events.append(Event(r, "W", w.chunk, w.micro_batch, start, stop))
        else:
            a = orders[r].popleft()
            d = chunks[a.chunk]
            if a.forward:
                held[r] += 1
                if first_forward is not None and a.chunk not in started:
                    stop = first_forward(a.chunk, start)
                else:
                    stop = start + d.forward
                started.add(a.chunk)
            else:
                stop = start + d.backward
                if zero_bubble:
                    pending[r].append(a)
                else:
                    held[r] -= 1
            end[(a.forward, a.chunk, a.micro_batch)] = stop
            events.append(Event(r, "F" if a.forward else "B", a.chunk, a.micro_batch, start, stop))
        free[r] = stop
    return events


def _ready(a: Action, end: dict, p2p: float, last: int) -> float | None:
    """When the input of `a` is on its rank (0 for the first chunk's forwards), None while not yet known."""
    if a.forward:
        if a.chunk == 0:
            return 0.0
        t = end.get((True, a.chunk - 1, a.micro_batch))
        return None if t is None else t + p2p
    if a.chunk == last:
        return end.get((True, a.chunk, a.micro_batch))
    t = end.get((False, a.chunk + 1, a.micro_batch))
    return None if t is None else t + p2p
