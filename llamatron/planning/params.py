"""Parameters per rank for the planner (plan.py): of one decoder layer, of a pipeline stage, of the experts
of a mixture of experts, and the bytes each parameter costs (weights, gradients, optimizer state)."""

from __future__ import annotations

from ..models import ModelConfig
from ..parallel.pipeline import split_layers
from ..parallel.tensor import local_kv_heads, padded_vocab_size


def local_vocab(model: ModelConfig, tp: int) -> int:
    """Vocabulary rows of the embedding/head on one tensor-parallel rank."""
    return model.vocab_size if tp == 1 else padded_vocab_size(model.vocab_size, tp) // tp


def layer_params(model: ModelConfig, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one decoder layer on one tensor-parallel rank (a mixture of experts: the router and the
    num_experts/ep experts this expert-parallel rank holds)."""
    h, d, f = model.hidden_size, model.head_dim, model.ffn_hidden_size // tp
    q, kv = model.num_heads // tp, local_kv_heads(model.num_kv_heads, tp)
    falcon = model.family == "falcon"
    count = h * (q + 2 * kv) * d + q * d * h + (2 if falcon else 3) * h * f
    if model.is_moe:
        count += (model.num_experts // ep - 1) * 3 * h * f + model.num_experts * h
    count += ((4 if model.separate_mlp_norm else 2) if falcon else 2) * h  # LayerNorm weight+bias / RMSNorm weight
    if model.bias:
        count += (q + 2 * kv) * d + f * (1 if falcon else 2) + 2 * h  # row-parallel biases are replicated
    return count


def stage_layers(model: ModelConfig, pp: int, vpp: int, pp_layers: str | None = None) -> list[list[int]]:
    """Decoder layers of each chunk of each pipeline rank; chunk c (model order) lives on rank c % pp."""
    counts = split_layers(model.num_layers, pp, vpp, pp_layers)
    return [[counts[v * pp + r] for v in range(vpp)] for r in range(pp)]


def active_layer_params(model: ModelConfig) -> int:
    """Parameters of one decoder layer that compute one token (all of it for a dense model; the router and
    experts_per_token experts of a mixture of experts)."""
    full = layer_params(model)
    if not model.is_moe:
        return full
    return full - expert_layer_params(model) + model.experts_per_token * expert_layer_params(model) // model.num_experts


def expert_layer_params(model: ModelConfig, tp: int = 1, ep: int = 1) -> int:
    """Of layer_params: the experts' (reduced and sharded over the dp/ep ranks holding the same experts)."""
    return model.num_experts // ep * 3 * model.hidden_size * (model.ffn_hidden_size // tp) if model.is_moe else 0


def stage_params(model: ModelConfig, tp: int, pp: int, rank: int, layers: int, ep: int = 1) -> tuple[int, int]:
    """(parameters on pipeline rank `rank`, the largest single parameter there)."""
    h, vocab = model.hidden_size, local_vocab(model, tp)
    count = layers * layer_params(model, tp, ep)
    largest = h * model.ffn_hidden_size // tp * (1 if model.family == "falcon" else 2) if layers else 0
    if rank == 0:
        count += vocab * h
        largest = max(largest, vocab * h)
    if rank == pp - 1:
        count += (2 if model.family == "falcon" else 1) * h  # final norm
        if not model.tie_embeddings or pp > 1:  # tied: the last stage keeps a copy of the embedding
            count += vocab * h
            largest = max(largest, vocab * h)
    return count, largest


def bytes_per_param(dtype: str, distributed_optimizer: bool, replicas: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter held, as parallel/optimizer.py allocates them
    (replicas: dp x cp, over which the distributed optimizer shards)."""
    shards = replicas if distributed_optimizer else 1
    if dtype == "fp32":
        return 4.0, 4.0, 8.0 / shards
    return 2.0, 4.0, 12.0 / shards
