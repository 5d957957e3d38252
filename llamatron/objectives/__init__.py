"""Training objectives: what a step minimises and what its sum is divided by, outside the model.

The model returns logits (models/transformer.py); an objective turns a micro-batch's logits into its share of the
step's loss. The engine owns one and uses it in the plain step, on the pipeline's last stage and in evaluation, so
a new objective is one module beside language_model.py implementing `Objective` (preference.py, DPO; grpo.py,
GRPO), registered by name in registry.py; a pass it needs before training, or steps of its own (GRPO's rollouts),
are registered in training/objective_hooks.py, so neither the engine nor the Trainer names an objective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch


class Objective(Protocol):
    eval_width: int  # how many sums eval_sums gives (0: none)

    def per_token(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """fp32 loss of each token (0 where it has no label): evaluation's `loss` metric."""
        ...

    def normaliser(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """What the step's summed loss is divided by, over the whole global batch (a device tensor; a collective
        over the ranks holding different samples)."""
        ...

    def loss(self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor], normaliser: torch.Tensor) -> torch.Tensor:
        """Micro-batch `mb`'s share of the step's loss (a scalar to backpropagate), from its logits (this rank's
        vocabulary shard under tensor parallelism)."""
        ...

    def begin_step(self, sequences: int, loss_scale: torch.Tensor | None) -> None:
        """Called before each step's forward passes, with the step's sequences over all ranks."""
        ...

    def before_forward(self, forward_all: Callable[[], None]) -> None:
        """Called after begin_step, before the step's forward passes; `forward_all` runs them all without gradient
        (global-batch balancing routes the step with it first: RouterTraining.route_global_batch)."""
        ...

    def end_step(self) -> None:
        """Called after the optimizer step (a mixture of experts' balancing bias moves: RouterTraining.end_step)."""
        ...

    def local_stats(self) -> torch.Tensor | None:
        """This rank's sums of the step's own statistics, copied after its forward passes (a device tensor, no
        collective), or None when the objective has none."""
        ...

    def step_stats(self, local: torch.Tensor, sequences: int) -> torch.Tensor:
        """The statistics to log of a step, from every rank's `local_stats` of it (a collective: called for the
        logged steps only)."""
        ...

    def stat_fields(self, values: list[float]) -> dict[str, Any]:
        """The logged record's fields of `step_stats`' values (read on the host)."""
        ...

    def eval_sums(self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Evaluation's sums of the objective's own metrics over micro-batch `mb` (float64, eval_width of them)."""
        ...

    def eval_fields(self, sums: list[float]) -> dict[str, float]:
        """The evaluation record's fields of the sums over the validation set (all ranks, all batches)."""
        ...


__all__ = ["Objective"]
