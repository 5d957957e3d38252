"""The decoder-only language model, for every family, on one device.

A pipeline stage is the same class with some parts absent: no `embed` on later
stages (the input is then a hidden state), no `norm`/head on earlier ones (the
output is then a hidden state), and a subset of `layers`. Layers are keyed by
their index in the whole model, so a stage's parameter names are the whole
model's (`layers.5.attn.qkv.weight` on whichever stage holds layer 5).

The model computes logits and knows no loss: what a step minimises is an objective's (llamatron/objectives/).
What parallelism changed about a model is declared in one field, `parallel` (a ParallelContext with
single-device defaults), which the functions of parallel/ set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cross_entropy_op import IGNORE_INDEX
from .attention import AttentionMask, attention_mask, decode_mask, load_balanced_index
from .config import ModelConfig
from .families import family_of
from .family import ExtraHeadInputs, ExtraHeads
from .kv_cache import KVCache
from .layer_input import LayerInput
from .layers import rope_cos_sin

__all__ = [
    "IGNORE_INDEX",
    "ExtraHeads",
    "ParallelContext",
    "Transformer",
    "VocabShard",
    "batch_inputs",
    "build_model",
    "embedding_on_last_stage",
    "extra_heads_of",
]


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of the embedding and head under tensor parallelism: ids [start, start + num_real) of the
    real vocabulary (`vocab_size` ids), padding after them; `group` is the tensor-parallel group."""

    start: int
    num_real: int
    vocab_size: int
    group: Any


@dataclass
class ParallelContext:
    """What parallelism changed about a model (chunk): single-device defaults, set by parallel/."""

    # Sequence parallelism (parallel/tensor.py): hidden states between layers are split along the sequence.
    sequence_shards: int = 1
    # Context parallelism (parallel/context.py): (cp size, cp rank); this rank holds the tokens
    # load_balanced_index names, and its attention sees the whole sequence's keys.
    context: tuple[int, int] = (1, 0)
    # Pipeline stages holding a tied embedding's two copies sum their gradients over this group
    # (parallel/pipeline.py; None: no copy on another stage).
    tied_embedding_group: Any = None
    # Tensor parallelism's split of the vocabulary (None: the logits hold the whole vocabulary).
    vocab: VocabShard | None = field(default=None)


