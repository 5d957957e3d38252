"""The objectives by name (--objective): each builds its `Objective` for this rank's chunks from the run's
objective settings, so the engine names none of them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config.objective_settings import ObjectiveConfig
from ..models import ModelConfig, Transformer
from ..parallel.mesh import Mesh
from . import Objective
from .grpo import GRPOObjective, GRPOSettings
from .language_model import LanguageModelObjective, RouterTraining, per_token_loss
from .preference import PreferenceObjective

# (settings, chunks, model config, mesh, device, cross-entropy kernel, compile) -> the objective
Builder = Callable[[ObjectiveConfig, list[Transformer], ModelConfig, Mesh, torch.device, str, bool], Objective]

BUILDERS: dict[str, Builder] = {
    "lm": lambda ob, chunks, mc, mesh, dev, k, c: LanguageModelObjective.build(chunks, mc, mesh, dev, k, c),
    "dpo": lambda ob, chunks, mc, mesh, dev, k, c: PreferenceObjective.build(
        chunks, mc, mesh, dev, ob.dpo_beta, ob.dpo_loss, k, c
    ),
    "grpo": lambda ob, chunks, mc, mesh, dev, k, c: GRPOObjective(
        per_token_loss(chunks, k, c), mesh, dev, GRPOSettings.of(ob), RouterTraining.attach(chunks, mc, dev)
    ),
}


def build_objective(
    ob: ObjectiveConfig,
    chunks: list[Transformer],
    model_cfg: ModelConfig,
    mesh: Mesh,
    device: torch.device,
    kernel: str,
    compile: bool,
) -> Objective:
    """--objective's objective for this rank's `chunks`."""
    return BUILDERS[ob.objective](ob, chunks, model_cfg, mesh, device, kernel, compile)


__all__ = ["BUILDERS", "build_objective"]
