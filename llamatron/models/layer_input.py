"""What a decoder layer reads besides its hidden states: one value, built by the model once per forward.

Every layer is called `layer(x, inputs)` and hands the same `inputs` to its attention (`attn(normed, inputs)`): the
rotary tables, the attention mask, the layer's decode cache and the queries' positions. The model
(models/transformer.py) builds one per kind of mask (Llama 4's chunked and whole-context layers have two) and, when
decoding, one per layer with that layer's cache (`with_cache`); the tensors are the forward's own, shared by every
layer, so a step captured in a CUDA graph replays with them as before.

Frozen, and of tensors and plain values only: torch.compile guards on its fields as it did on the positional
arguments it replaces; full recompute (training/engine.py) hands its tensors to the checkpoint as tensor arguments
(`tensors`), so that they are saved for backward as before, not only kept; a pipeline sends hidden states only (each
stage builds its own from the micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .attention import AttentionMask


@dataclass(frozen=True)
class LayerInput:
    """cos, sin: the rotary tables (batch, seq, rope_head_dim) of the queries' positions (layers.rope_cos_sin).
    mask: which keys each query sees (None: plain causal attention, models/attention.py). cache: this layer's decode
    cache (its attention's `cache_kind`, models/kv_cache.py's LayerKVCache by default; None: no cache). positions:
    the queries' positions (batch, seq), for an attention that reads them (Llama 4's temperature tuning)."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: AttentionMask | None = None
    cache: Any = None
    positions: torch.Tensor | None = None

    def with_cache(self, cache: Any) -> LayerInput:
        """The same inputs with layer `cache` (each layer keeps its own)."""
        return LayerInput(self.cos, self.sin, self.mask, cache, self.positions)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(cos, sin, positions): for a caller that must hand them on as tensor arguments (full recompute's
        checkpoint saves those for backward, where saved-tensor hooks see them; an object's tensors it only
        keeps). `with_tensors` puts them back."""
        return self.cos, self.sin, self.positions

    def with_tensors(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None) -> LayerInput:
        return LayerInput(cos, sin, self.mask, self.cache, positions)


__all__ = ["LayerInput"]
