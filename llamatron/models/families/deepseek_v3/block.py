"""DeepSeek-V3's decoder layer: the shared pre-norm layer (models/blocks.py) with multi-head latent attention
(mla.py) and, past the first dense layers, the shared mixture of experts routed by group-limited top-k
(routing.py) with its shared experts."""

from __future__ import annotations

import torch

from ...blocks import DecoderBlock
from ...moe import MoE
from .config import DeepseekV3Config
from .mla import MLAttention
from .mtp import MTPConfig, MTPHeads, MTPModule
from .routing import group_limited_topk


class DeepseekMoE(MoE):
    """The shared MoE (sigmoid scores, the balancing bias, dispatch, experts, shared expert, router losses), routed
    by group-limited top-k with DeepSeek-V3's routed scaling."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__(cfg)
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor

    def route(self, logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, weights = group_limited_topk(
            logits,
            self.expert_bias,
            self.n_group,
            self.topk_group,
            self.top_k,
            self.renormalize,
            self.routed_scaling_factor,
        )
        return weights, chosen


def deepseek_v3_block(cfg: DeepseekV3Config, index: int) -> DecoderBlock:
    moe = DeepseekMoE(cfg) if cfg.is_moe_layer(index) else None
    return DecoderBlock(cfg, index, MLAttention(cfg.mla()), moe)


def deepseek_v3_mtp(cfg: DeepseekV3Config) -> MTPHeads | None:
    """The multi-token prediction modules (the family's extra heads), each around a decoder layer numbered after
    the model's (a MoE layer past the dense ones, as in DeepSeek's checkpoints); None without them."""
    if not cfg.num_nextn_predict_layers:
        return None
    shape = MTPConfig(cfg.hidden_size, cfg.norm_eps)
    modules = [
        MTPModule(shape, deepseek_v3_block(cfg, cfg.num_layers + j)) for j in range(cfg.num_nextn_predict_layers)
    ]
    return MTPHeads(modules, cfg.mtp_loss_weight)
