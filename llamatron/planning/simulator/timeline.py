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

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ...parallel.schedules import Action, max_alive, rank_order


class Event(NamedTuple):  # a tuple: a step has tens of thousands, made fast
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
    orders = [_rank_order(pp, vpp, r, micro_batches, forward_only) for r in range(pp)]
    run = _Run(pp, chunks, p2p, pp * vpp - 1, first_forward)
    if zero_bubble:  # every rank may hold as many micro-batches as 1F1B's first rank (its peak memory)
        cap = micro_batches * vpp if forward_only else max_alive(pp, vpp, 0, micro_batches)
        _zero_bubble(run, orders, [cap] * pp)
    else:
        _in_order(run, orders)
    if any(run.done[r] < len(orders[r]) for r in range(pp)) or any(run.pending):
        raise RuntimeError(f"the simulated pipeline deadlocks (pp={pp}, vpp={vpp}, m={micro_batches})")
    return run.events


class _Run:
    """The timeline as it is built: when each rank is free, when each action's output is there, the events."""

    def __init__(self, pp: int, chunks: list[ChunkDurations], p2p: float, last: int, first_forward: Callable | None):
        self.chunks, self.p2p, self.last, self.first_forward = chunks, p2p, last, first_forward
        self.free = [0.0] * pp
        self.done = [0] * pp  # actions of each rank's order run so far
        self.held = [0] * pp  # micro-batches whose backward (ZB-H1: W) has not run
        self.pending: list[deque[Action]] = [deque() for _ in range(pp)]  # ZB-H1's Ws not yet run
        self.end: dict[tuple[bool, int, int], float] = {}
        self.started: set[int] = set()
        self.events: list[Event] = []

    def ready(self, a: Action) -> float | None:
        return _ready(a, self.end, self.p2p, self.last)

    def act(self, r: int, a: Action, start: float, zero_bubble: bool) -> None:
        """Run rank r's next action `a` from `start`."""
        d = self.chunks[a.chunk]
        if a.forward:
            self.held[r] += 1
            if self.first_forward is not None and a.chunk not in self.started:
                stop = self.first_forward(a.chunk, start)
            else:
                stop = start + d.forward
            self.started.add(a.chunk)
        else:
            stop = start + d.backward
            if zero_bubble:
                self.pending[r].append(a)
            else:
                self.held[r] -= 1
        self.end[(a.forward, a.chunk, a.micro_batch)] = stop
        self.events.append(Event(r, "F" if a.forward else "B", a.chunk, a.micro_batch, start, stop))
        self.free[r] = stop
        self.done[r] += 1

    def weight(self, r: int, start: float) -> None:
        """Run rank r's oldest pending W (ZB-H1) from `start`."""
        w = self.pending[r].popleft()
        stop = start + self.chunks[w.chunk].weight
        self.held[r] -= 1
        self.events.append(Event(r, "W", w.chunk, w.micro_batch, start, stop))
        self.free[r] = stop


def _in_order(run: _Run, orders: list[tuple[Action, ...]]) -> None:
    """1F1B and the forward-only schedule: each action starts once its rank is free and its input is there, which
    fixes every time whatever order the ranks are visited in; a rank runs on until its next input is missing, and
    an action that ends wakes its neighbours (the only ranks waiting for it: chunk c runs on rank c % pp). The
    hot loop of a plan's ranking (tens of thousands of actions a step): _Run.act written out, without ZB-H1's
    bookkeeping."""
    pp, end, p2p, last, events = len(orders), run.end, run.p2p, run.last, run.events
    forward_seconds = [d.forward for d in run.chunks]
    backward_seconds = [d.backward for d in run.chunks]
    first_forward, started = run.first_forward, run.started
    waiting = list(range(pp))
    while waiting:
        r = waiting.pop()
        order, i, free = orders[r], run.done[r], run.free[r]
        while i < len(order):
            a = order[i]
            ready = _ready(a, end, p2p, last)
            if ready is None:
                break
            start = max(free, ready)
            if not a.forward:
                free = start + backward_seconds[a.chunk]
            elif first_forward is not None and a.chunk not in started:
                free = first_forward(a.chunk, start)
                started.add(a.chunk)
            else:
                free = start + forward_seconds[a.chunk]
            end[a] = free  # keyed by the action: (forward, chunk, micro-batch)
            events.append(Event(r, "F" if a.forward else "B", a.chunk, a.micro_batch, start, free))
            i += 1
        if i > run.done[r]:
            run.done[r], run.free[r] = i, free
            waiting.extend({(r + 1) % pp, (r - 1) % pp} - {r})


def _zero_bubble(run: _Run, orders: list[tuple[Action, ...]], caps: list[int]) -> None:
    """ZB-H1: the earliest action of any rank next (ties: the lowest rank), a rank's pending W whenever it would
    otherwise wait or hold more micro-batches than `caps` (1F1B's first rank's: ZB-H1's peak memory)."""
    pp = len(orders)

    def candidate(r: int) -> tuple[float, int, str] | None:
        """What rank r would do next and when (None: nothing it can do yet)."""
        a = orders[r][run.done[r]] if run.done[r] < len(orders[r]) else None
        ready = run.ready(a) if a is not None else None
        idle = a is None or ready is None or ready > run.free[r] or (a.forward and run.held[r] >= caps[r])
        if run.pending[r] and idle:
            return (run.free[r], r, "W")
        if a is not None and ready is not None:
            return (max(run.free[r], ready), r, "A")
        return None

    # A rank's candidate changes only when it acts or a neighbour's action ends: only those are asked again.
    cands = [candidate(r) for r in range(pp)]
    while True:
        choice = min((c for c in cands if c is not None), default=None)
        if choice is None:
            return
        start, r, what = choice
        if what == "W":
            run.weight(r, start)
        else:
            run.act(r, orders[r][run.done[r]], start, True)
        for q in {r, (r + 1) % pp, (r - 1) % pp}:
            cands[q] = candidate(q)


@functools.lru_cache(maxsize=256)
def _rank_order(pp: int, vpp: int, rank: int, micro_batches: int, forward_only: bool) -> tuple[Action, ...]:
    """schedules.rank_order, kept: a plan simulates many layouts of one pipeline shape (Actions are frozen)."""
    return tuple(rank_order(pp, vpp, rank, micro_batches, forward_only))


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
