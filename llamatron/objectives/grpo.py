"""Group relative policy optimisation (GRPO) and its variants, as TRL 1.16's GRPOTrainer names and computes them.

A step trains on rollouts: G completions sampled for each prompt (training/rollouts.py), each scored by the reward
functions (objectives/rewards.py). A completion's advantage is its reward against its group's (`group_advantages`);
the loss of each completion token t is the clipped policy-gradient term

    r_t = exp(log pi(t) - log pi_old(t))        (token level; GSPO's sequence level: the mean log-ratio over the
                                                 completion, one ratio per sequence)
    l_t = -min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon_high) A) + beta KL_t,
    KL_t = exp(ref_t - log pi(t)) - (ref_t - log pi(t)) - 1          (k3, to the reference; beta 0 by default)

with log pi_old the behaviour log-probabilities kept from sampling time, every log-probability that of the logits
divided by the sampling temperature (as TRL computes them), and the step's loss the tokens' losses aggregated by
the loss type:

    grpo      each completion's mean over its tokens, then the mean over the completions
    bnpo      each micro-batch's mean over its tokens, then the mean over the micro-batches
    dr_grpo   the sum over every token / (completions x --max-completion-length)
    dapo      the sum over every token / the step's completion tokens (TRL's default)

A micro-batch holds whole completions (prompt and completion, labels only on the completion): `input_ids`,
`labels`, `old_logps` (per position, aligned with labels), `advantages` (per row) and, with beta > 0,
`ref_logps`. The logged statistics are TRL's: the clipped shares (low: r < 1 - epsilon with A < 0, high:
r > 1 + epsilon_high with A > 0, region: either) over the completion tokens (sequence level: over the completions),
and the mean KL over the completion tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config.objective_settings import ObjectiveConfig
from ..models import IGNORE_INDEX
from ..parallel.mesh import Mesh, all_reduce
from .language_model import PerTokenLoss, RoutedObjective, RouterTraining, summed

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_LEVELS = ("token", "sequence")
# (clipped low, high, region, ratios counted, KL sum, completion tokens): this rank's sums over a step
_SUMS = 6
_STATS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl")


@dataclass(frozen=True)
class GRPOSettings:
    """The loss's settings (the --flags of the same names)."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon (no clip-higher)
    beta: float = 0.0
    importance_sampling_level: str = "token"
    max_completion_length: int = 256  # dr_grpo's constant normaliser
    temperature: float = 1.0  # the log-probabilities are those of logits / temperature

    @staticmethod
    def of(ob: ObjectiveConfig) -> GRPOSettings:
        """The settings of --objective grpo's flags."""
        return GRPOSettings(
            ob.loss_type,
            ob.epsilon,
            ob.epsilon_high,
            ob.beta,
            ob.importance_sampling_level,
            ob.max_completion_length,
            ob.temperature,
        )

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def group_advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """Each completion's advantage from the combined rewards (completions of a prompt adjacent, `group` of them):
    its reward less its group's mean, divided (scale group) by its group's standard deviation, or (batch) by the
    whole batch's, plus 1e-4 (TRL's); none: not divided. Standard deviations are unbiased (Bessel), as TRL's."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1).repeat_interleave(group)
    advantages = rewards - mean
    if scale == "none":
        return advantages
    std = grouped.std(dim=1).repeat_interleave(group) if scale == "group" else rewards.std().expand_as(rewards)
    return advantages / (std + 1e-4)


def token_losses(
    s: GRPOSettings,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(the loss of each position (rows, positions), 0 off the mask; the importance ratios, (rows, positions) or
    (rows, 1) at sequence level; the per-token KL or None without beta) from fp32 log-probabilities."""
    maskf = mask.to(logps.dtype)
    log_ratio = logps - old_logps
    if s.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    a = advantages.unsqueeze(-1).to(logps.dtype)
    clipped = torch.clamp(ratio, 1 - s.epsilon, 1 + s.high)
    losses = -torch.min(ratio * a, clipped * a)
    kl = None
    if s.beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference log-probabilities"
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        losses = losses + s.beta * kl
    return losses * maskf, ratio, kl


