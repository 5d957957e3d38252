"""Evaluation over the validation set, with metrics chosen by name (`--eval-metrics`).

Built in: `loss` (mean cross-entropy per token, always reported), `perplexity` (exp of the loss) and
`accuracy` (next-token argmax accuracy). Further metrics register with a decorator:

    from llamatron.training.evaluation import register_eval_metric

    @register_eval_metric("top_token_is_space")
    def top_token_is_space(batch):            # a value per token, averaged over the tokens with a label
        return batch.predictions == 220

    @register_eval_metric("bits_per_token", derived_from="loss")
    def bits_per_token(loss: float) -> float:  # computed from another metric's result
        return loss / math.log(2)

A token metric may instead return a (numerator, denominator) pair of scalar tensors, summed over batches and
ranks, for averages that are not per token. `--eval-metrics my_module:my_metric` imports `my_module`
(which registers it) first.

Every metric is a sum over batches reduced once over data-parallel ranks (under pipeline parallelism the
last stage computes it and the other stages receive it), so the numbers do not depend on the layout. Under
tensor parallelism `batch.logits` is the rank's vocabulary shard: use `batch.predictions` and `batch.loss`,
which are whole.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..data.batches import Samples, micro_batches_for_rank, to_device
from ..errors import ConfigError
from ..models import IGNORE_INDEX, Transformer
from ..parallel.mesh import sum_from_last_stage
from ..parallel.tensor_layers import vocab_argmax
from .engine import Engine, forward_each
from .eval_tasks import EvalTasks


@dataclass
class EvalBatch:
    """What a token metric sees: one micro-batch on one rank."""

    model: Transformer
    logits: torch.Tensor  # (batch, seq, vocab or this rank's vocabulary shard)
    labels: torch.Tensor  # (batch, seq); IGNORE_INDEX where no token is predicted
    loss: torch.Tensor  # fp32 loss per token, 0 where there is no label
    _predictions: torch.Tensor | None = field(default=None, repr=False)

    @property
    def valid(self) -> torch.Tensor:
        return self.labels != IGNORE_INDEX

    @property
    def predictions(self) -> torch.Tensor:
        """The argmax over the whole vocabulary (computed once, shared by the metrics)."""
        if self._predictions is None:
            self._predictions = vocab_argmax(self.logits, self.model.parallel.vocab)
        return self._predictions


@dataclass(frozen=True)
class EvalMetric:
    name: str
    fn: Callable  # token metric: EvalBatch -> values per token or (numerator, denominator); derived: float -> float
    derived_from: str | None = None


_METRICS: dict[str, EvalMetric] = {}


def register_eval_metric(name: str, derived_from: str | None = None) -> Callable:
    """Decorator: register a metric under `name` (replacing one of that name)."""

    def register(fn: Callable) -> Callable:
        _METRICS[name] = EvalMetric(name, fn, derived_from)
        return fn

    return register


def registered_eval_metrics() -> list[str]:
    return list(_METRICS)


@register_eval_metric("loss")
def _loss(batch: EvalBatch) -> torch.Tensor:
    return batch.loss


@register_eval_metric("perplexity", derived_from="loss")
def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: an untrained model's exp(loss) can overflow


@register_eval_metric("accuracy")
def _accuracy(batch: EvalBatch) -> torch.Tensor:
    return batch.predictions == batch.labels


def resolve_eval_metrics(names: Sequence[str] | str) -> list[str]:
    """The metric names to compute, `loss` first; ConfigError for unknown names."""
    if isinstance(names, str):  # YAML may give "perplexity accuracy"
        names = names.replace(",", " ").split()
    out = ["loss"]
    for name in names:
        if ":" in name:  # module:metric -- the module registers the metric when imported
            module, name = name.split(":", 1)
            if os.getcwd() not in sys.path:  # the `llamatron` script, unlike `python -m`, does not search it
                sys.path.insert(0, os.getcwd())
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise ConfigError(f"--eval-metrics: cannot import {module!r} (for metric {name!r}): {e}") from None
        if name not in _METRICS:
            raise ConfigError(
                f"--eval-metrics: unknown metric {name!r}; registered: {', '.join(_METRICS)} "
                f"(add one with @llamatron.training.evaluation.register_eval_metric, give it as MODULE:NAME)"
            )
        for needed in (_METRICS[name].derived_from, name):
            if needed is not None and needed not in out:
                out.append(needed)
    return out


class _Totals:
    """Numerator and denominator sums of each token metric, in one float64 tensor (one all-reduce)."""

    def __init__(self, metrics: list[EvalMetric], device: torch.device):
        self.metrics = metrics
        self.sums = torch.zeros(len(metrics), 2, device=device, dtype=torch.float64)

    def add(self, batch: EvalBatch) -> None:
        valid = batch.valid
        tokens = valid.sum()
        for i, metric in enumerate(self.metrics):
            out = metric.fn(batch)
            if isinstance(out, tuple):
                self.sums[i, 0] += out[0].double()
                self.sums[i, 1] += out[1].double()
            else:
                self.sums[i, 0] += (
                    torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device)).sum().double()
                )
                self.sums[i, 1] += tokens

    def values(self) -> dict[str, float]:
        means = self.sums[:, 0] / self.sums[:, 1].clamp_min(1)
        return {m.name: v for m, v in zip(self.metrics, means.tolist())}


@torch.no_grad()
def evaluate(
    engine: Engine, dataset: Samples, iters: int, start_sample: int = 0, metrics: Sequence[str] | None = None
) -> dict[str, float]:
    """The selected metrics (default: --eval-metrics) over `iters` global batches of the validation set.

    The result is the same on every rank.
    """
    cfg, mesh = engine.cfg, engine.mesh
    names = resolve_eval_metrics(cfg.train.eval_metrics if metrics is None else metrics)
    totals = _Totals([_METRICS[n] for n in names if _METRICS[n].derived_from is None], engine.device)
    t = cfg.train

    def batches_of(it: int) -> list[dict]:
        return micro_batches_for_rank(
            dataset, start_sample + it * t.global_batch_size, t.global_batch_size, t.micro_batch_size, mesh
        )

    # the objective's own metrics (DPO's), summed over the batches
    objective_sums = torch.zeros(engine.objective.eval_width, dtype=torch.float64, device=engine.device)

    def add(model, logits: torch.Tensor, mb: dict) -> None:
        labels = mb["labels"]
        totals.add(EvalBatch(model, logits, labels, engine.objective.per_token(logits, labels)))
        if objective_sums.numel():
            objective_sums.add_(engine.objective.eval_sums(logits, mb))

    for it in range(iters):  # under a pipeline the last stage sees the logits; it sums, then tells the others
        forward_each(engine, to_device(batches_of(it), engine.device), add)
    sum_from_last_stage(totals.sums, mesh)
    return {**_with_derived(names, totals.values()), **_objective_metrics(engine, objective_sums)}


def _objective_metrics(engine: Engine, sums: torch.Tensor) -> dict[str, float]:
    """The objective's own evaluation metrics (Objective.eval_sums / eval_fields), the same on every rank: summed
    like the token metrics (over the replicas where the last pipeline stage computed them)."""
    if not sums.numel():
        return {}
    return engine.objective.eval_fields(sum_from_last_stage(sums, engine.mesh).tolist())


class Evaluation:
    """A run's evaluations: every --eval-interval steps, after the last step and, in a fresh run with
    --eval-interval, before the first; --eval-iters global batches of the validation set each, and the
    --eval-tasks of lm-evaluation-harness (eval_tasks.py)."""

    def __init__(self, engine: Engine, valid: Samples | None):
        self.engine, self.valid = engine, valid
        self.interval, self.iters = engine.cfg.train.eval_interval, engine.cfg.train.eval_iters
        self.tasks = EvalTasks(engine) if engine.cfg.train.eval_tasks else None

    @property
    def enabled(self) -> bool:
        return self.valid is not None or self.tasks is not None

    def at_start(self, start_step: int) -> bool:
        """Evaluate the initial weights first: a fresh run (also --finetune) does, a resumed one does not."""
        return self.enabled and start_step == 0 and bool(self.interval)

    def due(self, step: int, last: bool) -> bool:
        """Evaluate after (1-based) `step`."""
        return self.enabled and (bool(self.interval and step % self.interval == 0) or last)

    def run(self) -> dict[str, float]:
        """The --eval-metrics values, then the --eval-tasks metrics, the same on every rank (collective)."""
        assert self.enabled, "nothing to evaluate: due() and at_start() are False"
        metrics = evaluate(self.engine, self.valid, self.iters) if self.valid is not None else {}
        return {**metrics, **(self.tasks.run() if self.tasks is not None else {})}


def _with_derived(names: list[str], values: dict[str, float]) -> dict[str, float]:
    """Values in the order of `names`, derived metrics computed from the others."""
    out = {}
    for name in names:
        metric = _METRICS[name]
        out[name] = metric.fn(values[metric.derived_from]) if metric.derived_from is not None else values[name]
    return out


def format_metrics(metrics: dict[str, float]) -> str:
    """'loss 2.3456, perplexity 10.45, accuracy 0.412' for the console."""
    formats = {"loss": ".4f", "perplexity": ".2f", "accuracy": ".3f"}
    return ", ".join(f"{k} {v:{formats.get(k, '.4g')}}" for k, v in metrics.items())
