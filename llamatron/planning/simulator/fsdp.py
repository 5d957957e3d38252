"""--fsdp in the simulated step (parallel/fsdp.py's ShardedBuffer, as it runs today).

Per micro-batch and decoder layer on a rank (shard group s: --fsdp-shard-group N, else dp x cp; the experts' own
buffer over the dp x cp / ep ranks holding them):
  forward   the layer's bf16 weights all-gathered ((s-1)/s of them from the others); the gather of layer i+1
            is issued before layer i computes (prefetch), so only what outlasts layer i's forward is exposed;
            the first unit of each chunk's forward (the embedding on the first) is waited for in full
  backward  the gather again (not with --fsdp-keep-params-in-backward, whose layers stay gathered) and the
            reduce-scatter of the layer's whole fp32 gradient (bf16 with --grad-reduce-dtype bf16), one after the
            other on the group's stream, beside the layer's backward: exposed what outlasts it
  hybrid    each reduce-scattered shard all-reduced over the groups holding the same shard (--fsdp-shard-group),
            a blocking dist.all_reduce on the compute stream: exposed in full (not overlapped today)
The hidden part slows the compute beside it by its bytes / the contention bandwidth, at most by the time it runs
there, as for the data-parallel buckets. Every micro-batch gathers and reduces again (nothing is kept across
micro-batches); the end of the step waits for the first unit's last reduce-scatter. No bucket is reduced at the end
of the step and no parameter all-gather follows the optimizer: the optimizer updates the shard in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Collective = Callable[[str, float, int, int], float]  # (kind, bytes, ranks, ranks per node) -> seconds


@dataclass(frozen=True)
class FsdpOptions:
    dense_shards: int  # ranks the dense weights are sharded over
    expert_shards: int = 1  # ranks each expert is sharded over
    replicate: int = 1  # hybrid sharding: groups holding the same shard
    keep_params: bool = False  # --fsdp-keep-params-in-backward
    expert_stride: int = 1  # replicas between two holding the same experts (ep)


@dataclass(frozen=True)
class FsdpTraffic:
    """One micro-batch's --fsdp collectives for one decoder layer (seconds, and bytes off this rank)."""

    gather: float
    reduce: float
    all_reduce: float  # hybrid sharding's, exposed
    gather_bytes: float
    reduce_bytes: float


def layer_traffic(
    fs: FsdpOptions,
    dense: float,
    experts: float,
    act_bytes: int,
    grad_bytes: int,
    collective: Collective,
    per_node: Callable[[int, int], int],
) -> FsdpTraffic:
    """dense, experts: a layer's elements on this rank before sharding; per_node(stride, size): members of a
    group of `size` ranks `stride` replicas apart that share a node."""
    gather = reduce = 0.0
    gather_bytes = reduce_bytes = 0.0
    for numel, shards, stride in ((dense, fs.dense_shards, 1), (experts, fs.expert_shards, fs.expert_stride)):
        if shards > 1 and numel > 0:
            local = per_node(stride, shards)
            gather += collective("all_gather", numel * act_bytes, shards, local)
            reduce += collective("reduce_scatter", numel * grad_bytes, shards, local)
            gather_bytes += numel * act_bytes * (shards - 1) / shards
            reduce_bytes += numel * grad_bytes * (shards - 1) / shards
    all_reduce = 0.0
    if fs.replicate > 1:
        size = dense / fs.dense_shards * grad_bytes
        all_reduce = collective("all_reduce", size, fs.replicate, per_node(fs.dense_shards, fs.replicate))
    return FsdpTraffic(gather, reduce, all_reduce, gather_bytes, reduce_bytes)


def exposed_per_micro_batch(
    t: FsdpTraffic, fs: FsdpOptions, layer_forward: list[float], layer_backward: float, contention_bw: float
) -> tuple[float, float, float, float]:
    """(forward exposed, backward exposed, forward contention, backward contention) seconds of one chunk's
    layers for one micro-batch (the module docstring)."""
    if not layer_forward or (t.gather == 0 and t.all_reduce == 0):
        return 0.0, 0.0, 0.0, 0.0
    fwd = t.gather + sum(max(0.0, t.gather - f) for f in layer_forward[:-1])  # the first waited for, the rest hidden
    hidden_fwd = sum(min(t.gather, f) for f in layer_forward[:-1])
    regather = 0.0 if fs.keep_params else t.gather
    busy = regather + t.reduce
    n = len(layer_forward)
    back = n * (max(0.0, busy - layer_backward) + t.all_reduce)
    hidden_back = n * min(busy, layer_backward)
    share_fwd = t.gather_bytes / t.gather if t.gather else 0.0
    bytes_back = (0.0 if fs.keep_params else t.gather_bytes) + t.reduce_bytes
    share_back = bytes_back / busy if busy else 0.0
    # A collective slows the compute beside it by at most the time it runs there (the compute's kernels and the
    # collective's sharing the GPU one after the other): its bytes / contention bandwidth, up to its hidden time.
    rate_fwd, rate_back = min(1.0, share_fwd / contention_bw), min(1.0, share_back / contention_bw)
    return fwd, back, hidden_fwd * rate_fwd, hidden_back * rate_back
