"""Direct preference optimisation (DPO): raise the policy's log-probability of the chosen response against the
rejected one, relative to a frozen reference model.

A micro-batch holds whole pairs, chosen at even rows and rejected at odd ones (data/preference_dataset.py), and
each sequence's reference log-probability (`ref_logps`, from the run's reference pass, training/reference_logps.py).
A sequence's log-probability is minus the sum of its response tokens' cross entropy: the same per-token loss as the
language model (vocabulary-parallel under tensor parallelism, so the whole vocabulary's logits never exist).
With h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)), a pair's loss is

    sigmoid       -log sigmoid(beta h)                                   (Rafailov et al. 2023)
    ipo           (h' - 1 / (2 beta))^2, h' from per-token mean ratios    (Azar et al. 2023, as TRL normalises it)
    sigmoid_norm  -log sigmoid(beta h'), h' as for ipo                    (length-normalised DPO)

and the step minimises the mean over the global batch's pairs. Logged with each step, over its pairs: the rewards
beta * (log pi - log ref) of the chosen and rejected responses, their margin, the reward accuracy (chosen above
rejected) and the policy's log-probabilities, as TRL names and computes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

from ..models import IGNORE_INDEX, ModelConfig, Transformer
from ..parallel.mesh import Mesh, all_reduce
from .language_model import PerTokenLoss, RoutedObjective, RouterTraining, per_token_loss

_STATS = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "logps_chosen", "logps_rejected")


def preference_problems(
    objective: str, preference_data: str | None, other_data: list[str], micro_batch_size: int
) -> list[str]:
    """--objective dpo needs preference data, and micro-batches of whole pairs; other_data: the other data flags
    given (--data, --sft-data, --mock-data)."""
    if objective != "dpo":
        return ["--preference-data is read by --objective dpo only; add it, or drop --preference-data"] * bool(
            preference_data
        )
    problems = []
    if preference_data is None:
        problems.append(
            "--objective dpo needs --preference-data PREFIX (written by `llamatron preprocess --preference`)"
        )
    if other_data:
        problems.append(f"--objective dpo trains on --preference-data only; drop {', '.join(other_data)}")
    if micro_batch_size % 2:
        problems.append(
            f"--objective dpo: --micro-batch-size {micro_batch_size} must be even (a micro-batch holds whole "
            f"pairs of a chosen and a rejected sequence); use {micro_batch_size + 1}"
        )
    return problems


def pair_losses(kind: str, beta: float, ratios: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each pair's loss from the log-ratios log pi - log ref of its sequences (chosen, rejected alternating) and
    their response token counts."""
    chosen, rejected = ratios[0::2], ratios[1::2]
    if kind == "sigmoid":
        return -F.logsigmoid(beta * (chosen - rejected))
    per_token = ratios / tokens.clamp_min(1)
    h = per_token[0::2] - per_token[1::2]
    if kind == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    assert kind == "sigmoid_norm", kind  # --dpo-loss's choices allow no other
    return -F.logsigmoid(beta * h)


