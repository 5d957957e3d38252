"""Objectives that run their own steps (--objective grpo: sample, score, then train), by name: the Trainer asks
here, and names none of them. A runner trains optimizer step `step` (1-based) on a global batch of `size`
sequences and returns train_step's output (with any record fields of its own under "extra")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..data.tokenizer import load_tokenizer
from ..objectives.grpo_checks import load_grpo_inputs
from .engine import Engine
from .rollouts import GRPOSteps

StepRunner = Callable[[int, int], dict[str, Any]]


def _grpo(engine: Engine) -> StepRunner:
    cfg = engine.cfg
    prompts, rewards = load_grpo_inputs(cfg)
    assert cfg.data.tokenizer is not None  # grpo_checks refused the run without
    return GRPOSteps(engine, prompts, rewards, cfg.objective.reward_weights, load_tokenizer(cfg.data.tokenizer))


RUNNERS: dict[str, Callable[[Engine], StepRunner]] = {"grpo": _grpo}


def runs_own_steps(objective: str) -> bool:
    """Whether --objective brings its own steps and data (the Trainer then reads no dataset)."""
    return objective in RUNNERS


def step_runner(engine: Engine) -> StepRunner | None:
    build = RUNNERS.get(engine.cfg.objective.objective)
    return None if build is None else build(engine)
