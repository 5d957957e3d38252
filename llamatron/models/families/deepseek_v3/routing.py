"""DeepSeek-V3's group-limited top-k routing (node-limited routing in the paper, section 2.1.2).

Each token's score for expert e is sigmoid(logit_e). The experts are cut into `n_group` groups of equal size; a
group is scored by the sum of its two best biased scores, the token keeps its `topk_group` best groups, and picks
its `top_k` experts among theirs. The auxiliary-loss-free balancing bias (`correction_bias`, transformers'
e_score_correction_bias, models/moe_balance.py's expert bias) is added to the scores for those choices only; the
chosen experts' weights are their unbiased scores, renormalised to sum to 1 with `norm_topk_prob`, then times
`routed_scaling_factor`. With one group (or every group kept) it is plain top-k of the biased scores.
"""

from __future__ import annotations

import torch


def group_limited_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen (tokens, top_k) expert ids, their weights (tokens, top_k) in fp32) for router `logits` (tokens,
    experts). The weights carry the gradient of the scores; the choice none (the bias is a constant of the step).
    The rules on the sizes are `routing_problems`'s, checked with the config, not here."""
    scores = torch.sigmoid(logits.float())
    choice = scores.detach()
    if correction_bias is not None:
        choice = choice + correction_bias.float()
    if topk_group < n_group:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, n_group, experts // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros(tokens, n_group, dtype=torch.bool, device=choice.device).scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
    chosen = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return chosen, weights * routed_scaling_factor


def routing_problems(num_experts: int, n_group: int, topk_group: int, top_k: int) -> list[str]:
    """Why these sizes cannot route (empty when they can), each with what would."""
    if n_group < 1 or num_experts % n_group:
        return [f"n_group={n_group} does not divide n_routed_experts={num_experts}: use a divisor of it"]
    out = []
    per_group = num_experts // n_group
    if n_group > 1 and per_group < 2:
        out.append(f"n_group={n_group} leaves {per_group} expert a group; a group is scored by its best 2: use fewer")
    if not 1 <= topk_group <= n_group:
        out.append(f"topk_group={topk_group}: must be in [1, n_group={n_group}]")
    elif not 1 <= top_k <= topk_group * per_group:
        out.append(f"num_experts_per_tok={top_k}: must be in [1, {topk_group * per_group}] (the kept groups' experts)")
    return out


__all__ = ["group_limited_topk", "routing_problems"]
