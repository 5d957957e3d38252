"""Qwen's decoder layer: the shared pre-norm layer (models/blocks.py) whose attention has Qwen2's q/k/v biases or
Qwen3's per-head q/k RMSNorms (QwenConfig's qkv_bias, qk_norm), and whose mixture of experts (Qwen-MoE) may gate its
shared expert by a sigmoid of the token (Qwen2-MoE's shared_expert_gate)."""

from __future__ import annotations

import torch
from torch import nn

from ...blocks import DecoderBlock
from ...layers import Attention
from ...moe import MoE, SharedExpert
from .config import QwenConfig


class GatedSharedExpert(SharedExpert):
    """The shared expert's output times sigmoid(gate(x)), a gate of one output per token (Qwen2-MoE)."""

    # The gate is whole on every tensor-parallel rank, scaling the rank's partial sum: its gradient is partial too
    tp_split = {**SharedExpert.tp_split, "gate": "replicated_partial"}

    def __init__(self, hidden: int, ffn: int):
        super().__init__(hidden, ffn)
        self.gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * super().forward(x)


class QwenMoE(MoE):
    """The shared mixture of experts, with Qwen2-MoE's gated shared expert where the config gates it."""

    def shared_expert(self, cfg: QwenConfig) -> SharedExpert:  # type: ignore[override]
        if cfg.shared_expert_gate:
            return GatedSharedExpert(cfg.hidden_size, cfg.shared_expert_ffn)
        return super().shared_expert(cfg)


def qwen_block(cfg: QwenConfig, index: int) -> DecoderBlock:
    """Layer `index`: the pre-norm layer with Qwen's attention options and, in a MoE layer, Qwen's MoE."""
    attn = Attention(cfg, rope=cfg.layer_has_rope(index), qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm)
    return DecoderBlock(cfg, index, attn, QwenMoE(cfg) if cfg.is_moe_layer(index) else None)
