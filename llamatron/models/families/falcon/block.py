"""Falcon decoder layers: attention and MLP in parallel from the same residual.

7B layout: one LayerNorm feeds both branches, multi-query attention.
40B/180B layout: separate LayerNorms for the attention and MLP branches, grouped KV heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ...layer_input import LayerInput
from ...layers import Attention
from .config import FalconConfig
from .counts import LayerNormCounts, ParallelBlockCounts


class GeluMLP(nn.Module):
    tp_plan = {"up": "column", "down": "row"}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class FalconBlock(nn.Module):
    """x + attn(norm(x)) + mlp(norm(x)): attention and MLP read the same residual."""

    def __init__(self, cfg: FalconConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps) if cfg.separate_mlp_norm else None
        self.attn = Attention(cfg)
        self.mlp = GeluMLP(cfg)

    @property
    def counts(self) -> ParallelBlockCounts:
        """What it saves outside its attention, for the planner (counts.py)."""
        return ParallelBlockCounts(self.attn_norm.normalized_shape[0], 1 if self.mlp_norm is None else 2)

    def forward(self, x: torch.Tensor, inputs: LayerInput) -> torch.Tensor:
        attn_in = self.attn_norm(x)
        mlp_in = self.mlp_norm(x) if self.mlp_norm is not None else attn_in
        return x + self.attn(attn_in, inputs) + self.mlp(mlp_in)


def falcon_block(cfg: FalconConfig, index: int) -> FalconBlock:
    return FalconBlock(cfg)


class FinalLayerNorm(nn.LayerNorm):
    """The LayerNorm before the head, declaring what it saves for the planner (counts.py)."""

    @property
    def counts(self) -> LayerNormCounts:
        return LayerNormCounts(self.normalized_shape[0])


def layer_norm(cfg: ModelConfig) -> nn.LayerNorm:
    return FinalLayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
