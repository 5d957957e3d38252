"""The llama4 family's config: the common decoder config, Llama 4's own attention options (read by attention.py)
and its experts' input weighting (read by moe.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import MOE_SETTINGS, ModelConfig


@dataclass
class Llama4Config(ModelConfig):
    moe_settings: ClassVar[tuple[str, ...]] = (*MOE_SETTINGS, "router_weights_input")

    # Every nope_layer_interval-th layer has no rotary embedding (0: every layer has it); the other layers attend
    # within chunks of attention_chunk_size tokens (None: the whole causal context) and, with qk_l2_norm,
    # RMS-normalise (no weight) each query and key head after the rotary embedding. NoPE layers scale their queries
    # by 1 + attn_temperature_scale * log(1 + floor((position + 1) / attn_temperature_floor)) (attention
    # temperature tuning; 0: off)
    nope_layer_interval: int = 0
    attention_chunk_size: int | None = None
    qk_l2_norm: bool = False
    attn_temperature_floor: int = 0
    attn_temperature_scale: float = 0.1
    # each chosen expert's router weight scales its input, expert(w · x), instead of its output (moe.py)
    router_weights_input: bool = False

    def layer_has_rope(self, index: int) -> bool:
        return not (self.nope_layer_interval and (index + 1) % self.nope_layer_interval == 0)

    def layer_attention_chunk(self, index: int) -> int | None:
        """Rotary layers attend within chunks; NoPE layers see the whole causal context."""
        return self.attention_chunk_size if self.layer_has_rope(index) else None

    def attention_problems(self) -> list[str]:
        out = []
        if not self.nope_layer_interval >= 0:
            out.append(f"nope_layer_interval {self.nope_layer_interval} must be >= 0 (0: rotary in every layer)")
        if self.attention_chunk_size is not None:
            if not self.attention_chunk_size >= 1:
                out.append(f"attention_chunk_size {self.attention_chunk_size} must be >= 1 (or null: no chunks)")
            if self.sliding_window is not None:
                out.append("attention_chunk_size and sliding_window are both set: a layer attends one way; drop one")
        if not self.attn_temperature_floor >= 0:
            out.append(f"attn_temperature_floor {self.attn_temperature_floor} must be >= 0 (0: no tuning)")
        if not self.attn_temperature_scale >= 0:
            out.append(f"attn_temperature_scale {self.attn_temperature_scale} must be >= 0")
        return out
