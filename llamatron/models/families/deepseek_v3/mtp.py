"""Multi-token prediction (DeepSeek-V3 paper, section 2.2): D modules after the model, module k predicting the token
k + 1 places ahead, each from the previous depth's hidden states and the embedding of the token k places ahead.

Module k at position i (h⁰: the model's last hidden states, as the caller gives them):

    h'ᵏᵢ = eh_proj([enorm(Emb(t_{i+k})); hnorm(hᵏ⁻¹ᵢ)])     the embedding first, as DeepSeek's published weights
    hᵏ   = block(h'ᵏ)                                      a decoder layer (given; DeepSeek-V3: a MoE layer)
    Pᵏᵢ  = head(norm(hᵏᵢ))                                 predicts t_{i+k+1}

`norm` is the module's own RMSNorm (model.layers.{L+k-1}.shared_head.norm in DeepSeek's checkpoints, transformers'
MtpLayer.post_norm); the embedding and the head are the model's, given by the caller (the checkpoints' copies,
embed_tokens and shared_head.head, equal the model's). The next depth reads hᵏ before that norm (the paper's chain).

The loss: L_MTP = λ / D · Σ_k Lᵏ, Lᵏ the mean cross entropy over the positions whose target t_{i+k+1} exists
(positions within k + 1 of the end have none, nor do IGNORE_INDEX labels). The paper divides each depth's sum by
the sequence length T instead; the mean over counted targets is what Megatron-LM and transformers compute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ....kernels.cross_entropy_op import IGNORE_INDEX
from ...family import ExtraHeadInputs
from ...layer_input import LayerInput
from ...layers import RMSNorm


@dataclass(frozen=True)
class MTPConfig:
    """One MTP module's shape: the model's width and its norms' epsilon (rms_norm_eps)."""

    hidden_size: int
    norm_eps: float


class MTPModule(nn.Module):
    """One depth of multi-token prediction around a decoder `block` (called as every layer: x and its LayerInput)."""

    # Tensor parallelism: eh_proj whole on every rank, run on the rank's tokens (a sequence shard under sequence
    # parallelism), the block split as its own plan says; the head (column-parallel over the vocabulary) reads
    # `norm`'s output through `head_input`, as the model's head reads its final norm's (the whole sequence, its
    # gradient summed over the ranks).
    tp_plan = {"eh_proj": "replicated"}
    tp_parallel_inputs = ("head_input",)

    def __init__(self, cfg: MTPConfig, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = block
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)  # before the shared head
        self.head_input: Callable[[torch.Tensor], torch.Tensor] = _identity

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, inputs: LayerInput) -> torch.Tensor:
        """hidden: the previous depth's (batch, seq, hidden); next_embeds: the embeddings of the tokens this depth
        reads (position i: token i + k); inputs: what its block reads. Returns this depth's hidden states, before
        `norm`."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        return self.block(x, inputs)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def shifted(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """t (batch, seq) moved k places left, the last k places `fill`: position i holds t[i + k]."""
    out = torch.full_like(t, fill)
    if k < t.shape[1]:
        out[:, : t.shape[1] - k] = t[:, k:]
    return out


def mtp_logits(
    modules: Sequence[MTPModule],
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
    inputs: LayerInput,
    positions: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Every depth's logits (batch, seq, vocab), depth k's at position i predicting token i + k + 1. hidden: the
    model's last hidden states; tokens: its input ids (batch, seq); positions: where hidden's tokens lie in them
    (context parallelism; None: all, in order). The places past the end read token 0: their targets do not exist,
    and causal attention keeps them from every earlier position."""
    out = []
    for k, module in enumerate(modules, start=1):
        ahead = shifted(tokens, k, 0)
        ahead = ahead if positions is None else ahead[:, positions]
        hidden = module(hidden, embed(ahead), inputs)
        out.append(head(module.head_input(module.norm(hidden))))
    return out


def mtp_sums(logits: Sequence[torch.Tensor], labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per depth, the cross entropy summed over its targets and the number of targets, (D,) each. labels: the
    model's next-token labels (batch, seq), label i = token i + 1 (IGNORE_INDEX: none); depth k's target at i is
    label i + k. Sums and counts, so that a step can divide by its global batch's counts (docs/design.md)."""
    sums, counts = [], []
    for k, depth in enumerate(logits, start=1):
        target = shifted(labels, k, IGNORE_INDEX).flatten()
        sums.append(F.cross_entropy(depth.flatten(0, 1).float(), target, ignore_index=IGNORE_INDEX, reduction="sum"))
        counts.append((target != IGNORE_INDEX).sum())
    return torch.stack(sums), torch.stack(counts)


def mtp_loss(logits: Sequence[torch.Tensor], labels: torch.Tensor, weight: float) -> torch.Tensor:
    """λ / D · Σ_k (depth k's mean cross entropy over its targets): the MTP loss of one batch (λ: `weight`).
    A depth without a target (a sequence no longer than the depth) counts 0."""
    sums, counts = mtp_sums(logits, labels)
    return weight * (sums / counts.clamp(min=1)).mean()


class MTPHeads(nn.ModuleList):
    """The model's multi-token prediction modules as the Transformer's extra heads (models/family.py
    ExtraHeads): depth k's logits predict label i + k; training weighs their mean loss by `loss_weight` (λ)."""

    stat_name = "mtp_loss"

    def __init__(self, modules: Sequence[MTPModule], loss_weight: float):
        super().__init__(modules)
        self.offsets = tuple(range(1, len(modules) + 1))
        self.loss_weight = loss_weight

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, inputs: ExtraHeadInputs) -> list[torch.Tensor]:
        depths = cast(Sequence[MTPModule], list(self))
        return mtp_logits(depths, hidden, tokens, inputs.embed, inputs.head, inputs.layer, inputs.positions)


def mtp_problems(num_modules: int, weight: float, seq_length: int) -> list[str]:
    """Why these settings cannot train multi-token prediction (empty when they can)."""
    out = []
    if num_modules < 0 or weight < 0:
        out.append(f"num_nextn_predict_layers={num_modules} and its loss weight {weight}: must be >= 0")
    if num_modules and seq_length <= num_modules:
        out.append(
            f"seq_length={seq_length}: must exceed num_nextn_predict_layers={num_modules} (the last depth's "
            "targets lie that far ahead)"
        )
    return out


__all__ = ["MTPConfig", "MTPHeads", "MTPModule", "mtp_logits", "mtp_loss", "mtp_problems", "mtp_sums", "shifted"]
