"""How a mixture of experts keeps its experts' loads even, besides the router losses (models/moe.py):

- **Global-batch balancing** (Qwen3's): the load-balancing loss E · Σ_e f_e · P_e with f_e, the expert's share of
  the token choices, counted over every token of the step's global batch (all micro-batches, all data-parallel
  ranks) instead of each sequence. A micro-batch's backward needs f of the whole step, so a step first routes its
  micro-batches without gradient (a forward pass that only counts, `MoEBalance.routing_pass`) and reduces the
  counts over the data-parallel ranks; the step's forward passes then weigh their router probabilities with them.
  Exact at any layout and micro-batch size (Megatron-core's `global_aux_loss` averages the counts of the
  micro-batches seen so far instead, which depends on the layout).
- **Auxiliary-loss-free balancing** (DeepSeek-V3): a per-expert bias added to the router's scores for the top-k
  choice only (the gate weights are the unbiased scores), moved after each step by
  bias_e += rate · sign(mean load − load_e), the loads being the step's token choices of the layer over all ranks.
  It is not trained (no gradient, no optimizer state): a frozen fp32 parameter, so checkpoints save and reshard it
  like any weight.
- **Capacity** (GShard/Switch's token dropping): an expert takes at most ceil(factor · seq · k / experts) of each
  sequence's assignments; the others are dropped (their output is zero; the residual carries the token). The group
  is the sequence, which every layout routes whole on one rank (context parallelism is refused with experts), so
  which assignments drop never depends on tp, ep, dp, pp or the micro-batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass
class MoEBalance:
    """The per-step routing counts every MoE layer of a rank shares (device tensors), one row per MoE layer here.

    loads: the step's token choices of each layer on this rank (the bias update's); global_loads: the global
    batch's (all ranks), from the routing pass (global-batch balancing only); routing_pass: set while it runs. A
    layer's rows are its `balance_load` and `balance_global_load`."""

    loads: torch.Tensor
    global_loads: torch.Tensor | None = None
    routing_pass: bool = False

    def zero_(self) -> None:
        self.loads.zero_()
        if self.global_loads is not None:
            self.global_loads.zero_()


def expert_capacity(factor: float, seq: int, top_k: int, num_experts: int) -> int:
    """The most assignments of one sequence an expert takes."""
    return math.ceil(factor * seq * top_k / num_experts)


def capacity_keep(
    chosen: torch.Tensor, weights: torch.Tensor, batch: int, capacity: int, policy: str, num_experts: int
) -> torch.Tensor:
    """(tokens, k) True for the assignments kept: for each sequence of the `batch` and expert, the first `capacity`
    of its assignments by priority. policy "probs": the highest routing weight first, equal weights by position
    (Megatron-core's default: what is dropped is what the outputs weigh least); "position": the earlier token
    first (a token's fate then depends on no later token)."""
    experts = chosen.reshape(batch, -1)  # per sequence, assignments in position order (token, choice)
    n = experts.shape[1]
    positions = torch.arange(n, device=chosen.device).expand(batch, n)
    if policy == "probs":
        by_weight = torch.argsort(-weights.detach().float().reshape(batch, -1), dim=1, stable=True)
        rank = torch.empty_like(experts).scatter_(1, by_weight, positions)
    else:
        rank = positions
    order = torch.argsort(experts * n + rank, dim=1)  # by expert, then by priority (keys are distinct)
    sorted_experts = experts.gather(1, order)
    counts = torch.zeros(batch, num_experts, dtype=torch.long, device=chosen.device)
    counts.scatter_add_(1, experts, torch.ones_like(experts))
    starts = counts.cumsum(1) - counts  # where each expert's run begins in the sorted order
    kept_sorted = positions - starts.gather(1, sorted_experts) < capacity
    keep = torch.empty_like(kept_sorted).scatter_(1, order, kept_sorted)
    return keep.view_as(chosen)


def updated_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's update: each expert's bias moves by `rate` towards the mean load (down when over it)."""
    load = load.float()
    return bias + rate * torch.sign(load.mean() - load)


def balancing_run_problems(model: ModelConfig, lora: bool, fsdp: bool) -> list[str]:
    """What the balancing bias cannot be trained with: LoRA (its saves hold only the adapters, and the frozen base
    is named, not written: the moved bias would be lost) and --fsdp (its sharded buffer holds only trained
    parameters; the bias is a frozen one)."""
    if not (model.is_moe and model.router_expert_bias):
        return []
    out = []
    if lora:
        out.append("router_expert_bias moves the base model's routing, which LoRA (--lora-rank) keeps frozen: drop one")
    if fsdp:
        out.append("router_expert_bias with --fsdp: its sharded parameters hold no frozen bias; drop one")
    return out


__all__ = ["MoEBalance", "balancing_run_problems", "capacity_keep", "expert_capacity", "updated_expert_bias"]