class PreferenceObjective(RoutedObjective):
    """DPO over this rank's chunks (see the module docstring); an `Objective`."""

    def __init__(
        self,
        per_token: PerTokenLoss,
        mesh: Mesh,
        device: torch.device,
        beta: float,
        kind: str = "sigmoid",
        router: RouterTraining | None = None,
    ):
        self.per_token_loss, self.mesh, self.device, self.router = per_token, mesh, device, router
        self.beta, self.kind = beta, kind
        self.stats = torch.zeros(len(_STATS), device=device)  # sums over the step's pairs on this rank

    @classmethod
    def build(
        cls,
        chunks: list[Transformer],
        model_cfg: ModelConfig,
        mesh: Mesh,
        device: torch.device,
        beta: float,
        kind: str,
        kernel: str = "auto",
        compile: bool = False,
    ) -> PreferenceObjective:
        router = RouterTraining.attach(chunks, model_cfg, device)
        return cls(per_token_loss(chunks, kernel, compile), mesh, device, beta, kind, router)

    def per_token(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.per_token_loss(logits, labels)

    def sequence_logps(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each sequence's log-probability of its response tokens, fp32; the number of those tokens)."""
        logps, tokens = -self.per_token_loss(logits, labels).sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1)
        if self.mesh.layout.cp > 1:  # each context-parallel rank holds part of every sequence: sum the parts
            # (autograd's all-reduce: its backward sums the ranks' gradients, each rank's loss being 1/cp of it,
            # as the normaliser counts every pair once per context-parallel rank)
            logps = dist_nn.all_reduce(logps, group=self.mesh.cp_group)
            tokens = all_reduce(tokens.clone(), self.mesh.cp_group)
        return logps, tokens

    def normaliser(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The pairs of the whole global batch, times the context-parallel size (each cp rank holds every pair)."""
        pairs = sum(int(mb["input_ids"].shape[0]) // 2 for mb in micro_batches)
        local = torch.tensor(float(pairs), device=self.device)
        return all_reduce(local, self.mesh.replica_group).clamp_min(1.0)

    def _pairs(self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(each pair's loss, the sums of _STATS over the micro-batch's pairs)."""
        logps, tokens = self.sequence_logps(logits, mb["labels"])
        ratios = logps - mb["ref_logps"].to(logps.dtype)
        with torch.no_grad():
            rewards = self.beta * ratios
            sums = torch.stack(
                [
                    rewards[0::2].sum(),
                    rewards[1::2].sum(),
                    (rewards[0::2] > rewards[1::2]).sum().float(),
                    logps[0::2].sum(),
                    logps[1::2].sum(),
                ]
            )
        return pair_losses(self.kind, self.beta, ratios, tokens), sums

    def loss(self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor], normaliser: torch.Tensor) -> torch.Tensor:
        losses, sums = self._pairs(logits, mb)
        self.stats += sums
        return losses.sum() / normaliser

    eval_width = len(_STATS) + 2

    def eval_sums(self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[the DPO loss, then _STATS, summed over the micro-batch's pairs; the pairs] (float64)."""
        losses, sums = self._pairs(logits, mb)
        pairs = torch.tensor([losses.numel()], device=losses.device)
        return torch.cat([losses.detach().sum().reshape(1), sums, pairs]).double()

    def eval_fields(self, sums: list[float]) -> dict[str, float]:
        """Evaluation's DPO metrics on the validation pairs: each a mean over them."""
        pairs = max(sums[-1], 1.0)
        out = {"dpo_loss": sums[0] / pairs, **{k: v / pairs for k, v in zip(_STATS, sums[1:-1])}}
        out["rewards_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
        return out

    def begin_step(self, sequences: int, loss_scale: torch.Tensor | None) -> None:
        self.stats.zero_()
        super().begin_step(sequences, loss_scale)

    def local_stats(self) -> torch.Tensor:
        """This rank's sums of _STATS over the step's pairs, then a mixture of experts' router statistics (copies;
        no collective)."""
        return self.stats.clone() if self.router is None else torch.cat([self.stats, self.router.local_stats()])

    def step_stats(self, local: torch.Tensor, sequences: int) -> torch.Tensor:
        """The step's means over its pairs (_STATS), then a mixture of experts' router statistics: a collective
        over every rank (the last pipeline stage computed them; tensor- and context-parallel ranks the same)."""
        flat = local[: len(_STATS)].clone()
        if self.mesh.world_size > 1:
            torch.distributed.all_reduce(flat)
        flat = flat / (self.mesh.layout.tp * self.mesh.layout.cp * max(sequences // 2, 1))
        if self.router is None:
            return flat
        return torch.cat([flat, self.router.step_stats(local[len(_STATS) :], sequences, self.mesh)])

    def stat_fields(self, values: list[float]) -> dict[str, Any]:
        out: dict[str, Any] = dict(zip(_STATS, values))
        out["rewards_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
        if self.router is not None:
            out.update(RouterTraining.fields(values[len(_STATS) :]))
        return out


__all__ = ["PreferenceObjective", "pair_losses", "preference_problems"]
