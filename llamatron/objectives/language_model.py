"""Next-token prediction: the cross entropy of every label token, as a mean over the global batch's label tokens.

The per-token loss is the fused cross entropy of one device (kernels/cross_entropy_op.py: a Triton kernel each way
on CUDA, torch's compiled one with --cross-entropy-backend torch), or under tensor parallelism the
vocabulary-parallel one (parallel/tensor_layers.py), which never builds the whole vocabulary's logits. Labels of
IGNORE_INDEX (SFT prompts, document ends with --eod-mask-loss, padding) count nothing, in the sum and in the
normaliser. A mixture of experts' router losses (load balancing, z-loss) are this objective's too: their weight and
statistics live in `RouterTraining`, their gradient rides on each MoE layer's output (models/moe.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.cross_entropy_op import CrossEntropy
from ..models import IGNORE_INDEX, ModelConfig, Transformer
from ..models.moe import MoE, MoEBalance, MoEStats
from ..models.moe_balance import updated_expert_bias
from ..models.transformer import extra_heads_of
from ..parallel.mesh import Mesh, all_reduce
from ..parallel.tensor_layers import VocabParallelCrossEntropy
from .extra_heads import ExtraHeadsTraining

PerTokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class RouterTraining:
    """What a mixture of experts' routers train with: the weight of their losses' gradient (one device tensor every
    MoE layer of this rank reads) and the step's router statistics (summed by every MoE layer of this rank)."""

    loss_weight: torch.Tensor
    stats: MoEStats
    num_layers: int  # MoE layers in the whole model
    balance: MoEBalance  # the step's routing counts of this rank's MoE layers (models/moe_balance.py)
    layers: list[MoE]  # this rank's MoE layers, in the rows of `balance`
    global_batch: bool  # the load-balancing loss counts the global batch's loads (a routing pass each step)
    bias_rate: float | None  # DeepSeek-V3's bias update rate; None: no bias

    @staticmethod
    def attach(chunks: list[Transformer], model_cfg: ModelConfig, device: torch.device) -> RouterTraining | None:
        if not model_cfg.is_moe:
            return None
        layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoE)]
        global_batch = model_cfg.router_aux_loss_scope == "global_batch"
        shape = (len(layers), model_cfg.num_experts)
        balance = MoEBalance(
            torch.zeros(shape, device=device),
            torch.zeros(shape, device=device) if global_batch else None,
        )
        # an extra head's MoE layers (DeepSeek-V3's MTP blocks) route and count too, on the last stage: every rank
        # counts them from the model's config
        extra = extra_heads_of(model_cfg)
        extra_moe = 0 if extra is None else sum(isinstance(m, MoE) for m in extra.modules())
        run = RouterTraining(
            torch.zeros((), device=device),
            MoEStats.zeros(model_cfg.num_experts, device),
            model_cfg.num_moe_layers + extra_moe,
            balance,
            layers,
            global_batch,
            model_cfg.router_bias_update_rate if model_cfg.router_expert_bias else None,
        )
        for row, m in enumerate(layers):
            m.router_loss_weight, m.stats, m.balance = run.loss_weight, run.stats, balance
            m.balance_load = balance.loads[row]
            m.balance_global_load = None if balance.global_loads is None else balance.global_loads[row]
        return run

    def begin_step(self, sequences: int, loss_scale: torch.Tensor | None) -> None:
        """Weigh the router losses as a mean over the step's sequences and the MoE layers; restart the counts."""
        weight = 1.0 / (sequences * self.num_layers)
        if loss_scale is None:
            self.loss_weight.fill_(weight)
        else:  # fp16: like the language-model loss, the gradient is the scaled one
            self.loss_weight.copy_(loss_scale * weight)
        self.stats.zero_()
        self.balance.zero_()

    def route_global_batch(self, forward_all: Callable[[], None], mesh: Mesh) -> None:
        """Global-batch balancing's routing pass, before the step's forward passes: `forward_all` runs the step's
        micro-batches forward without gradient; every MoE layer counts its choices, summed over the data-parallel
        ranks (the tensor-parallel ranks of a layer route the same tokens; a pipeline stage counts its own
        layers)."""
        if not self.global_batch:
            return
        self.balance.routing_pass = True
        try:
            with torch.no_grad():
                forward_all()
        finally:
            self.balance.routing_pass = False
        assert self.balance.global_loads is not None
        if mesh.replica_group is not None and mesh.layout.dp * mesh.layout.cp > 1:
            torch.distributed.all_reduce(self.balance.global_loads, group=mesh.replica_group)

    def end_step(self, mesh: Mesh) -> None:
        """After the optimizer step: DeepSeek-V3's bias update from each layer's loads of the step, over all
        data-parallel ranks (the same on every rank: the sums of integers are exact), outside the gradient."""
        if self.bias_rate is None:
            return
        loads = self.balance.loads
        if mesh.replica_group is not None and mesh.layout.dp * mesh.layout.cp > 1:
            loads = all_reduce(loads.clone(), mesh.replica_group)
        with torch.no_grad():
            for m, load in zip(self.layers, loads):
                assert m.expert_bias is not None
                m.expert_bias.copy_(updated_expert_bias(m.expert_bias, load, self.bias_rate))

    def local_stats(self) -> torch.Tensor:
        """This rank's sums of the step's router statistics, copied (no collective: a step that is not logged
        reduces nothing; `step_stats` reduces the logged one's)."""
        s = self.stats
        return torch.cat([s.aux.reshape(1), s.z.reshape(1), s.dropped.reshape(1), s.choices]).float()

    def step_stats(self, local: torch.Tensor, sequences: int, mesh: Mesh) -> torch.Tensor:
        """[load-balancing loss, z-loss, the share of token choices a capacity dropped, each expert's share of the
        token choices] of the whole step from each rank's `local_stats` (a collective: `summed`)."""
        return self.normalised(summed(local, mesh), sequences)

    def normalised(self, flat: torch.Tensor, sequences: int) -> torch.Tensor:
        """step_stats from the statistics summed over every rank."""
        total = flat[3:].sum().clamp_min(1.0)
        return torch.cat([flat[:2] / (sequences * self.num_layers), flat[2:3] / total, flat[3:] / total])

    @staticmethod
    def fields(values: list[float]) -> dict[str, Any]:
        """step_stats' values by name: the load-balancing and z-losses, unweighted, averaged over sequences and
        layers, the share of the token choices a capacity dropped (0 dropless) and each expert's share of them."""
        return {
            "moe_aux_loss": values[0],
            "moe_z_loss": values[1],
            "moe_dropped_fraction": values[2],
            "expert_token_share": values[3:],
        }