def batch_inputs(mb: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The model's keyword inputs in micro-batch `mb` (its first input, token ids or a pipeline stage's hidden
    states, is positional): rotary positions, document masks and the token ids (extra heads read them on the last
    stage), which every pipeline stage reads from its own copy of the micro-batch."""
    return {
        "position_ids": mb.get("position_ids"),
        "document_ids": mb.get("document_ids"),
        "tokens": mb.get("whole_input_ids", mb.get("input_ids")),  # the whole sequence's under cp
    }


def extra_heads_of(cfg: ModelConfig) -> nn.Module | None:
    """The family's extra prediction heads of `cfg`, built on meta (None without them): what every pipeline rank
    knows of them, whichever stage holds them."""
    with torch.device("meta"):
        return family_of(cfg).extra_heads(cfg)


def embedding_on_last_stage(cfg: ModelConfig) -> bool:
    """A last pipeline stage without the embedding holds a copy of it: as its head (tied embeddings), or for its
    extra heads, which embed the tokens ahead (parallel/pipeline.py sums the copies' gradients)."""
    return cfg.tie_embeddings or extra_heads_of(cfg) is not None


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Sequence[int] | None = None, embed: bool = True, head: bool = True):
        """The whole model, or a pipeline stage: decoder layers `layers` (default: all), the embedding if
        `embed`, the final norm and output head if `head`."""
        super().__init__()
        self.cfg = cfg
        family = family_of(cfg)  # its layers and final norm
        # Weights come from models/init.py; passing _weight skips nn.Embedding's own init (slow to import).
        self.embed: nn.Module | None = None
        if embed:
            self.embed = nn.Embedding(
                cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
            )
        ids = range(cfg.num_layers) if layers is None else layers
        self.layers = nn.ModuleDict({str(i): family.block(cfg, i) for i in ids})
        # one attention mask per kind of layer (Llama 4: chunked and whole-context), built once per forward
        self.attention_chunks = {str(i): cfg.layer_attention_chunk(i) for i in ids}
        # the decode cache each layer's attention keeps (None: keys and values, models/kv_cache.py)
        self.cache_kinds = {
            name: getattr(getattr(layer, "attn", None), "cache_kind", None) for name, layer in self.layers.items()
        }
        self._chunks = sorted(set(self.attention_chunks.values()), key=lambda c: c or 0)
        self.norm: nn.Module | None = family.final_norm(cfg) if head else None
        # Tied embeddings: the embedding is the head; a last pipeline stage without the embedding holds a copy of
        # it as its head (parallel/pipeline.py: its spec names it embed.weight, their gradients are summed).
        separate_head = head and not (cfg.tie_embeddings and embed)
        self.lm_head: nn.Module | None = None
        if separate_head:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # The head's matmul (x, weight) -> logits; --fp8-head installs an FP8 one (fp8.apply_fp8).
        self.head_matmul: Callable[..., torch.Tensor] = F.linear
        self.parallel = ParallelContext()
        # The family's extra prediction heads, beside the head (they read the input ids: the layout rules keep
        # them to a last stage that has the embedding); a forward over whole sequences leaves their logits in
        # `extra_logits` for the objective to take
        self.extra_heads: nn.Module | None = family.extra_heads(cfg) if head else None
        self.extra_logits: list[torch.Tensor] = []
        # Their embedding on a last stage without the model's: a copy of it, as a tied head is (parallel/pipeline.py)
        self.extra_embed: nn.Module | None = None
        if self.extra_heads is not None and not embed:
            self.extra_embed = nn.Embedding(
                cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
            )

    @property
    def is_first_stage(self) -> bool:
        return self.embed is not None

    @property
    def is_last_stage(self) -> bool:
        return self.norm is not None

    def head_weight(self) -> torch.Tensor:
        head = self.embed if self.lm_head is None else self.lm_head
        assert head is not None, "logits on a stage without the output head"
        return cast(torch.Tensor, head.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.norm is not None, "logits on a stage without the output head"
        return self.head_logits(self.norm(hidden))

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output head on normed hidden states `x` (shared with extra heads)."""
        return self.head_matmul(x, self.head_weight())

    def forward(
        self,
        inputs: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        logits_at: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs: token ids (first stage) or hidden states (batch, seq, hidden).

        document_ids (batch, seq), when given, confine attention to tokens of the same
        document (packed sequences); under context parallelism they are the whole sequence's.
        cache: the inputs follow the tokens it holds (their positions start at its length) and
        join them (models/kv_cache.py); a per-row cache takes one token per row at each row's own
        position. logits_at: (batch,) the one position per row whose logits are wanted (a prefill of
        prompts of different lengths: each one's last token), the head runs there only. tokens: the token ids
        the extra heads read: a later stage's inputs, the whole sequence's under context parallelism.
        Returns the logits (this rank's vocabulary shard under tensor parallelism); a stage without
        the head returns its hidden states.
        """
        h = self.embed(inputs) if self.embed is not None else inputs
        batch, seq = h.shape[0], self.full_seq_length(h)
        offset = 0
        if cache is not None:
            if self.parallel.context[0] > 1 or self.parallel.sequence_shards > 1:
                raise ValueError("a KV cache runs without context and sequence parallelism")
            cache.check_room(seq)
            offset = cache.length
            if cache.per_row and position_ids is None:
                if cache.positions is None or seq != 1:
                    raise ValueError(f"a per-row KV cache decodes one token per row, not {seq}")
                position_ids = cache.positions[:, None]
        if position_ids is None:
            size, rank = self.parallel.context
            if size > 1:
                index = load_balanced_index(seq * size, size, rank, h.device)
            else:
                index = torch.arange(offset, offset + seq, device=h.device)
            position_ids = index.expand(batch, seq)
        cos, sin = rope_cos_sin(self.cfg, position_ids, h.dtype)
        masks = {chunk: self._mask(seq, position_ids, document_ids, h, cache, offset, chunk) for chunk in self._chunks}
        # what every layer reads besides h, built once per kind of mask; decoding adds each layer's own cache
        layer_inputs = {chunk: LayerInput(cos, sin, mask, None, position_ids) for chunk, mask in masks.items()}
        for name, layer in self.layers.items():
            layer_input = layer_inputs[self.attention_chunks[name]]
            if cache is not None:
                layer_input = layer_input.with_cache(cache.layer(name, self.cache_kinds[name]))
            h = layer(h, layer_input)
        if cache is not None:
            cache.advance(seq)
        if self.norm is None:
            return h
        if self.extra_heads is not None and cache is None and logits_at is None:
            if None in layer_inputs:
                whole = layer_inputs[None]
            else:  # the heads attend to the whole causal context
                whole_mask = self._mask(seq, position_ids, document_ids, h, None, 0, None)
                whole = LayerInput(cos, sin, whole_mask, None, position_ids)
            ids = tokens if tokens is not None or self.embed is None else inputs
            assert ids is not None, "extra heads on a later pipeline stage need the token ids"
            self.extra_logits = self._extra_logits(h, ids, whole)
        if logits_at is not None:
            h = h[torch.arange(batch, device=h.device), logits_at][:, None]
        return self.logits(h)

    def _extra_logits(self, h: torch.Tensor, tokens: torch.Tensor, layer_input: LayerInput) -> list[torch.Tensor]:
        embed = self.embed if self.embed is not None else self.extra_embed
        assert embed is not None and self.extra_heads is not None, "extra heads without an embedding"
        heads = cast(ExtraHeads, self.extra_heads)
        size, rank = self.parallel.context  # under cp: where this rank's tokens lie in `tokens`, the whole sequence
        index = load_balanced_index(tokens.shape[1], size, rank, tokens.device) if size > 1 else None
        return heads(h, tokens, ExtraHeadInputs(embed, self.head_logits, layer_input, index))

    def take_extra_logits(self) -> list[torch.Tensor]:
        """The extra heads' logits of the last forward, handed over once (empty without extra heads)."""
        out, self.extra_logits = self.extra_logits, []
        return out

    def _mask(
        self,
        seq: int,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor | None,
        h: torch.Tensor,
        cache: KVCache | None,
        offset: int,
        chunk: int | None,
    ) -> AttentionMask | None:
        """The mask of the layers attending within chunks of `chunk` tokens (None: the whole causal context)."""
        if cache is not None and cache.per_row:
            return decode_mask(position_ids[:, 0], cache.max_length, self.cfg.sliding_window, h.dtype, chunk)
        window, context = self.cfg.sliding_window, self.parallel.context
        return attention_mask(seq, window, document_ids, h.device, context, offset=offset, chunk=chunk)

    def full_seq_length(self, h: torch.Tensor) -> int:
        """Sequence length of the whole sample (sequence parallelism shards h)."""
        return h.shape[1] * self.parallel.sequence_shards


def build_model(
    cfg: ModelConfig,
    device: torch.device | str = "meta",
    layers: Sequence[int] | None = None,
    embed: bool = True,
    head: bool = True,
) -> Transformer:
    """The model (or a pipeline stage of it: see Transformer) with uninitialised parameters (on `meta` by default:
    see models/init.py)."""
    with torch.device(device):
        return Transformer(cfg, layers, embed, head)
