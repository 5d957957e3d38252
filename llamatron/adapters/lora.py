"""LoRA: a frozen linear plus a trained low-rank update, y = W x + (alpha / r) B A x (Hu et al. 2021).

llamatron fuses some of Hugging Face's linears ([Q; K; V], [gate; up]); LoRA adapts each of those separately (one
A and one B per q_proj, k_proj, ...), so an adapted fused linear holds one A per segment, stacked (S*r, in), and
one B row block per output row, (out, r): each output row reads only its own segment's r columns of A x. Which
rows belong to which segment comes from the family's Hugging Face weight rules (the same ones import and export
use), so any family's fused layout, reordered rows included, gets adapters that are exactly PEFT's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LoraLinear(nn.Module):
    """A linear's own weight and bias (frozen, under their names: checkpoints and weight rules see the same
    tensors) plus scale * B_full A, where B_full (out, S*r) places each row's r values of `lora_b` in the columns
    of its segment (rows of segment -1 get no update)."""

    def __init__(self, base: nn.Linear, segment: torch.Tensor, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        segments = int(segment.max()) + 1
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.scale = rank, alpha / rank
        device = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(segments * rank, base.in_features, device=device))
        self.lora_b = nn.Parameter(torch.zeros(segment.numel(), rank, device=device))
        # Not a buffer: materialising a meta-built model (models/init.py) leaves buffers uninitialised.
        onehot = torch.zeros(segment.numel(), segments)
        rows = segment >= 0
        onehot[rows, segment[rows]] = 1.0
        self._onehot = {onehot.device: onehot}
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora()

    def reset_lora(self) -> None:
        """PEFT's initialisation: A as nn.Linear's default (Kaiming uniform, a = sqrt 5), B zero: no change at
        first."""
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def onehot(self, like: torch.Tensor) -> torch.Tensor:
        """(out, S): 1 where a row belongs to a segment, on `like`'s device and in its dtype."""
        if like.device not in self._onehot:
            self._onehot[like.device] = next(iter(self._onehot.values())).to(like.device)
        return self._onehot[like.device].to(like.dtype)

    def b_full(self) -> torch.Tensor:
        b = self.lora_b.unsqueeze(1) * self.onehot(self.lora_b).unsqueeze(-1)  # (out, S, r)
        return b.flatten(1)

    def delta_weight(self) -> torch.Tensor:
        """What merging adds to the base weight."""
        return self.scale * self.b_full() @ self.lora_a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.dropout(x) @ self.lora_a.to(x.dtype).t() @ self.b_full().to(x.dtype).t()
        return F.linear(x, self.weight, self.bias) + self.scale * update
