"""What --fsdp (parallel/fsdp.py's ShardedBuffer) holds on one pipeline rank, for the planner's memory model.

Read from the code, not from ZeRO-3 in general:
  state      every bucket (one forward unit: the embedding, a decoder layer, the final norm with the head) is
             stored as this rank's 1/s of it: bf16 weights 2, fp32 gradients 4, and the optimizer's fp32 master
             and moments 12 (fp32 runs: 4 + 4 + 8) per element of the shard. s: the shard group (--fsdp-shard-group
             N, else dp x cp); under --ep the experts are a buffer of their own, sharded over the dp x cp / ep
             ranks holding the same experts (so every rank stores 1/(dp x cp) of all experts, whatever ep).
  gathered   a unit's whole weights exist only while gathered: in forward the unit computing and the next one
             (prefetched), in backward the unit and the previous one; the last unit of each chunk (the head, or
             the chunk's last layer) stays from its forward to its backward, and so does a tied embedding that
             the head reads. Under --ep the dense and the expert buffer gather the same layer at once.
             --fsdp-keep-params-in-backward frees nothing before its backward: the whole chunk is gathered.
             Under a pipeline the forwards of later micro-batches run while earlier ones await their backward, so
             what is kept adds up over the rank's chunks: the peak is found by replaying the rank's schedule
             (parallel/schedules.rank_order) with these rules, unit by unit.
  reduce     each unit's whole fp32 gradient is collected (a zeroed staging buffer) until its last parameter's
             gradient arrives, then reduce-scattered (from a bf16 copy with --grad-reduce-dtype bf16); the input
             lives until the reduce-scatter is finished, which ShardedBuffer does for the oldest as soon as more
             than fsdp.MAX_REDUCING are in flight: at the moment one is issued, MAX_REDUCING + 1 inputs (with
             their output shards; counted as the largest unit and MAX_REDUCING layers) and the next layer's
             staging are alive, during backward. The dense and expert buffers each hold theirs.
A buffer whose shard group is one rank holds the whole bucket as its shard: nothing gathered, nothing reduced.
"""

from __future__ import annotations

import functools

from ..models import ModelConfig
from ..models.inventory import final_norm_params
from ..parallel.fsdp import MAX_REDUCING
from ..parallel.schedules import rank_order
from .layout import Layout, Precision
from .muon_cost import matrix_share
from .params import bytes_per_param, expert_layer_params, layer_shards, local_vocab, stage_layers, stage_params


def fsdp_state_bytes(
    model: ModelConfig, lay: Layout, prec: Precision, layers: int, rank: int
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes of pipeline rank `rank` (holding `layers` decoder layers)."""
    params = stage_params(model, lay.tp, lay.pp, rank, layers, lay.ep)[0]
    experts = layers * expert_layer_params(model, lay.tp, lay.ep)
    held = (params - experts) / lay.dense_shards + experts / lay.expert_shards
    w, g, o = bytes_per_param(
        prec.dtype, True, 1, prec.optimizer, matrix_share(model, lay, prec, params - experts, layers)
    )
    o_expert = bytes_per_param(prec.dtype, True, 1, prec.optimizer, 1.0)[2]
    return w * held, g * held, o * (params - experts) / lay.dense_shards + o_expert * experts / lay.expert_shards


def _unit_sizes(model: ModelConfig, lay: Layout, rank: int) -> tuple[float, float, float]:
    """Elements of this rank's units that exist whole only when gathered: (a decoder layer, the embedding, the head
    unit); a buffer sharded over one rank gathers nothing."""
    dense, experts = layer_shards(model, lay.tp, lay.ep)
    dense_gathers, expert_gathers = lay.dense_shards > 1, lay.expert_shards > 1
    layer = dense * dense_gathers + experts * expert_gathers
    rows = local_vocab(model, lay.tp) * model.hidden_size
    embed = rows * dense_gathers if rank == 0 else 0.0
    head = 0.0
    if rank == lay.pp - 1 and dense_gathers:
        head = final_norm_params(model) + (rows if not model.tie_embeddings or lay.pp > 1 else 0)
    return layer, embed, head


def fsdp_buffers(model: ModelConfig, lay: Layout, prec: Precision, rank: int) -> dict[str, float]:
    """Bytes of the gathered units and of the gradients being reduced (module docstring) on pipeline rank `rank`,
    at their peak."""
    layer, embed, head = _unit_sizes(model, lay, rank)
    a = prec.act_bytes
    chunks = tuple(
        (rank == 0 and v == 0, n, rank == lay.pp - 1 and v == lay.vpp - 1)
        for v, n in enumerate(stage_layers(model, lay.pp, lay.vpp, lay.pp_layers)[rank])
    )
    tied = model.tie_embeddings and lay.pp == 1  # the head reads the embedding's weight: kept until its backward
    # the peak comes within the warm-up and the first steady micro-batches; more only repeat them
    micro_batches = min(lay.micro_batches, 2 * lay.pp * lay.vpp)
    states = gathered_sets(chunks, lay.pp, lay.vpp, rank, micro_batches, lay.fsdp_keep_params, tied)
    gathered = max((n * layer + e * embed + h * head for n, e, h in states), default=0.0)  # (no micro-batch: none)
    reduce_bytes = 2 if prec.grad_reduce_dtype == "bf16" else 4
    dense_layer, expert_layer = layer_shards(model, lay.tp, lay.ep)
    reducing = 0.0
    # The largest unit (the head's or the embedding's, first and last in backward) with MAX_REDUCING layers beside.
    for layer_n, largest, shards in (
        (dense_layer, max(dense_layer, embed, head), lay.dense_shards),
        (expert_layer, expert_layer, lay.expert_shards),
    ):
        if shards > 1 and layer_n > 0:
            inputs = largest + MAX_REDUCING * layer_n
            reducing += reduce_bytes * inputs * (1 + 1 / shards) + 4 * layer_n
    return {"gathered": a * gathered, "reduce_inputs": reducing}


@functools.lru_cache(maxsize=4096)
def gathered_sets(
    chunks: tuple[tuple[bool, int, bool], ...], pp: int, vpp: int, rank: int, micro_batches: int, keep: bool, tied: bool
) -> frozenset[tuple[int, int, int]]:
    """What pipeline rank `rank` holds gathered at the moments it gathers more, as (layers, embeddings, heads)
    counts: its schedule replayed with ShardedBuffer's rules (module docstring), unit by unit. chunks: each local
    chunk's (embedding first?, decoder layers, head last?); keep: --fsdp-keep-params-in-backward; tied: the
    embedding is kept after its forward (the head reads it)."""
    kinds = [["embed"] * first + ["layer"] * n + ["head"] * last for first, n, last in chunks]
    gathered: set[tuple[int, int]] = set()
    held = {"layer": 0, "embed": 0, "head": 0}
    states = set()
    for action in rank_order(pp, vpp, rank, micro_batches):
        v = action.chunk // pp
        n = len(kinds[v])
        for u in range(n) if action.forward else reversed(range(n)):
            nearby = u + 1 if action.forward else u - 1
            for unit in ((v, u), (v, nearby)) if 0 <= nearby < n else ((v, u),):  # the unit and the prefetched one
                if unit not in gathered:
                    gathered.add(unit)
                    held[kinds[v][unit[1]]] += 1
            states.add((held["layer"], held["embed"], held["head"]))
            kept = keep or u == n - 1 or (tied and kinds[v][u] == "embed")
            if not action.forward or not kept:  # a unit's backward frees it once its gradients are in
                gathered.discard((v, u))
                held[kinds[v][u]] -= 1
    return frozenset(states)
