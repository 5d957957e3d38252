"""Llama 4's mixture of experts: the shared MoE (models/moe.py: sigmoid scores, dispatch, experts, shared expert,
router losses), each chosen expert's router weight scaling its input rather than its output (router_weights_input:
expert(w · x), as transformers' Llama4TextMoe runs it)."""

from __future__ import annotations

import torch

from ...moe import MoE, Routing, route, unpermute
from .config import Llama4Config


class Llama4MoE(MoE):
    def __init__(self, cfg: Llama4Config):
        super().__init__(cfg)
        self.weights_input = cfg.router_weights_input

    def run_experts(
        self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None
    ) -> tuple[torch.Tensor, Routing]:
        """Each (token, choice) its own row w · x, routed as one choice; the k outputs summed per token."""
        if not self.weights_input:
            return super().run_experts(tokens, chosen, weights, keep)
        rows = (tokens.unsqueeze(1) * weights.unsqueeze(-1)).flatten(0, 1)
        routing = route(chosen.reshape(-1, 1), self.num_experts, None if keep is None else keep.reshape(-1, 1))
        out = unpermute(self.dispatch(rows, routing, self.experts), routing.order, routing.choices)
        return out.view(tokens.shape[0], self.top_k, -1).sum(1), routing  # its counts: the k choices' counts