def summed(local: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Every rank's statistics summed (a collective over every rank: pipeline stages hold different layers,
    data-parallel ranks different sequences), counted once per tensor-parallel group (its ranks count the same
    tokens)."""
    flat = local.clone()
    if mesh.world_size > 1:
        torch.distributed.all_reduce(flat)
    return flat / mesh.layout.tp


def per_token_loss(chunks: list[Transformer], kernel: str = "auto", compile: bool = False) -> PerTokenLoss:
    """The cross entropy of each token for this rank's `chunks`: the vocabulary-parallel one under tensor
    parallelism, else the fused one-device one (`kernel` auto, triton or torch; `compile` fuses torch's fp32
    upcast)."""
    shard = chunks[-1].parallel.vocab
    if shard is not None:
        return VocabParallelCrossEntropy(shard)
    per_token = CrossEntropy(kernel)
    return torch.compile(per_token, dynamic=False) if compile else per_token


class RoutedObjective:
    """The step hooks a mixture of experts' router needs from any objective (none for a dense model)."""

    router: RouterTraining | None
    extra: ExtraHeadsTraining | None = None  # a family's extra prediction heads (objectives/extra_heads.py)
    mesh: Mesh

    def begin_step(self, sequences: int, loss_scale: torch.Tensor | None) -> None:
        if self.router is not None:
            self.router.begin_step(sequences, loss_scale)
        if self.extra is not None:
            self.extra.loss_sum.zero_()

    def before_forward(self, forward_all: Callable[[], None]) -> None:
        if self.router is not None:
            self.router.route_global_batch(forward_all, self.mesh)

    def end_step(self) -> None:
        if self.router is not None:
            self.router.end_step(self.mesh)


