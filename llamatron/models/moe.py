"""A sparse mixture-of-experts MLP (Mixtral): a router sends each token to k of E SwiGLU experts.

A shared expert (`shared_expert_ffn`) runs on every token beside the routed ones (a family's MoE may build its own:
`MoE.shared_expert`, Qwen2-MoE's gated one).

Routing picks the k experts of the highest router logits. Their weights are Mixtral's by default: the softmax
over all experts, renormalised over the k to sum to 1 (without `moe_renormalize`, Qwen2-MoE's: the top k's softmax
weights as they are); with `router_score` sigmoid, each chosen logit's sigmoid (Llama 4; renormalised as
DeepSeek-V3's if `moe_renormalize`). A weight scales its expert's output (a family's MoE may weight otherwise by
overriding `MoE.run_experts`: Llama 4's scales the input, expert(w · x), families/llama4/moe.py). It is
dropless by default: every token reaches its k experts, however unevenly they are chosen (`moe_capacity_factor`
caps each expert's share of a sequence instead; DeepSeek-V3's balancing bias moves the top-k choice; both in
models/moe_balance.py). The tokens are sorted by
expert so that each expert's tokens are one contiguous run, and the experts run as two grouped GEMMs over
the runs (`torch._grouped_mm`, on CUDA in bf16) or, as the reference, a loop over the experts.

The router is trained by two losses besides the language-model loss, both computed per sequence, so that what
a step trains on does not depend on how the global batch is cut into micro-batches and ranks:
- load balancing (Switch Transformer, Mixtral): E · Σ_e f_e · P_e, with f_e the share of the sequence's
  tokens routed to expert e (summed over the k choices, so a balanced router scores k) and P_e the mean router
  probability of e over the sequence;
  with `router_aux_loss_scope: global_batch`, f_e is the global batch's instead (models/moe_balance.py);
- the z-loss (ST-MoE): the mean over the sequence's tokens of logsumexp(router logits)².
Each is averaged over sequences and MoE layers and weighted by `router_aux_loss_coef` / `router_z_loss_coef`.
Their gradient is attached to the layer's output (`_RouterLossGrad`), so they need no path of their own through
a pipeline; the engine sets `router_loss_weight` (1 / (sequences per step · MoE layers), per chunk).

Parallelism plugs in through attributes, as in the rest of models/: tensor parallelism sets `gather_input`,
`reduce_output` and `router_loss_share` and splits the experts' ffn; expert parallelism
(parallel/expert.py) replaces `dispatch`, which moves the tokens to the ranks holding their experts. Expert tensor
parallelism 1 routes each rank's sequence shard instead: `shards` sums the per-sequence statistics over the
shards, and `shared_input`/`shared_output` gather and reduce-scatter a tensor-parallel shared expert's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.gather_sum_op import gather_sum
from ..kernels.swiglu_op import swiglu
from .config import ModelConfig
from .moe_balance import MoEBalance, capacity_keep, expert_capacity


@dataclass
class Routing:
    """Where a micro-batch's token choices go: the (token, choice) pairs sorted by expert."""

    order: torch.Tensor  # (kept,) index into the flattened choices, sorted by expert (stable); all without drops
    counts: torch.Tensor  # (experts,) how many choices each expert got (kept ones)
    top_k: int
    # (tokens · k,) where each flattened choice sits in the sorted order; None when a capacity dropped some (`order`
    # then holds only the kept ones)
    inverse: torch.Tensor | None
    choices: int  # tokens · k, kept or not

    @property
    def source_tokens(self) -> torch.Tensor:
        """For each sorted choice, the token it came from."""
        return self.order // self.top_k


def route(chosen: torch.Tensor, num_experts: int, keep: torch.Tensor | None = None) -> Routing:
    """Sort the (tokens, k) expert choices by expert; ties keep token order (the same on every layout). keep: the
    choices a capacity leaves (None: all); the others are left out of the order."""
    flat = chosen.reshape(-1)
    if keep is None:
        order = torch.argsort(flat, stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return Routing(order, expert_counts(flat, num_experts), chosen.shape[1], inverse, flat.numel())
    kept = keep.reshape(-1)
    order = torch.argsort(torch.where(kept, flat, num_experts), stable=True)  # dropped choices sort last
    counts = expert_counts(flat, num_experts, kept.long())
    # a host read of how many were kept (a capacity's cost; dropless routing has none without ep)
    return Routing(order[: int(counts.sum())], counts, chosen.shape[1], None, flat.numel())


def expert_counts(chosen: torch.Tensor, num_experts: int, counted: torch.Tensor | None = None) -> torch.Tensor:
    """How often each expert occurs in `chosen` (a scatter, not bincount: its output size is fixed, so it
    compiles without a graph break); `counted`: 1 where a choice counts, 0 where not (default: all count)."""
    flat = chosen.reshape(-1)
    ones = torch.ones_like(flat) if counted is None else counted.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, ones)