def aggregate(s: GRPOSettings, losses: torch.Tensor, mask: torch.Tensor, normaliser: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the step's loss from its masked token losses; normaliser: the step's
    [completion tokens, completions, micro-batches] over every rank (GRPOObjective.normaliser)."""
    if s.loss_type == "grpo":
        return (losses.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normaliser[1]
    if s.loss_type == "bnpo":
        return losses.sum() / mask.sum().clamp(min=1) / normaliser[2]
    if s.loss_type == "dr_grpo":
        return losses.sum() / (normaliser[1] * s.max_completion_length)
    assert s.loss_type == "dapo", s.loss_type  # --loss-type's choices allow no other
    return losses.sum() / normaliser[0]


def clip_sums(
    s: GRPOSettings, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None
) -> torch.Tensor:
    """[clipped low, high, region, ratios counted, KL sum, completion tokens] of a micro-batch (no gradient)."""
    a = advantages.unsqueeze(-1)
    low = (ratio < 1 - s.epsilon) & (a < 0)
    high = (ratio > 1 + s.high) & (a > 0)
    weight = mask.float() if ratio.shape[-1] == mask.shape[-1] else torch.ones_like(ratio)
    kl_sum = torch.zeros((), device=ratio.device) if kl is None else (kl * mask).sum()
    return torch.stack(
        [
            (low * weight).sum(),
            (high * weight).sum(),
            ((low | high) * weight).sum(),
            weight.sum(),
            kl_sum.float(),
            mask.sum().float(),
        ]
    )


class GRPOObjective(RoutedObjective):
    """The clipped GRPO objective over this rank's micro-batches of rollouts (see the module docstring)."""

    eval_width = 0  # evaluation's token metrics only (a validation set is not read by --objective grpo)

    def __init__(
        self,
        per_token: PerTokenLoss,
        mesh: Mesh,
        device: torch.device,
        settings: GRPOSettings,
        router: RouterTraining | None = None,
    ):
        self.per_token_loss, self.mesh, self.device, self.router = per_token, mesh, device, router
        self.settings = settings
        self.sums = torch.zeros(_SUMS, device=device)

    def token_logps(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """fp32 log-probability of each label under logits / temperature (0 where there is none)."""
        t = self.settings.temperature
        return -self.per_token_loss(logits if t == 1.0 else logits / t, labels)

    def per_token(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.per_token_loss(logits, labels)

    def normaliser(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """[completion tokens, completions, micro-batches] of the whole step (summed over the data-parallel
        ranks)."""
        tokens = torch.stack([(mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches]).sum()
        rows = sum(int(mb["input_ids"].shape[0]) for mb in micro_batches)
        counts = torch.tensor([rows, len(micro_batches)], device=self.device)
        local = torch.cat([tokens.reshape(1).to(self.device), counts]).float()
        return all_reduce(local, self.mesh.replica_group)

    def loss(self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor], normaliser: torch.Tensor) -> torch.Tensor:
        labels = mb["labels"]
        mask = labels != IGNORE_INDEX
        logps = self.token_logps(logits, labels)
        losses, ratio, kl = token_losses(
            self.settings, logps, mb["old_logps"].float(), mb["advantages"].float(), mask, mb.get("ref_logps")
        )
        with torch.no_grad():
            self.sums += clip_sums(self.settings, ratio.detach(), mb["advantages"], mask, kl)
        return aggregate(self.settings, losses, mask, normaliser.clamp_min(1.0))

    def begin_step(self, sequences: int, loss_scale: torch.Tensor | None) -> None:
        self.sums.zero_()
        super().begin_step(sequences, loss_scale)

    def local_stats(self) -> torch.Tensor:
        """This rank's clip and KL sums, then a mixture of experts' router statistics (copies; no collective)."""
        return self.sums.clone() if self.router is None else torch.cat([self.sums, self.router.local_stats()])

    def step_stats(self, local: torch.Tensor, sequences: int) -> torch.Tensor:
        """[the clipped shares low, high, region; the mean KL], then the router's statistics (a collective over
        every rank; tensor-parallel ranks count the same tokens)."""
        flat = summed(local[:_SUMS], self.mesh)
        counted, tokens = flat[3].clamp_min(1.0), flat[5].clamp_min(1.0)
        out = torch.stack([flat[0] / counted, flat[1] / counted, flat[2] / counted, flat[4] / tokens])
        if self.router is None:
            return out
        return torch.cat([out, self.router.step_stats(local[_SUMS:], sequences, self.mesh)])

    def stat_fields(self, values: list[float]) -> dict[str, Any]:
        out: dict[str, Any] = dict(zip(_STATS, values))
        if self.settings.beta == 0.0:
            out.pop("kl")
        if self.router is not None:
            out.update(RouterTraining.fields(values[len(_STATS) :]))
        return out

    def eval_sums(self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64, device=logits.device)

    def eval_fields(self, sums: list[float]) -> dict[str, float]:
        return {}


__all__ = ["GRPOObjective", "GRPOSettings", "aggregate", "group_advantages", "token_losses"]