class LanguageModelObjective(RoutedObjective):
    """The language-model loss of one rank's chunks (see the module docstring); an `Objective`."""

    def __init__(
        self,
        per_token: PerTokenLoss,
        mesh: Mesh,
        device: torch.device,
        router: RouterTraining | None = None,
        extra: ExtraHeadsTraining | None = None,
    ):
        self.per_token_loss, self.mesh, self.device, self.router = per_token, mesh, device, router
        self.extra = extra

    @classmethod
    def build(
        cls,
        chunks: list[Transformer],
        model_cfg: ModelConfig,
        mesh: Mesh,
        device: torch.device,
        kernel: str = "auto",
        compile: bool = False,
    ) -> LanguageModelObjective:
        """The objective for this rank's `chunks` (per_token_loss says what `kernel` and `compile` pick)."""
        router = RouterTraining.attach(chunks, model_cfg, device)
        extra = ExtraHeadsTraining.attach(chunks, model_cfg, device)
        return cls(per_token_loss(chunks, kernel, compile), mesh, device, router, extra)

    def per_token(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.per_token_loss(logits, labels)

    def normaliser(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The label tokens of the whole global batch (this rank's, summed over the dp x cp replicas); with extra
        heads, followed by each head's label count (a vector)."""
        counts = [(mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches]
        local = torch.stack(counts).sum().to(self.device, torch.float32)
        if self.extra is not None:
            local = torch.cat([local.reshape(1), self.extra.counts(micro_batches).to(self.device)])
        return all_reduce(local, self.mesh.replica_group).clamp_min(1.0)

    def loss(self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor], normaliser: torch.Tensor) -> torch.Tensor:
        if self.extra is None:
            return self.per_token_loss(logits, mb["labels"]).sum() / normaliser
        main = self.per_token_loss(logits, mb["labels"]).sum() / normaliser[0]
        return main + self.extra.loss(self.per_token_loss, mb, normaliser[1:])

    def local_stats(self) -> torch.Tensor | None:
        """A mixture of experts' router statistics on this rank (RouterTraining.local_stats), then the extra heads'
        loss; None for a dense model without extra heads."""
        parts = [] if self.router is None else [self.router.local_stats()]
        if self.extra is not None:
            parts.append(self.extra.loss_sum.reshape(1).float())
        return torch.cat(parts) if parts else None

    def step_stats(self, local: torch.Tensor, sequences: int) -> torch.Tensor:
        """The logged step's statistics over every rank (one collective)."""
        flat = summed(local, self.mesh)
        if self.extra is None:
            assert self.router is not None
            return self.router.normalised(flat, sequences)
        router = [] if self.router is None else [self.router.normalised(flat[:-1], sequences)]
        return torch.cat([*router, flat[-1:]])

    def stat_fields(self, values: list[float]) -> dict[str, Any]:
        if self.extra is None:
            return RouterTraining.fields(values)
        router = {} if self.router is None else RouterTraining.fields(values[:-1])
        return {**router, self.extra.stat_name: values[-1]}

    eval_width = 0  # evaluation's token metrics are this objective's

    def eval_sums(self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64, device=logits.device)

    def eval_fields(self, sums: list[float]) -> dict[str, float]:
        return {}


__all__ = ["LanguageModelObjective", "RouterTraining", "per_token_loss"]
