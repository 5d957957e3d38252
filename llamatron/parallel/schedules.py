"""Pipeline schedules: what each rank computes, in which order, and when it sends and receives.

Model chunks are numbered globally c = 0 .. pp*vpp-1 in model order; chunk c
lives on pipeline rank c % pp, as local chunk c // pp (so with vpp > 1 every
rank holds vpp chunks spread over the depth of the model).

1F1B (vpp = 1): rank r runs pp-r-1 warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards. At most pp-r
micro-batches have activations alive on rank r.

Interleaved 1F1B (vpp > 1): micro-batches move through in groups of pp. A
rank's k-th forward runs local chunk (k // pp) % vpp on micro-batch
(k // (pp*vpp))*pp + k % pp; its k-th backward the same with the chunks in
reverse. (vpp-1)*pp + pp-r-1 warm-up forwards keep at most pp*vpp chunk
activations alive on rank r: each chunk holds 1/vpp of the rank's layers, so
that is the memory of pp whole-stage micro-batches, the same as 1F1B.
(Megatron-LM warms up pp-r-1 more; in a simulation with a backward twice as
long as a forward this buys nothing unless transfers are slow.)

Communication: a unit-time simulation of all ranks gives every action a tick
(the earliest after its input was produced and the rank's previous action
ran). Everything produced at tick t travels in round t: each rank issues one
batch_isend_irecv per round it takes part in, holding exactly the messages of
that round it sends or receives, so the two ends of every message sit in
matching batches (NCCL leaves batches that do not pair up undefined), and
rounds are issued in increasing t everywhere, one global order, which cannot
deadlock on gloo or on NCCL's single stream per communicator. A rank issues a
round as soon as it holds its own send of that round, so receives are posted
ahead, and waits on a round only right before the action that needs its data.
Sends and receives between two ranks match in order, so no shape or tag
travels with the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from ..errors import ConfigError


class Action(NamedTuple):  # a tuple: the step simulator builds hundreds of thousands
    forward: bool
    chunk: int  # global chunk index
    micro_batch: int


@dataclass(frozen=True)
class Message:
    """One activation (forward) or gradient (backward) moving between neighbouring chunks."""

    grad: bool  # False: activation into `chunk`; True: gradient of `chunk`'s output
    chunk: int  # the chunk that consumes the message
    micro_batch: int
    src: int  # pipeline ranks
    dst: int


@dataclass
class Round:
    """The messages produced at one tick that this rank sends or receives: one batch_isend_irecv."""

    tick: int
    messages: list[Message]


@dataclass
class Step:
    """Issue `rounds` in order (sends where src is this rank), then run `action` if any."""

    rounds: list[Round] = field(default_factory=list)
    action: Action | None = None


def schedule_problems(num_micro_batches: int, pp: int, vpp: int) -> list[str]:
    """Why no schedule can run `num_micro_batches` per step on pp ranks of vpp chunks (empty when one can).
    The chunks themselves (vpp needs pp > 1, layers per chunk) are the pipeline's rules (pipeline.py)."""
    if num_micro_batches < 1:
        return ["the pipeline needs at least one micro-batch per step"]
    if vpp > 1 and num_micro_batches % pp:
        return [
            f"the interleaved schedule runs micro-batches in groups of pp={pp}, but a step has "
            f"{num_micro_batches}; make micro-batches per step (global batch / (micro batch x dp)) a multiple "
            f"of pp={pp}: raise --global-batch-size"
        ]
    return []


def check_micro_batches(num_micro_batches: int, pp: int, vpp: int) -> None:
    problems = schedule_problems(num_micro_batches, pp, vpp)
    if problems:
        raise ConfigError("; ".join(problems))


def max_alive(pp: int, vpp: int, rank: int, num_micro_batches: int) -> int:
    """Most chunk activations (micro-batches awaiting backward) rank `rank` holds at once."""
    return min(warmup_forwards(pp, vpp, rank) + 1, num_micro_batches * vpp)


def warmup_forwards(pp: int, vpp: int, rank: int) -> int:
    return (vpp - 1) * pp + pp - rank - 1


