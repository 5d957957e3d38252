"""lm-evaluation-harness tasks during training (`--eval-tasks`): run at each evaluation on the model being trained,
through the same adapter as `llamatron eval` (inference/harness.py), their metrics logged as TASK/METRIC in the
evaluation records.

The adapter runs one whole model: under data parallelism every rank holds it, lm-eval gives each rank its share
of the requests and gathers the metrics (its own scheme: `LlamatronLM(data_parallel=True)`), and every rank gets
the results. Under tensor, pipeline, context or expert parallelism no rank holds the whole model, so --eval-tasks
is refused there (`eval_task_problems`): evaluate a saved checkpoint with `llamatron eval --load` instead.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..data.tokenizer import load_tokenizer
from ..errors import MissingPackageError
from ..inference import lm_eval_harness
from .engine import Engine


def eval_task_problems(
    tasks: Sequence[str],
    include_path: str | None,
    limit: int | None,
    layout: dict[str, int],
    tokenizer: str | None,
    tokenizer_comes_later: bool,
) -> list[str]:
    """--eval-tasks against the layout (`layout`: tp, pp, cp, ep sizes by flag name) and the tokenizer; then the
    task names (lm-eval's index, built once and kept for the run). tokenizer_comes_later: the demo corpus brings
    its own."""
    if not tasks:
        given = [f for f, v in (("--eval-include-path", include_path), ("--eval-limit", limit)) if v is not None]
        return [f"{given[0]} applies to lm-eval tasks: add --eval-tasks NAMES"] if given else []
    split = [f"--{name} {size}" for name, size in layout.items() if size > 1]
    if split:
        return [
            f"--eval-tasks runs lm-eval on a whole model per rank, which {', '.join(split)} splits; train without "
            "--eval-tasks and evaluate the saved checkpoint with `llamatron eval --load DIR --tasks ...`"
        ]
    if tokenizer is None and not tokenizer_comes_later:
        return ["--eval-tasks: lm-eval's tasks are text; give the model's --tokenizer"]
    try:
        harness = lm_eval_harness()
    except MissingPackageError as e:
        return [f"--eval-tasks: {e}"]
    return harness.task_problems(harness.split_names(tasks), include_path, "--eval-tasks")


class EvalTasks:
    """The run's lm-eval tasks on its model (the one chunk), --micro-batch-size sequences per forward."""

    def __init__(self, engine: Engine):
        t = engine.cfg.train
        self.harness = lm_eval_harness()
        self.names = self.harness.split_names(t.eval_tasks)
        self.manager = self.harness.task_manager(self.names, t.eval_include_path)
        assert engine.cfg.data.tokenizer is not None  # eval_task_problems: given, or the demo corpus's
        self.model = engine.chunks[0]
        tokenizer = load_tokenizer(engine.cfg.data.tokenizer)
        self.lm = self.harness.LlamatronLM(self.model, tokenizer, t.micro_batch_size, data_parallel=True)
        self.limit, self.seed = t.eval_limit, t.seed

    def run(self) -> dict[str, float]:
        """{"TASK/METRIC": value}; the training RNGs are left as they were (lm-eval seeds them)."""
        was_training = self.model.training
        states = _rng_states()
        self.model.eval()
        try:
            results = self.harness.run_tasks(self.lm, self.manager, self.names, self.limit, None, self.seed)
        finally:
            self.model.train(was_training)
            _set_rng_states(states)
        return self.harness.task_metrics(results)


def _rng_states() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_states(states: tuple[Any, ...]) -> None:
    python, numpy_state, cpu, cuda = states
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
