"""Llama 4's attention and decoder layer: the shared pre-norm layer (models/blocks.py) whose attention, after the
rotary embedding, RMS-normalises queries and keys (no weight) in its rotary layers and tunes the queries'
temperature by position in its NoPE layers; its MoE layers weight the experts' inputs (moe.py)."""

from __future__ import annotations

import torch
from torch import nn

from ...blocks import DecoderBlock
from ...layers import Attention
from .config import Llama4Config
from .moe import Llama4MoE


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in fp32, no weight (Llama 4's q/k norm)."""
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


class TemperatureTuning(nn.Module):
    """Queries scaled by 1 + scale · log(1 + floor((position + 1) / floor)): attention sharpens at long range
    (Llama 4's NoPE layers; 1 for the first `floor` - 1 positions)."""

    def __init__(self, cfg: Llama4Config):
        super().__init__()
        self.floor, self.scale = cfg.attn_temperature_floor, cfg.attn_temperature_scale

    def forward(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q: (batch, heads, seq, head_dim); positions: (batch, seq)."""
        factor = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor)) * self.scale + 1.0
        return (q * factor[:, None, :, None]).to(q.dtype)


class Llama4Attention(Attention):
    def __init__(self, cfg: Llama4Config, rope: bool = True):
        super().__init__(cfg, rope)
        self.l2_eps = cfg.norm_eps if cfg.qk_l2_norm and rope else None
        self.temperature = None if rope or not cfg.attn_temperature_floor else TemperatureTuning(cfg)

    def adjust(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.l2_eps is not None:
            q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        if self.temperature is not None:
            assert positions is not None, "temperature tuning needs the queries' positions"
            q = self.temperature(q, positions)
        return q, k


def llama4_block(cfg: Llama4Config, index: int) -> DecoderBlock:
    """Layer `index`: the pre-norm layer with Llama 4's attention (rotary and chunked, or NoPE) and, in its MoE
    layers, Llama 4's MoE."""
    moe = Llama4MoE(cfg) if cfg.is_moe_layer(index) else None
    return DecoderBlock(cfg, index, Llama4Attention(cfg, rope=cfg.layer_has_rope(index)), moe)
