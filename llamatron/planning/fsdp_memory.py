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
  reduce     each unit's whole fp32 gradient is collected (a zeroed staging buffer) until its last parameter's
             gradient arrives, then reduce-scattered (from a bf16 copy with --grad-reduce-dtype bf16); the input
             lives until the reduce-scatter is finished, which ShardedBuffer does for the oldest as soon as more
             than fsdp.MAX_REDUCING are in flight: at the moment one is issued, MAX_REDUCING + 1 inputs (with
             their output shards; counted as the largest unit and MAX_REDUCING layers) and the next layer's
             staging are alive, during backward. The dense and expert buffers each hold theirs.
A buffer whose shard group is one rank holds the whole bucket as its shard: nothing gathered, nothing reduced.
"""

from __future__ import annotations

from ..models import ModelConfig
from ..models.inventory import final_norm_params
from ..parallel.fsdp import MAX_REDUCING
from .layout import Layout, Precision
from .params import bytes_per_param, expert_layer_params, layer_shards, local_vocab, stage_params


def fsdp_state_bytes(
    model: ModelConfig, lay: Layout, prec: Precision, layers: int, rank: int
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes of pipeline rank `rank` (holding `layers` decoder layers)."""
    params = stage_params(model, lay.tp, lay.pp, rank, layers, lay.ep)[0]
    experts = layers * expert_layer_params(model, lay.tp, lay.ep)
    held = (params - experts) / lay.dense_shards + experts / lay.expert_shards
    w, g, o = bytes_per_param(prec.dtype, True, 1)
    return w * held, g * held, o * held


def _whole(model: ModelConfig, lay: Layout, rank: int, layers: int) -> tuple[float, float, float, float, float]:
    """Elements of this rank's units that exist whole only when gathered: (per decoder layer, embedding, head
    unit, the stage's dense ones, the stage's experts); a buffer sharded over one rank gathers nothing."""
    dense, experts = layer_shards(model, lay.tp, lay.ep)
    dense_gathers, expert_gathers = lay.dense_shards > 1, lay.expert_shards > 1
    layer = dense * dense_gathers + experts * expert_gathers
    rows = local_vocab(model, lay.tp) * model.hidden_size
    embed = rows * dense_gathers if rank == 0 else 0.0
    head = 0.0
    if rank == lay.pp - 1 and dense_gathers:
        head = final_norm_params(model) + (rows if not model.tie_embeddings or lay.pp > 1 else 0)
    return layer, embed, head, dense * dense_gathers * layers + embed + head, experts * expert_gathers * layers


def fsdp_buffers(model: ModelConfig, lay: Layout, prec: Precision, layers: int, rank: int) -> dict[str, float]:
    """Bytes of the gathered units and of the gradients being reduced (module docstring) on pipeline rank `rank`,
    at their peak."""
    layer, embed, head, dense, experts = _whole(model, lay, rank, layers)
    a = prec.act_bytes
    if lay.fsdp_keep_params:
        gathered = dense + experts
    else:
        tied_kept = embed if model.tie_embeddings and lay.pp == 1 else 0.0
        gathered = max(2 * layer, embed + layer, head + layer) + (lay.vpp - 1) * layer + tied_kept
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
