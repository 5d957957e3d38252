"""A step's model chunks as the simulator sees them: their pieces of work for one micro-batch, the parameters
each rank holds per layer, and the gradient buckets those fill (parallel/grad_buffer.py's order)."""

from __future__ import annotations

from dataclasses import dataclass

from ...models import ModelConfig
from ...models.inventory import final_norm_params
from ...parallel.pipeline import split_layers
from ...parallel.tensor import padded_vocab_size
from ..params import layer_shards
from .costs import Costs, LayerCost, Piece, Shape


@dataclass
class Chunk:
    layers: int
    forward: Piece
    backward: Piece
    weight: Piece
    layer_forward: list[float]
    dense_params: list[float]  # per layer, this rank's shard (reverse order of use is done by the buckets)
    expert_params: list[float]
    first_params: float = 0.0  # embedding
    last_params: float = 0.0  # head and final norm


def chunk_layers(num_layers: int, pp: int, vpp: int, pp_layers: str | None) -> list[int]:
    """Decoder layers per chunk: the trainer's split (parallel/pipeline.split_layers), or an explicit one that may
    leave the first chunk only the embedding and the last only the head and loss (a 0), as the Llama 3 paper's
    pipeline does (section 3.3.2); the trainer has no such chunk, the simulator predicts it."""
    counts = [int(c) for c in pp_layers.split(",")] if pp_layers else []
    ends_only = len(counts) == pp * vpp > 2 and 0 in (counts[0], counts[-1]) and min(counts[1:-1]) > 0
    if ends_only and min(counts) >= 0 and sum(counts) == num_layers:
        return counts
    return split_layers(num_layers, pp, vpp, pp_layers)


def build_chunks(model: ModelConfig, s: Shape, costs: Costs, vpp: int, pp_layers: str | None) -> list[Chunk]:
    counts = chunk_layers(model.num_layers, s.pp, vpp, pp_layers)
    vocab = model.vocab_size if s.tp == 1 else padded_vocab_size(model.vocab_size, s.tp) // s.tp
    dense, expert = layer_shards(model, s.tp, s.ep)
    full, bare = costs.layer(True), costs.layer(False)
    head_f, head_b, head_w = costs.head()
    out = []
    for c, n in enumerate(counts):
        done = n if s.recompute == "none" or s.recompute_layers is None else min(n, s.recompute_layers)
        layers: list[LayerCost] = [full] * done + [bare] * (n - done)
        fwd, back, weight = Piece(), Piece(), Piece()
        for lc in layers:
            fwd, back, weight = (
                fwd.plus(lc.forward),
                back.plus(lc.recompute).plus(lc.backward_input),
                weight.plus(lc.backward_weight),
            )
        chunk = Chunk(n, fwd, back, weight, [lc.forward.seconds for lc in layers], [dense] * n, [expert] * n)
        if c == 0:
            chunk.first_params = vocab * model.hidden_size
        if c == len(counts) - 1:
            chunk.forward, chunk.backward, chunk.weight = fwd.plus(head_f), back.plus(head_b), weight.plus(head_w)
            chunk.last_params = vocab * model.hidden_size + final_norm_params(model)
        params = sum(chunk.dense_params) + sum(chunk.expert_params) + chunk.first_params + chunk.last_params
        chunk.weight.add("compute", costs.grad_accumulate(params))
        out.append(chunk)
    return out


@dataclass
class Bucket:
    chunk: int
    numel: float
    ready_fraction: float  # of the chunk's last backward (or W) when its last gradient arrives
    expert: bool
    first_layer: int  # the lowest layer of the chunk whose parameters it holds (forward waits there); -1: head


def buckets(chunk: Chunk, c: int, bucket_size: int) -> list[Bucket]:
    """The chunk's buckets in the order backward fills them: head, last layer ... first layer, embedding."""
    out: list[Bucket] = []
    for expert in (False, True):
        items = [(chunk.last_params, 0.0, -1)] if not expert else []
        n = chunk.layers
        per_layer = chunk.expert_params if expert else chunk.dense_params
        # layer j's gradients arrive as its backward ends; the embedding's scatter-add runs last, just after
        items += [(per_layer[j], 0.999 * (n - j) / max(n, 1), j) for j in reversed(range(n))]
        if not expert:
            items.append((chunk.first_params, 1.0, 0))
        size, frac, first = 0.0, 0.0, n
        for numel, ready, layer in items:
            if numel <= 0:
                continue
            size, frac, first = size + numel, ready, min(first, layer) if layer >= 0 else first
            if size >= bucket_size:
                out.append(Bucket(c, size, frac, expert, first if first < n else -1))
                size, first = 0.0, n
        if size:
            out.append(Bucket(c, size, frac, expert, first if first < n else -1))
    return out
