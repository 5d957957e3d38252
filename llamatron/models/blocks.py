"""The pre-norm decoder layer most families are built of (Llama, Mistral, Mixtral, Qwen): RMSNorm, attention,
RMSNorm, SwiGLU (or a mixture of SwiGLU experts, models/moe.py), each branch added to the residual.

Blocks declare how tensor parallelism splits them (`tp_plan`: child -> style, parallel/tensor.py); the model code
itself stays single-device."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.swiglu_op import swiglu
from .block_counts import PreNormCounts
from .config import ModelConfig
from .layer_input import LayerInput
from .layers import Attention, RMSNorm
from .moe import MoE


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one projection laid out [gate; up]."""

    tp_plan = {"gate_up": "gate_up", "down": "row"}  # each rank: the same slice of gate and of up

    def __init__(self, cfg: ModelConfig, ffn: int | None = None):
        """ffn: the width (default cfg.ffn_hidden_size)."""
        super().__init__()
        ffn = cfg.ffn_hidden_size if ffn is None else ffn
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * ffn, bias=cfg.bias)
        self.down = nn.Linear(ffn, cfg.hidden_size, bias=cfg.bias)
        self.backend = "auto"  # auto, triton or torch: this model's choice (models/kernels.py)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(...), plus `residual` when given."""
        act = swiglu(self.gate_up(x), self.backend)
        if residual is None:
            return self.down(act)
        if type(self.down) is nn.Linear and self.down.bias is None:
            # The residual rides in the matmul's epilogue (C = residual, beta = 1): the separate add kernel, a
            # full pass over three (batch, seq, hidden) tensors, goes away. A row-parallel `down` (tensor
            # parallelism) reduces its output first, so it adds afterwards.
            out = torch.addmm(residual.flatten(0, -2), act.flatten(0, -2), self.down.weight.t())
            return out.view(residual.shape)
        return residual + self.down(act)


class DecoderBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(...)): the pre-norm layer. Layer `index` of the model: whether it has
    experts, its MLP's width and whether it rotates come from the config (ModelConfig.is_moe_layer, ...). A family
    with an attention or a mixture of experts of its own passes it (`attn`: Llama 4's, DeepSeek-V3's latent
    attention; `moe`: DeepSeek-V3's group-limited routing), called as the shared ones are: `attn(x, inputs)`, the
    layer's own LayerInput (models/layer_input.py)."""

    def __init__(self, cfg: ModelConfig, index: int = 0, attn: nn.Module | None = None, moe: MoE | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg, rope=cfg.layer_has_rope(index)) if attn is None else attn
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp: SwiGLU | MoE
        if cfg.is_moe_layer(index):
            self.mlp = MoE(cfg) if moe is None else moe
        else:
            self.mlp = SwiGLU(cfg, cfg.layer_ffn(index))

    @property
    def counts(self) -> PreNormCounts:
        """What it saves outside its attention, for the planner (models/block_counts.py)."""
        return PreNormCounts(self.attn_norm.weight.shape[0])

    def forward(self, x: torch.Tensor, inputs: LayerInput) -> torch.Tensor:
        attn = self.attn(self.attn_norm(x), inputs)
        x, normed = self.mlp_norm.add_and_norm(x, attn)
        return self.mlp(normed, residual=x)


def decoder_block(cfg: ModelConfig, index: int) -> DecoderBlock:
    """Layer `index` of a model made of pre-norm decoder layers (a Family's `block`)."""
    return DecoderBlock(cfg, index)


def rms_norm(cfg: ModelConfig) -> RMSNorm:
    """The final norm of a model normalised with RMSNorm (a Family's `final_norm`)."""
    return RMSNorm(cfg.hidden_size, cfg.norm_eps)