def unpermute(rows: torch.Tensor, order: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """The inverse of `rows = x[order]` for a permutation `order`: row i goes back to position order[i]. With
    `total` rows out and fewer in `order` (dropped choices), the rows no index names are zero."""
    if total is None or total == rows.shape[0]:
        out = torch.empty_like(rows)
    else:
        out = rows.new_zeros((total, *rows.shape[1:]))
    out[order] = rows  # each row written once
    return out


def permute(tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
    """(tokens · k, hidden): each token's k copies, sorted by expert (the experts' input rows)."""
    if routing.inverse is None:  # some choices dropped: not a permutation (autograd's gather)
        return tokens[routing.source_tokens]
    return _Permute.apply(tokens, routing.source_tokens, routing.inverse, routing.top_k)


def combine(sorted_out: torch.Tensor, routing: Routing, weights: torch.Tensor) -> torch.Tensor:
    """(tokens, hidden): each token's k expert outputs, back in token order, weighted and summed."""
    if routing.inverse is None:  # some choices dropped: autograd's index assignment, zero rows for them
        unsorted = unpermute(sorted_out, routing.order, routing.choices)
        return (unsorted.view(weights.shape[0], routing.top_k, -1) * weights.unsqueeze(-1)).sum(1)
    return _Combine.apply(sorted_out, weights, routing.order, routing.inverse)


# The two permutations' backward passes as gathers: autograd's of an index (rows = tokens[source]) or an index
# assignment scatter-adds with atomics into zeros, and of the weighted sum writes the whole unsorted copy again;
# knowing the permutation, each gradient reads its rows through the inverse instead (issue 34: routing and
# permutation were ~13% of a fine-grained MoE step, RESULTS.md run 21).


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, source: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return tokens[source]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        # each token's k rows, read where they were sorted to, summed
        return gather_sum(grad, inverse, None, ctx.top_k), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, sorted_out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(sorted_out, weights, order, inverse)
        return gather_sum(sorted_out, inverse, weights, weights.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sorted_out, weights, order, inverse = ctx.saved_tensors
        tokens, top_k = weights.shape
        grad_sorted = grad[order // top_k] * weights.reshape(-1)[order].unsqueeze(-1)
        grad_weights = (sorted_out[inverse].view(tokens, top_k, -1) * grad.unsqueeze(1)).sum(-1)
        return grad_sorted, grad_weights, None, None


class SequenceShards:
    """How each sequence is split over ranks that route their parts separately (expert tensor parallelism 1:
    parallel/expert.py); this one: not split, every rank routes whole sequences."""

    count = 1  # parts of a sequence

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the parts of a statistic of this part (no gradient)."""
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, local, ...) -> (batch, whole sequence, ...), the parts in order (no gradient)."""
        return t

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, whole sequence, ...) -> this rank's part."""
        return t


def whole_sequence_sum(part: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """The sum over the sequence's parts of `part`, with the gradient of this rank's own part (each rank then
    gives its own tokens their share of a loss of the whole sequence)."""
    if shards.count == 1:
        return part
    return part + (shards.sum(part.detach()) - part.detach())


class GroupedMatmul(Protocol):
    """Another grouped matmul for the experts (FP8's: training/fp8_experts.py), with its two backward GEMMs on
    their own for expert parallelism's hand-written backward."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...

    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...

    def chain(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        first: torch.Tensor,
        second: torch.Tensor,
        between: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """second(between(first(x))): both matmuls at once (FP8's: one padding of the groups around both)."""
        ...


class Experts(nn.Module):
    """E SwiGLU MLPs as two stacked weights: gate_up (E, 2·ffn, hidden) laid out [gate; up] per expert, as the
    dense SwiGLU's, and down (E, hidden, ffn). Expert parallelism keeps a contiguous range of the experts;
    tensor parallelism a slice of every expert's ffn."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.swiglu_backend = "auto"  # models/kernels.py
        # auto: grouped GEMMs where torch has them (CUDA, bf16), else the loop; "loop": always the reference
        self.backend = "auto"
        self.grouped_mm: GroupedMatmul | None = None  # --fp8 installs FP8's (training/fp8.py)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (rows, hidden) sorted by expert, `counts[e]` rows for local expert e; returns (rows, hidden)."""
        if self.grouped_mm is not None:
            return self.grouped_mm.chain(x, counts, self.gate_up, self.down, self._swiglu)
        return self.finish(self.project(x, self.gate_up, counts), counts)

    def finish(self, gate_up_out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The rest of each expert after its gate_up matmul: SwiGLU, then down."""
        return self.project(self._swiglu(gate_up_out), self.down, counts)

    def _swiglu(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        return swiglu(gate_up_out, self.swiglu_backend)

    def project(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's rows times its matrix transposed (F.linear per expert): weight (experts, out, in)."""
        if self.grouped_mm is not None:
            return self.grouped_mm(x, weight, counts)
        if self.backend == "auto" and x.is_cuda and x.dtype == torch.bfloat16:
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
        # The reference: a matmul per expert (reads the counts on the host).
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            outs.append(F.linear(x[start : start + n], weight[e]))
            start += n
        return torch.cat(outs) if outs else x.new_zeros((0, weight.shape[1]))

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The gradient of project's x given its output's (for a backward written by hand: expert parallelism)."""
        if self.grouped_mm is not None:
            return self.grouped_mm.input_grad(grad, weight, counts)
        return self.project(grad, weight.transpose(-2, -1), counts)

    def weight_grad(
        self, grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """The gradient of project's weight (experts, out, in) given its output's: each expert's grad^T @ x."""
        if self.grouped_mm is not None:
            return self.grouped_mm.weight_grad(grad, x, counts).to(weight.dtype)
        grad_weight = torch.zeros_like(weight)  # an expert without rows gets zeros
        start = 0
        for e, n in enumerate(counts.tolist()):  # few local experts under ep: one matmul each
            grad_weight[e] = grad[start : start + n].t() @ x[start : start + n]
            start += n
        return grad_weight


class SharedExpert(nn.Module):
    """A SwiGLU every token goes through beside its routed experts. It belongs to every rank like a dense MLP
    (expert parallelism leaves it)."""

    # How tensor parallelism splits it: parallel/expert.py, beside the routed experts (not apply_tensor_parallel's
    # parallel linears: its partial sum joins theirs before their one reduction; a "replicated_partial" child, whole
    # on every rank, gets a tp-summed gradient); read by models/inventory.py
    tp_split = {"gate_up": "gate_up", "down": "row"}

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.swiglu_backend = "auto"  # models/kernels.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x), self.swiglu_backend))


# (tokens, chosen experts, routing, experts) -> the experts' outputs for the sorted choices; see MoE.dispatch
Dispatch = Callable[[torch.Tensor, Routing, Experts], torch.Tensor]


def local_dispatch(tokens: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
    """Every expert on this rank: gather the sorted choices' tokens and run them."""
    return experts(permute(tokens, routing), routing.counts)


@dataclass
class MoEStats:
    """One step's router statistics, summed over MoE layers and this rank's sequences (device tensors)."""

    aux: torch.Tensor  # load-balancing loss, unweighted, summed over (sequence, layer)
    z: torch.Tensor  # z-loss, likewise
    dropped: torch.Tensor  # token choices a capacity dropped, summed over layers
    choices: torch.Tensor  # (experts,) token choices each expert got (kept or dropped), summed over layers

    @staticmethod
    def zeros(num_experts: int, device: torch.device) -> MoEStats:
        return MoEStats(
            torch.zeros((), device=device),
            torch.zeros((), device=device),
            torch.zeros((), device=device),
            torch.zeros(num_experts, device=device),
        )

    def zero_(self) -> None:
        for t in (self.aux, self.z, self.dropped, self.choices):
            t.zero_()


class _RouterLossGrad(torch.autograd.Function):
    """Identity on the layer's output whose backward also gives the router losses their gradient, `weight`
    (Megatron-core attaches its aux loss the same way): no second output to carry through a pipeline."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, router_loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad, weight.expand(()), None


class MoE(nn.Module):
    """router -> top-k experts -> weighted sum; the block's MLP when cfg.num_experts > 0."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.experts_per_token
        self.aux_coef, self.z_coef = cfg.router_aux_loss_coef, cfg.router_z_loss_coef
        self.renormalize = cfg.moe_renormalize
        self.global_balance = cfg.router_aux_loss_scope == "global_batch"
        self.capacity_factor, self.drop_policy = cfg.moe_capacity_factor, cfg.moe_token_drop_policy
        # DeepSeek-V3's balancing bias (models/moe_balance.py): frozen, fp32, moved by the trainer after each step
        self.expert_bias: nn.Parameter | None = None
        if cfg.router_expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        self.sigmoid_scores = cfg.router_score == "sigmoid"
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size)
        self.shared: SharedExpert | None = self.shared_expert(cfg) if cfg.shared_expert_ffn else None
        self.dispatch: Dispatch = local_dispatch
        # Tensor parallelism: the whole sequence in, this rank's partial sum out (identities on one rank), and
        # each tp rank's share of the router losses' gradient (every one of them computes the whole loss).
        self.gather_input: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.reduce_output: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.router_loss_share = 1.0
        self.shards = SequenceShards()
        # A shared expert's way in and out (etp 1: it stays split over tp while the routed tokens are local)
        self.shared_input: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.shared_output: Callable[[torch.Tensor], torch.Tensor] = _identity
        # Set by the engine for training (None: no router losses, no statistics, as in evaluation and generation).
        self.router_loss_weight: torch.Tensor | None = None
        self.stats: MoEStats | None = None
        self.balance: MoEBalance | None = None  # the step's routing counts (set with the router-loss weight) ...
        # ... and this layer's rows of them, as tensors: an int row index would be a constant torch.compile guards
        # on, one recompilation per layer (eight, then the rest ran eagerly: an 8% slower step, session 46)
        self.balance_load: torch.Tensor | None = None
        self.balance_global_load: torch.Tensor | None = None
        self.recomputing = False  # full recompute's second forward: the statistics were counted the first time

    def shared_expert(self, cfg: ModelConfig) -> SharedExpert:
        """The shared expert of a model with one (cfg.shared_expert_ffn > 0); a family's MoE overrides this to build
        its own (Qwen2-MoE's gated one)."""
        return SharedExpert(cfg.hidden_size, cfg.shared_expert_ffn)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' weighted sum for each token of x (batch, seq, hidden), plus `residual` when given."""
        full = self.gather_input(x)
        batch, seq, hidden = full.shape
        tokens = full.reshape(-1, hidden)
        logits = self.router(tokens)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # the load-balancing loss's, whatever the score
        weights, chosen = self.route(logits, probs)
        weights = weights.to(full.dtype)
        keep = None if self.capacity_factor is None else self._capacity_keep(chosen, weights, batch)
        out, routing = self.run_experts(tokens, chosen, weights, keep)
        if self.shared is not None:
            out = out + self.shared_output(self.shared(self.shared_input(full))).reshape(-1, hidden)
        # the router's choices, kept or dropped, over whole sequences: what the balancing counts
        choices = routing.counts if keep is None else expert_counts(chosen, self.num_experts)
        if self.balance is not None and self.balance.routing_pass:
            assert self.balance_global_load is not None
            self.balance_global_load.add_(self.shards.sum(choices))
        if self.router_loss_weight is not None and torch.is_grad_enabled():
            choices = self.shards.sum(choices)
            kept = None if keep is None else self.shards.sum(routing.counts)
            out = self._attach_router_losses(out, logits, probs, chosen, choices, batch, kept)
        out = self.reduce_output(out.view(batch, seq, hidden))
        return out if residual is None else residual + out

    def _capacity_keep(self, chosen: torch.Tensor, weights: torch.Tensor, batch: int) -> torch.Tensor:
        """capacity_keep over whole sequences (gathered from their parts), this rank's part of it."""
        k, parts = self.top_k, self.shards
        whole_chosen = parts.gather(chosen.view(batch, -1, k))
        capacity = expert_capacity(self.capacity_factor or 0.0, whole_chosen.shape[1], k, self.num_experts)
        keep = capacity_keep(
            whole_chosen.reshape(-1, k),
            parts.gather(weights.view(batch, -1, k)).reshape(-1, k),
            batch,
            capacity,
            self.drop_policy,
            self.num_experts,
        )
        return parts.local(keep.view(batch, -1, k)).reshape(-1, k)

    def route(self, logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the chosen experts' weights (tokens, k), fp32; the experts (tokens, k)) from the router's logits and
        their softmax: the top k (_choose), renormalised where the model says. A family's MoE routes otherwise by
        overriding this (DeepSeek-V3's group-limited routing)."""
        top, chosen = self._choose(logits, probs)
        return (top / top.sum(-1, keepdim=True) if self.renormalize else top), chosen

    def _choose(self, logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the chosen experts' scores, (tokens, k) experts): the top k by score, or with the balancing bias by
        score + bias (DeepSeek-V3: the bias picks, the unbiased score weighs)."""
        if self.expert_bias is None:
            top, chosen = torch.topk(logits.float() if self.sigmoid_scores else probs, self.top_k, dim=-1)
            return (torch.sigmoid(top) if self.sigmoid_scores else top), chosen
        scores = torch.sigmoid(logits.float()) if self.sigmoid_scores else probs
        _, chosen = torch.topk(scores.detach() + self.expert_bias.float(), self.top_k, dim=-1)
        return scores.gather(-1, chosen), chosen

    def run_experts(
        self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None
    ) -> tuple[torch.Tensor, Routing]:
        """(each token's chosen experts' outputs, weighted and summed (tokens, hidden); the routing, whose counts
        are the k choices' per expert): w · expert(x). A family's MoE weights otherwise by overriding this (Llama
        4's scales the input)."""
        routing = route(chosen, self.num_experts, keep)
        return combine(self.dispatch(tokens, routing, self.experts), routing, weights), routing

    def _attach_router_losses(
        self,
        out: torch.Tensor,
        logits: torch.Tensor,
        probs: torch.Tensor,
        chosen: torch.Tensor,
        counts: torch.Tensor,
        batch: int,
        kept: torch.Tensor | None,
    ) -> torch.Tensor:
        """counts: each expert's token choices (the router's, kept or dropped); kept: those a capacity kept (None:
        dropless)."""
        global_load = None
        if self.global_balance:
            assert self.balance_global_load is not None, "no routing pass"
            global_load = self.balance_global_load
        aux, z = router_losses(logits, probs, chosen, batch, self.num_experts, global_load, self.shards)
        if self.stats is not None and not self.recomputing:
            self.stats.aux.add_(aux.detach().sum())
            self.stats.z.add_(z.detach().sum())
            self.stats.choices.add_(counts)
            if kept is not None:
                self.stats.dropped.add_(counts.sum() - kept.sum())
            if self.balance_load is not None:
                self.balance_load.add_(counts)
        loss = self.aux_coef * aux.sum() + self.z_coef * z.sum()
        assert self.router_loss_weight is not None
        return _RouterLossGrad.apply(out, loss, self.router_loss_weight * self.router_loss_share)


def router_losses(
    logits: torch.Tensor,
    probs: torch.Tensor,
    chosen: torch.Tensor,
    batch: int,
    num_experts: int,
    global_load: torch.Tensor | None = None,
    shards: SequenceShards | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) of each of the `batch` sequences (fp32): see the module docstring. With
    `global_load` (each expert's token choices over the global batch) the shares f are the global batch's: the
    sequences' losses then sum to sequences x the global batch's loss (their mean over the step is that loss).
    shards: how the sequences are split over ranks (these are this rank's parts): the sums are over whole ones."""
    parts = shards or SequenceShards()
    local = probs.shape[0] // batch
    seq = local * parts.count
    mean_prob = whole_sequence_sum(probs.view(batch, local, num_experts).sum(1), parts) / seq
    if global_load is None:
        ones = torch.ones(chosen.shape, device=probs.device).view(batch, -1)
        share = parts.sum(torch.zeros_like(mean_prob).scatter_add_(1, chosen.reshape(batch, -1), ones)) / seq
    else:  # k · load / choices: a token's share, summed over its k choices, as per sequence
        share = (chosen.shape[1] * global_load.float() / global_load.sum().clamp_min(1)).expand_as(mean_prob)
    aux = num_experts * (share * mean_prob).sum(-1)
    z = whole_sequence_sum(torch.logsumexp(logits.float(), dim=-1).pow(2).view(batch, local).sum(1), parts) / seq
    return aux, z


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


__all__ = [
    "MoE",
    "MoEBalance",
    "MoEStats",
    "Experts",
    "SharedExpert",
    "Routing",
    "SequenceShards",
    "combine",
    "local_dispatch",
    "permute",
    "route",
    "router_losses",
    "unpermute",
]
