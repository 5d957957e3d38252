"""What an objective needs of the run beyond its loss, by --objective name, so that the Trainer names none:

- a pass before the first step (DPO's reference log-probs: training/reference_logps.py), which returns entries
  the run's checkpoints record;
- steps of its own (GRPO: sample, score, then train: training/rollouts.py). A runner trains optimizer step
  `step` (1-based) on a global batch of `size` sequences and returns train_step's output (with any record fields
  of its own under "extra"); such an objective brings its own data (the Trainer reads no dataset).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..checkpoint.reader import saved_lora_settings
from ..data.batches import Samples
from ..data.preference_dataset import PreferenceDataset
from ..data.tokenizer import load_tokenizer
from ..objectives.grpo_checks import load_grpo_inputs
from .engine import Engine
from .reference_logps import REFERENCE_KEY, attach_reference
from .rollouts import GRPOSteps

StepRunner = Callable[[int, int], dict[str, Any]]


def _grpo(engine: Engine) -> StepRunner:
    cfg = engine.cfg
    prompts, rewards = load_grpo_inputs(cfg, engine.model_cfg.max_seq_length)
    assert cfg.data.tokenizer is not None  # grpo_checks refused the run without
    return GRPOSteps(engine, prompts, rewards, cfg.objective.reward_weights, load_tokenizer(cfg.data.tokenizer))


RUNNERS: dict[str, Callable[[Engine], StepRunner]] = {"grpo": _grpo}


def _dpo_reference(engine: Engine, data: list[Samples | None], state: dict[str, Any]) -> dict[str, Any]:
    """DPO's reference pass before the first step (or its table read from the cache)."""
    cfg, t = engine.cfg, engine.cfg.train
    resumed = state.get(REFERENCE_KEY) if t.load and not t.finetune else None
    preference = [ds for ds in data if isinstance(ds, PreferenceDataset)]
    zero = (
        cfg.lora.lora_rank > 0
        and not cfg.lora.lora_init_from
        and not (t.load and saved_lora_settings(state).get("lora_rank"))
    )
    return {REFERENCE_KEY: attach_reference(engine, preference, resumed, zero)}


PASSES: dict[str, Callable[[Engine, list[Samples | None], dict[str, Any]], dict[str, Any]]] = {"dpo": _dpo_reference}


def before_training(engine: Engine, data: list[Samples | None], state: dict[str, Any]) -> dict[str, Any]:
    """The objective's pass before the first step, on the train and validation data; `state`: the loaded
    checkpoint's ({} for a fresh run). Returns the entries its checkpoints record (none for most)."""
    run = PASSES.get(engine.cfg.objective.objective)
    return {} if run is None else run(engine, data, state)


def runs_own_steps(objective: str) -> bool:
    """Whether --objective brings its own steps and data (the Trainer then reads no dataset)."""
    return objective in RUNNERS


def step_runner(engine: Engine) -> StepRunner | None:
    build = RUNNERS.get(engine.cfg.objective.objective)
    return None if build is None else build(engine)
