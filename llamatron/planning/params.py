"""Parameters per rank for the planner (plan.py) and the simulator: of one decoder layer, of a pipeline stage, of
the experts of a mixture of experts. The layers' parameters come from models/inventory.py (the model's own
modules, built on meta) and what one rank keeps of each from parallel/tensor.py's shard_numel."""

from __future__ import annotations

from ..models import ModelConfig
from ..models.inventory import (
    active_params,
    config_key,
    extra_head_layers,
    extra_head_params,
    final_norm_params,
    input_embedding_params,
    layers,
    per_config,
)
from ..optim import bytes_per_param
from ..parallel.pipeline import split_layers
from ..parallel.tensor import padded_vocab_size, shard_numel


def local_vocab(model: ModelConfig, tp: int) -> int:
    """Vocabulary rows of the embedding/head on one tensor-parallel rank."""
    return model.vocab_size if tp == 1 else padded_vocab_size(model.vocab_size, tp) // tp


_SHARDS: dict[tuple, tuple[int, int]] = {}  # a search asks for the same few thousand times


def layer_shards(model: ModelConfig, tp: int = 1, ep: int = 1, index: int | None = None) -> tuple[int, int]:
    """(dense parameters, expert parameters) of decoder layer `index` on one rank: num_experts/ep of a mixture's
    experts, every one split along its ffn over tp. index None: the mean layer (layers of a model may differ: dense
    ones among MoE ones), rounded down."""
    if index is None:
        dense, experts = _layer_totals(model, tp, ep)
        return dense // model.num_layers, experts // model.num_layers
    key = (config_key(model), tp, ep, index)
    if key not in _SHARDS:
        dense = experts = 0
        for w in layers(model)[index].weights:
            n = shard_numel(w.split, w.shape, model, tp)
            if w.split == "expert":
                experts += n // ep
            else:
                dense += n
        if len(_SHARDS) > 4096:
            _SHARDS.clear()
        _SHARDS[key] = dense, experts
    return _SHARDS[key]


def _layer_totals(model: ModelConfig, tp: int, ep: int) -> tuple[int, int]:
    """layer_shards summed over every decoder layer."""
    key = (config_key(model), tp, ep, "total")
    if key not in _SHARDS:
        shards = [layer_shards(model, tp, ep, i) for i in range(model.num_layers)]
        _SHARDS[key] = sum(d for d, _ in shards), sum(e for _, e in shards)
    return _SHARDS[key]


def layer_params(model: ModelConfig, tp: int = 1, ep: int = 1) -> int:
    """Parameters of the mean decoder layer on one tensor-parallel rank (a mixture of experts: the router and the
    num_experts/ep experts this expert-parallel rank holds)."""
    return sum(layer_shards(model, tp, ep))


def stage_layers(model: ModelConfig, pp: int, vpp: int, pp_layers: str | None = None) -> list[list[int]]:
    """Decoder layers of each chunk of each pipeline rank; chunk c (model order) lives on rank c % pp."""
    counts = split_layers(model.num_layers, pp, vpp, pp_layers)
    return [[counts[v * pp + r] for v in range(vpp)] for r in range(pp)]


@per_config
def active_layer_params(model: ModelConfig) -> int:
    """Parameters of one decoder layer that compute one token (all of it for a dense model; the router and
    experts_per_token experts of a mixture of experts): the model's active parameters per layer."""
    embed = model.vocab_size * model.hidden_size * (1 if model.tie_embeddings else 2)
    others = embed + final_norm_params(model) + extra_head_params(model, active=True)
    return (active_params(model) - others) // model.num_layers


def expert_layer_params(model: ModelConfig, tp: int = 1, ep: int = 1) -> int:
    """Of layer_params: the experts' (reduced and sharded over the dp/ep ranks holding the same experts)."""
    return layer_shards(model, tp, ep)[1]


def largest_layer_param(model: ModelConfig, tp: int) -> int:
    """The largest single parameter of a decoder layer on one tensor-parallel rank (a mixture's experts count one
    expert's matrix: the backward of the grouped GEMMs makes one expert's gradient at a time)."""
    key = (config_key(model), tp, "largest")
    if key not in _SHARDS:  # a search asks for it per layout and pipeline rank: hashing every layer each time cost
        sizes = [  # most of a search's time
            shard_numel(w.split, w.shape, model, tp) // (w.shape[0] if w.split == "expert" else 1)
            for layer in set(layers(model))
            for w in layer.weights
        ]
        _SHARDS[key] = max(sizes), 0
    return _SHARDS[key][0]


@per_config
def stage_params(model: ModelConfig, tp: int, pp: int, rank: int, layers: int, ep: int = 1) -> tuple[int, int]:
    """(parameters on pipeline rank `rank`, the largest single parameter there)."""
    h, vocab = model.hidden_size, local_vocab(model, tp)
    count = layers * sum(_layer_totals(model, tp, ep)) // model.num_layers  # the mean layer's, unrounded
    largest = largest_layer_param(model, tp) if layers else 0
    if rank == 0:
        count += vocab * h
        largest = max(largest, vocab * h)
    if rank == pp - 1:
        count += final_norm_params(model)
        if not model.tie_embeddings or pp > 1:  # tied: the last stage keeps a copy of the embedding
            count += vocab * h
            largest = max(largest, vocab * h)
        extra = extra_head_layers(model)  # beside the head; under a pipeline with a copy of the embedding
        count += sum(
            shard_numel(w.split, w.shape, model, tp) // (ep if w.split == "expert" else 1)
            for layer in extra
            for w in layer.weights
        )
        count += vocab * h if extra and pp > 1 else 0
    return count, largest


__all__ = [
    "active_layer_params",
    "bytes_per_param",
    "expert_layer_params",
    "input_embedding_params",
    "layer_params",
    "layer_shards",
    "local_vocab",
    "stage_layers",
    "stage_params",
]
