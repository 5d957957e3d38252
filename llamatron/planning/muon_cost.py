"""What --optimizer muon adds to a step, per rank, for the planner (plan.py's memory, speed.py) and the simulator:
its state (a momentum for each hidden matrix instead of AdamW's two moments: optim's bytes per parameter, given
the matrices' share), the Newton-Schulz FLOPs and the extra traffic (llamatron/optim/muon.py).

Newton-Schulz on an m x n matrix (m <= n) costs, per iteration, X X^T (2 m^2 n), A^2 (2 m^3) and (b A + c A^2) X
(2 m^2 n) FLOPs. Each rank orthogonalises its stage's matrices whole (tp: gathered, every tp rank the whole
matrix), its experts one by one, or with the distributed optimizer / --fsdp only those it owns (1/shards of
them). Traffic: under tp the gather of each matrix's update (fp32, (tp-1) x the local part); sharded, the update
summed onto its owner (fp32) and the result broadcast back (the Newton-Schulz dtype, bf16), each about the local
part per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models import ModelConfig
from ..models.inventory import config_key, layers
from ..optim.muon import is_hidden_matrix
from ..parallel.tensor import shard_numel
from .layout import Layout, Precision

NS_STEPS = 5  # --muon-ns-steps' default
_MATRICES: dict[tuple, tuple[float, float, float]] = {}


def layer_matrices(model: ModelConfig, tp: int, index: int) -> tuple[float, float, float]:
    """(dense matrix elements on one tp rank, their Newton-Schulz FLOPs per iteration whole, the experts' FLOPs per
    iteration for all num_experts of them) of decoder layer `index`."""
    key = (config_key(model), tp, index)
    if key not in _MATRICES:
        elements = dense_flops = expert_flops = 0.0
        for w in layers(model)[index].weights:
            if not is_hidden_matrix(w.kind, tuple(w.shape)):
                continue
            count, (rows, cols) = (w.shape[0], w.shape[1:]) if w.kind == "expert" else (1, w.shape)
            m, n = min(rows, cols), max(rows, cols)
            flops = count * (4.0 * m * m * n + 2.0 * m**3)
            if w.kind == "expert":
                expert_flops += flops
            else:
                dense_flops += flops
                elements += shard_numel(w.split, w.shape, model, tp)
        _MATRICES[key] = elements, dense_flops, expert_flops
    return _MATRICES[key]


def dense_matrix_params(model: ModelConfig, tp: int) -> float:
    """Elements of the mean decoder layer's dense hidden matrices on one tp rank (the experts are all matrices)."""
    return sum(layer_matrices(model, tp, i)[0] for i in range(model.num_layers)) / model.num_layers


def matrix_share(model: ModelConfig, lay: Layout, prec: Precision, dense: float, layers_here: int) -> float:
    """The hidden matrices' share of a pipeline rank's `dense` (non-expert) parameters: Muon keeps one fp32 state
    tensor for them, two for the rest (0 for other optimizers, which ignore it)."""
    if prec.optimizer != "muon" or dense <= 0:
        return 0.0
    return min(1.0, layers_here * dense_matrix_params(model, lay.tp) / dense)


@dataclass(frozen=True)
class MuonCost:
    """Per optimizer step on the busiest pipeline rank."""

    flops: float  # Newton-Schulz
    tp_bytes: float  # the updates' gather over tp (NVLink)
    dp_bytes: float  # the updates' sum onto their owners and the results' broadcast (the shard group)


def muon_cost(model: ModelConfig, lay: Layout, layers_here: float, ns_steps: int = NS_STEPS) -> MuonCost:
    """What Muon adds on a pipeline rank holding `layers_here` decoder layers (the model's mean layer)."""
    per_layer = [layer_matrices(model, lay.tp, i) for i in range(model.num_layers)]
    elements = sum(e for e, _, _ in per_layer) / model.num_layers * layers_here
    dense = sum(d for _, d, _ in per_layer) / model.num_layers * layers_here
    experts = sum(x for _, _, x in per_layer) / model.num_layers * layers_here / lay.ep
    expert_elements = experts and layers_here * _mean_expert_elements(model, lay)
    sharded = lay.fsdp or lay.distributed_optimizer
    dense_owned, expert_owned = (lay.dense_shards, lay.expert_shards) if sharded else (1, 1)
    flops = ns_steps * (dense / dense_owned + experts / expert_owned)
    tp_bytes = 4.0 * (lay.tp - 1) * (elements / dense_owned + expert_elements / expert_owned)
    dp_bytes = 0.0
    if sharded:
        dp_bytes = 6.0 * (elements * _moved(dense_owned) + expert_elements * _moved(expert_owned))
    return MuonCost(flops, tp_bytes, dp_bytes)


def _moved(shards: int) -> float:
    return (shards - 1) / shards


def _mean_expert_elements(model: ModelConfig, lay: Layout) -> float:
    """Elements of the mean layer's experts on one rank (num_experts/ep, each split over tp)."""
    total = sum(
        shard_numel(w.split, w.shape, model, lay.tp)
        for layer in layers(model)
        for w in layer.weights
        if w.kind == "expert"
    )
    return total / model.num_layers / lay.ep