def rank_order(pp: int, vpp: int, rank: int, num_micro_batches: int, forward_only: bool = False) -> list[Action]:
    """The actions of one rank in the order it runs them."""
    total = num_micro_batches * vpp

    def at(k: int, forward: bool) -> Action:
        v = (k // pp) % vpp if vpp > 1 else 0
        mb = (k // (pp * vpp)) * pp + k % pp if vpp > 1 else k
        return Action(forward, (v if forward else vpp - 1 - v) * pp + rank, mb)

    if forward_only:
        return [at(k, True) for k in range(total)]
    warmup = min(warmup_forwards(pp, vpp, rank), total)
    order = [at(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [at(warmup + k, True), at(k, False)]
    order += [at(k, False) for k in range(total - warmup, total)]
    return order


def input_message(a: Action, pp: int, chunks: int) -> Message | None:
    """What an action waits for from another rank."""
    if a.forward and a.chunk > 0:
        return Message(False, a.chunk, a.micro_batch, (a.chunk - 1) % pp, a.chunk % pp)
    if not a.forward and a.chunk < chunks - 1:
        return Message(True, a.chunk, a.micro_batch, (a.chunk + 1) % pp, a.chunk % pp)
    return None


def output_message(a: Action, pp: int, chunks: int) -> Message | None:
    """What an action sends to another rank."""
    if a.forward and a.chunk < chunks - 1:
        return Message(False, a.chunk + 1, a.micro_batch, a.chunk % pp, (a.chunk + 1) % pp)
    if not a.forward and a.chunk > 0:
        return Message(True, a.chunk - 1, a.micro_batch, a.chunk % pp, (a.chunk - 1) % pp)
    return None


def simulate(orders: list[list[Action]], pp: int, vpp: int) -> dict[Action, int]:
    """The tick at which every action runs when each rank runs its order as early as its inputs allow."""
    chunks = pp * vpp
    tick_of: dict[Action, int] = {}
    pos = [0] * pp
    tick = 0
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        ran = []
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            a = orders[r][pos[r]]
            # Its own forward ran earlier in the rank's order; wait only for the neighbour's output.
            needs = input_message(a, pp, chunks) is not None
            dep = Action(a.forward, a.chunk + (-1 if a.forward else 1), a.micro_batch)
            if not needs or tick_of.get(dep, tick) < tick:
                ran.append(a)
                pos[r] += 1
        if not ran:
            stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
            raise RuntimeError(f"pipeline schedule deadlocks (pp={pp}, vpp={vpp}) at {stuck}")
        for a in ran:
            tick_of[a] = tick
        tick += 1
    return tick_of


@lru_cache(maxsize=64)
def build_program(pp: int, vpp: int, num_micro_batches: int, rank: int, forward_only: bool = False) -> tuple[Step, ...]:
    """This rank's steps: its actions, each preceded by the communication rounds it can issue by then."""
    check_micro_batches(num_micro_batches, pp, vpp)
    chunks = pp * vpp
    orders = [rank_order(pp, vpp, r, num_micro_batches, forward_only) for r in range(pp)]
    tick_of = simulate(orders, pp, vpp)
    by_tick: dict[int, list[Message]] = {}
    for a, tick in tick_of.items():
        m = output_message(a, pp, chunks)
        if m is not None and rank in (m.src, m.dst):
            by_tick.setdefault(tick, []).append(m)
    rounds = [Round(t, sorted(ms, key=lambda m: m.src)) for t, ms in sorted(by_tick.items())]
    produced: set[Message] = set()
    steps: list[Step] = []
    next_round = 0

    def issuable() -> list[Round]:
        # A round without a send of ours can go any time; one with a send only once we computed it.
        nonlocal next_round
        out = []
        while next_round < len(rounds):
            if any(m.src == rank and m not in produced for m in rounds[next_round].messages):
                break
            out.append(rounds[next_round])
            next_round += 1
        return out

    for a in orders[rank]:
        steps.append(Step(issuable(), a))
        out = output_message(a, pp, chunks)
        if out is not None:
            produced.add(out)
    steps.append(Step(issuable(), None))
    if next_round != len(rounds):
        raise RuntimeError("pipeline program left messages unissued")  # a bug in the ordering above
    return tuple(steps)
