"""The decoder-only language model, for every family, on one device.

A pipeline stage is the same class with some parts absent: no `embed` on later
stages (the input is then a hidden state), no `norm`/head on earlier ones (the
output is then a hidden state), and a subset of `layers`. Layers are keyed by
their index in the whole model, so a stage's parameter names are the whole
model's (`layers.5.attn.qkv.weight` on whichever stage holds layer 5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention_mask, load_balanced_index
from .config import ModelConfig
from .cross_entropy_op import IGNORE_INDEX, CrossEntropy, cross_entropy_per_token
from .falcon import FalconBlock
from .kv_cache import KVCache
from .layers import RMSNorm, rope_cos_sin
from .llama import LlamaBlock

__all__ = ["IGNORE_INDEX", "CrossEntropy", "Transformer", "build_model", "cross_entropy_per_token"]


class Transformer(nn.Module):
    # (logits, labels) -> fp32 loss per token; tensor parallelism installs its vocabulary-parallel one
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __init__(self, cfg: ModelConfig, layers: Sequence[int] | None = None, embed: bool = True, head: bool = True):
        """The whole model, or a pipeline stage: decoder layers `layers` (default: all), the embedding if
        `embed`, the final norm and output head if `head`."""
        super().__init__()
        self.cfg = cfg
        block = FalconBlock if cfg.family == "falcon" else LlamaBlock
        # Weights come from models/init.py; passing _weight skips nn.Embedding's own init (slow to import).
        self.embed: nn.Module | None = None
        if embed:
            self.embed = nn.Embedding(
                cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
            )
        ids = range(cfg.num_layers) if layers is None else layers
        self.layers = nn.ModuleDict({str(i): block(cfg) for i in ids})
        norm = (
            nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
            if cfg.family == "falcon"
            else RMSNorm(cfg.hidden_size, cfg.norm_eps)
        )
        self.norm: nn.Module | None = norm if head else None
        # Tied embeddings: the embedding is the head; a last pipeline stage without the embedding holds a copy of
        # it as its head (parallel/pipeline.py: its spec names it embed.weight, their gradients are summed).
        separate_head = head and not (cfg.tie_embeddings and embed)
        self.lm_head: nn.Module | None = None
        if separate_head:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # The head's matmul (x, weight) -> logits; --fp8-head installs an FP8 one (fp8.apply_fp8).
        self.head_matmul: Callable[..., torch.Tensor] = F.linear
        # Swappable so tensor parallelism can install a vocabulary-parallel loss.
        self.loss_fn = CrossEntropy()
        # Sequence parallelism splits hidden states along the sequence into this many shards.
        self.seq_shards = 1
        # Context parallelism (parallel/context.py): (cp size, cp rank); this rank holds the tokens
        # load_balanced_index names, and its attention sees the whole sequence's keys.
        self.context = (1, 0)
        # Pipeline stages holding a tied embedding's two copies sum their gradients over this group
        # (parallel/pipeline.py; None: no copy on another stage).
        self.tied_embedding_group: Any = None

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
        return self.head_matmul(self.norm(hidden), self.head_weight())

    def forward(
        self,
        inputs: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """inputs: token ids (first stage) or hidden states (batch, seq, hidden).

        document_ids (batch, seq), when given, confine attention to tokens of the same
        document (packed sequences); under context parallelism they are the whole sequence's.
        cache: the inputs follow the tokens it holds (their positions start at its length) and
        join them (models/kv_cache.py). Returns the per-token loss when labels are given, else
        logits; a stage without the head returns its hidden states.
        """
        h = self.embed(inputs) if self.embed is not None else inputs
        batch, seq = h.shape[0], self.full_seq_length(h)
        offset = 0
        if cache is not None:
            if self.context[0] > 1 or self.seq_shards > 1:
                raise ValueError("a KV cache runs without context and sequence parallelism")
            cache.check_room(seq)
            offset = cache.length
        if position_ids is None:
            size, rank = self.context
            if size > 1:
                index = load_balanced_index(seq * size, size, rank, h.device)
            else:
                index = torch.arange(offset, offset + seq, device=h.device)
            position_ids = index.expand(batch, seq)
        cos, sin = rope_cos_sin(self.cfg, position_ids, h.dtype)
        mask = attention_mask(seq, self.cfg.sliding_window, document_ids, h.device, self.context, offset=offset)
        for name, layer in self.layers.items():
            h = layer(h, cos, sin, mask) if cache is None else layer(h, cos, sin, mask, cache.layer(name))
        if cache is not None:
            cache.advance(seq)
        if self.norm is None:
            return h
        if labels is None:
            return self.logits(h)
        return self.loss_fn(self.logits(h), labels)

    def full_seq_length(self, h: torch.Tensor) -> int:
        """Sequence length of the whole sample (sequence parallelism shards h)."""
        return h.shape[1] * self.seq_shards


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
