"""The data-parallel side of a simulated step (step.py says what llamatron does): the parameter all-gathers
at its start, the gradient reduce-scatters per bucket as backward fills them, the optimizer, and the parts of
the step on its critical rank."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from ...models import ModelConfig
from .chunks import Bucket, Chunk, buckets
from .costs import Costs, Shape, StepOptions
from .hardware import Hardware
from .timeline import Event


@dataclass
class Finished:
    step_seconds: float
    parts: dict[str, float]
    dp_comm_seconds: float
    dp_exposed_seconds: float
    events: list[Event]


class _Busy:
    """A rank's busy intervals (its pipeline actions: one after another, so sorted and disjoint), for the time a
    collective from `start` to `end` runs beside them (a binary search, not a walk over every action)."""

    def __init__(self, intervals: list[tuple[float, float]]):
        self.starts = [a for a, _ in intervals]
        self.ends = [b for _, b in intervals]
        self.before = list(itertools.accumulate((b - a for a, b in intervals), initial=0.0))  # busy before interval i

    def overlap(self, start: float, end: float) -> float:
        first = bisect.bisect_right(self.ends, start)  # the first interval ending after `start`
        stop = bisect.bisect_left(self.starts, end)  # the intervals from `stop` on start at or after `end`
        if first >= stop:
            return 0.0
        inner = self.before[stop] - self.before[first]
        return inner - max(0.0, start - self.starts[first]) - max(0.0, self.ends[stop - 1] - end)


class DataParallel:
    def __init__(self, model: ModelConfig, s: Shape, hw: Hardware, opt: StepOptions, costs: Costs, chunks: list[Chunk]):
        self.model, self.s, self.hw, self.opt, self.costs, self.chunks = model, s, hw, opt, costs, chunks
        # --fsdp reduces per layer and micro-batch inside the chunks' pieces (step.py): no buckets at the step's end
        self.buckets = [[] if opt.fsdp else buckets(ch, c, opt.bucket_size) for c, ch in enumerate(chunks)]
        self.dense_replicas = s.replicas
        self.expert_replicas = s.expert_replicas
        gpn = hw.gpus_per_node
        self.dense_per_node = max(1, min(self.dense_replicas, gpn // s.tp)) if s.tp <= gpn else 1
        self.expert_per_node = max(1, min(self.expert_replicas, gpn // (s.tp * s.ep))) if s.tp * s.ep <= gpn else 1

    def _collective(self, b: Bucket, kind: str, bytes_per: float) -> tuple[float, float]:
        """(seconds, bytes moved) of one bucket's collective over the ranks holding the same weights."""
        n, per_node = (
            (self.expert_replicas, self.expert_per_node) if b.expert else (self.dense_replicas, self.dense_per_node)
        )
        size = b.numel * bytes_per
        return self.costs.collective(kind, size, n, per_node), size * (n - 1) / max(n, 1)

    def _slowdown(self, moved: float, seconds: float, overlapped: float) -> float:
        """Compute lost to a collective of `moved` bytes and `seconds` that runs `overlapped` seconds beside it: its
        bytes there / the contention bandwidth, at most the time it runs there."""
        return overlapped * min(1.0, moved / seconds / self.costs.cal.contention_bandwidth)

    def _rank_chunks(self, rank: int) -> list[int]:
        return [c for c in range(len(self.chunks)) if c % self.s.pp == rank]

    def gathers(self) -> dict[int, list[tuple[Bucket, float, float, float]]]:
        """Per chunk: (bucket, start, end, bytes) of the parameter all-gathers issued at the step's start,
        first layers first, one after another on each rank's stream."""
        out: dict[int, list] = {}
        for rank in range(self.s.pp):
            t = 0.0
            for c in self._rank_chunks(rank):
                out[c] = []
                for b in reversed(self.buckets[c]):
                    seconds, moved = self._collective(b, "all_gather", self.opt.param_gather_bytes)
                    if seconds:
                        out[c].append((b, t, t + seconds, moved))
                        t += seconds
        return out

    def first_forward(self, gathers: dict) -> Callable[[int, float], float]:
        """The first forward of a chunk, each layer waiting for the all-gather of its parameters' bucket."""

        def run(c: int, start: float) -> float:
            chunk, t = self.chunks[c], start
            waits = gathers.get(c, [])
            for j, seconds in enumerate(chunk.layer_forward):
                t = max([t] + [end for b, _, end, _ in waits if 0 <= b.first_layer <= j]) + seconds
            t = max([t] + [end for b, _, end, _ in waits if b.first_layer < 0])
            return t + chunk.forward.seconds - sum(chunk.layer_forward)

        return run

    def finish(self, events: list[Event], gathers: dict, zero_bubble: bool) -> Finished:
        s, opt = self.s, self.opt
        ranks = range(s.pp)
        by_rank: list[list[Event]] = [[] for _ in ranks]
        for e in events:
            by_rank[e.rank].append(e)
        busy = [_Busy([(e.start, e.end) for e in rank_events]) for rank_events in by_rank]
        pipeline_end = [max(e.end for e in rank_events) for rank_events in by_rank]
        dp_events: list[Event] = []
        slowed = [0.0] * s.pp
        comm = [0.0] * s.pp
        for c, items in gathers.items():
            r = c % s.pp
            for _, start, end, moved in items:
                dp_events.append(Event(r, "dp-ag", c, -1, start, end))
                comm[r] += end - start
                slowed[r] += self._slowdown(moved, end - start, busy[r].overlap(start, end))
        ready_end = list(pipeline_end)
        for r in ranks:
            reduced = self._reduce(r, by_rank[r], busy[r], gathers, zero_bubble, dp_events, comm, slowed)
            ready_end[r] = max(ready_end[r], reduced)
        opt_start = max(ready_end)
        owned = [self._owned(r) for r in ranks]
        optimizer = max(self.costs.optimizer(o) for o in owned)
        blocking = 0.0
        if s.distributed_optimizer and not opt.overlap_param_gather:
            blocking = max(
                sum(
                    self._collective(b, "all_gather", opt.param_gather_bytes)[0]
                    for c in self._rank_chunks(r)
                    for b in self.buckets[c]
                )
                for r in ranks
            )
        contention = max(slowed)
        critical = max(ranks, key=lambda r: pipeline_end[r])
        parts, waited = self._parts(by_rank[critical], zero_bubble)
        busy_seconds = sum(e.end - e.start for e in by_rank[critical])
        parts["gather_wait"] = waited
        parts["bubble"] = pipeline_end[critical] - busy_seconds
        parts["dp_exposed"] = opt_start - pipeline_end[critical]
        parts["optimizer"] = optimizer
        parts["dp_gather_blocking"] = blocking
        parts["contention"] = parts.get("contention", 0.0) + contention
        step = opt_start + optimizer + blocking + contention
        for r in ranks:
            dp_events.append(Event(r, "opt", -1, -1, opt_start, opt_start + self.costs.optimizer(owned[r])))
        exposed = max(0.0, parts["dp_exposed"] + waited + blocking)
        return Finished(step, parts, max(comm) + blocking, exposed, events + dp_events)

    def _reduce(
        self,
        r: int,
        rank_events: list[Event],
        busy: _Busy,
        gathers: dict,
        zb: bool,
        out: list,
        comm: list,
        slowed: list,
    ) -> float:
        """Issue rank r's gradient collectives as their buckets fill; returns when the last one ends."""
        opt = self.opt
        kind = "reduce_scatter" if self.s.distributed_optimizer else "all_reduce"
        free = max([end for c in self._rank_chunks(r) for _, _, end, _ in gathers.get(c, [])], default=0.0)
        last_kind = "W" if zb else "B"
        pipeline_end = max(e.end for e in rank_events)
        lasts: dict[int, Event] = {}  # each chunk's last backward (ZB-H1: W) to end
        for e in rank_events:
            if e.kind == last_kind and (e.chunk not in lasts or e.end > lasts[e.chunk].end):
                lasts[e.chunk] = e
        pending = []
        for c in self._rank_chunks(r):
            last = lasts[c]
            for b in self.buckets[c]:
                ready = (
                    last.start + b.ready_fraction * (last.end - last.start) if opt.overlap_grad_reduce else pipeline_end
                )
                pending.append((ready, c, b))
        end = 0.0
        for ready, c, b in sorted(pending, key=lambda p: p[0]):
            seconds, size = self._collective(b, kind, opt.grad_reduce_bytes)
            if not seconds:
                continue
            start = max(ready, free)
            free = end = start + seconds
            out.append(Event(r, "dp-rs", c, -1, start, end, ready))
            comm[r] += seconds
            slowed[r] += self._slowdown(size, seconds, busy.overlap(start, end))
        return end

    def _owned(self, r: int) -> float:
        """Parameters whose optimizer state rank r updates (its shard with the distributed optimizer)."""
        total = 0.0
        for c in self._rank_chunks(r):
            ch = self.chunks[c]
            dense = sum(ch.dense_params) + ch.first_params + ch.last_params
            expert = sum(ch.expert_params)
            if self.opt.fsdp is not None:
                dense, expert = dense / self.opt.fsdp.dense_shards, expert / self.opt.fsdp.expert_shards
            elif self.s.distributed_optimizer:
                dense, expert = dense / self.dense_replicas, expert / self.expert_replicas
            total += dense + expert
        return total

    def _parts(self, rank_events: list[Event], zb: bool) -> tuple[dict[str, float], float]:
        """Seconds by kind over a rank's pipeline actions, and how long its first forwards waited for gathers."""
        parts: dict[str, float] = {}
        waited = 0.0
        for e in rank_events:
            ch = self.chunks[e.chunk]
            pieces = {"F": [ch.forward], "B": [ch.backward] + ([] if zb else [ch.weight]), "W": [ch.weight]}[e.kind]
            nominal = 0.0
            for piece in pieces:
                nominal += piece.seconds
                for k, v in piece.parts.items():
                    parts[k] = parts.get(k, 0.0) + v
            waited += (e.end - e.start) - nominal
        return parts, waited
