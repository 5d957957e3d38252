"""Evaluation metrics by name (llamatron/training/evaluation.py), in one process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llamatron.config.settings import ConfigError, config_from_values
from llamatron.data.batches import micro_batches_for_step
from llamatron.data.mock import MockDataset
from llamatron.kernels.cross_entropy_op import cross_entropy_per_token
from llamatron.models import IGNORE_INDEX
from llamatron.parallel.mesh import build_mesh
from llamatron.training import evaluation
from llamatron.training.engine import build_engine
from llamatron.training.evaluation import EvalBatch, evaluate, register_eval_metric, resolve_eval_metrics
from llamatron.training.validate import validate


@pytest.fixture(scope="module")
def engine():
    cfg = config_from_values(
        {
            "model": "llama-test",
            "mock_data": True,
            "device": "cpu",
            "precision": "fp32",
            "seq_length": 32,
            "micro_batch_size": 2,
            "global_batch_size": 4,
        }
    )
    torch.manual_seed(0)
    return build_engine(cfg, validate(cfg), build_mesh())


@pytest.fixture(scope="module")
def dataset(engine):
    return MockDataset(engine.model_cfg.vocab_size, 32, seed=7)


class _PartlyMasked:
    """Mock samples; the first has its first 4 targets masked, so the label mask matters."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        tokens = self.dataset[i]
        mask = np.ones(len(tokens), dtype=bool)
        if i == 0:
            mask[:5] = False
        return {"tokens": tokens, "loss_mask": mask}


def _reference(engine, dataset, iters: int) -> dict[str, float]:
    """The formula train.evaluate used before the metrics registry."""
    model, t = engine.chunks[0], engine.cfg.train
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, tokens
    with torch.no_grad():
        for it in range(iters):
            for mb in micro_batches_for_step(
                dataset, it * t.global_batch_size, t.global_batch_size, t.micro_batch_size, 1, 0
            ):
                logits = model(mb["input_ids"])
                labels = mb["labels"]
                valid = labels != IGNORE_INDEX
                totals[0] += cross_entropy_per_token(logits, labels).sum().double()
                totals[1] += ((logits.argmax(-1) == labels) & valid).sum()
                totals[2] += valid.sum()
    loss = (totals[0] / totals[2].clamp_min(1)).item()
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "accuracy": (totals[1] / totals[2].clamp_min(1)).item(),
    }


def test_builtin_metrics_equal_the_previous_formula_exactly(engine, dataset):
    masked = _PartlyMasked(dataset)
    got = evaluate(engine, masked, iters=2)
    assert list(got) == ["loss", "perplexity", "accuracy"]
    assert got == _reference(engine, masked, iters=2)
    assert micro_batches_for_step(masked, 0, 4, 2, 1, 0)[0]["labels"][0, :4].eq(IGNORE_INDEX).all()


def test_registered_metrics_are_selected_by_name_in_order(engine, dataset):
    @register_eval_metric("test_first_half_accuracy")
    def first_half(batch: EvalBatch):  # a (numerator, denominator) metric: accuracy over the first 16 positions
        hits = (batch.predictions == batch.labels) & batch.valid
        return hits[:, :16].sum(), batch.valid[:, :16].sum()

    @register_eval_metric("test_bits_per_token", derived_from="loss")
    def bits(loss: float) -> float:
        return loss / math.log(2)

    try:
        got = evaluate(
            engine, dataset, iters=1, metrics=["test_bits_per_token", "accuracy", "test_first_half_accuracy"]
        )
        assert list(got) == ["loss", "test_bits_per_token", "accuracy", "test_first_half_accuracy"]
        assert got["test_bits_per_token"] == got["loss"] / math.log(2)
        assert 0.0 <= got["test_first_half_accuracy"] <= 1.0
        builtin = evaluate(engine, dataset, iters=1)
        assert got["loss"] == builtin["loss"] and got["accuracy"] == builtin["accuracy"]
        only_loss = evaluate(engine, dataset, iters=1, metrics=[])
        assert list(only_loss) == ["loss"]  # loss is always reported
    finally:
        for name in ("test_first_half_accuracy", "test_bits_per_token"):
            evaluation._METRICS.pop(name)


def test_metric_names_are_checked_before_training(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"unknown metric 'perplexty'; registered: loss, perplexity, accuracy"):
        resolve_eval_metrics(["perplexty"])
    assert resolve_eval_metrics("accuracy perplexity") == ["loss", "accuracy", "perplexity"]  # a YAML string
    # MODULE:NAME imports the module that registers the metric.
    (tmp_path / "my_metrics.py").write_text(
        "from llamatron.training.evaluation import register_eval_metric\n"
        "@register_eval_metric('test_label_is_even')\n"
        "def even(batch):\n    return batch.labels % 2 == 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert resolve_eval_metrics(["my_metrics:test_label_is_even"]) == ["loss", "test_label_is_even"]
    finally:
        evaluation._METRICS.pop("test_label_is_even", None)
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        resolve_eval_metrics(["no_such_module:x"])
    cfg = config_from_values({"model": "llama-test", "mock_data": True, "eval_metrics": ["nope"]})
    with pytest.raises(ConfigError, match="unknown metric 'nope'"):
        validate(cfg)


def test_eval_metrics_flag_takes_several_names():
    import argparse

    from llamatron.config.settings import add_config_arguments, load_config

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg = load_config(parser.parse_args(["--eval-metrics", "perplexity", "accuracy", "--train-steps", "3"]))
    assert cfg.train.eval_metrics == ["perplexity", "accuracy"] and cfg.train.train_steps == 3
    assert config_from_values({}).train.eval_metrics == ["loss", "perplexity", "accuracy"]


def test_validation_samples_do_not_depend_on_the_run_length(tmp_path):
    """Issue 23, item 9: a 5-step and a 500-step run on the same data evaluate on the same samples."""
    import json

    import numpy as np

    from llamatron.config.settings import config_from_values
    from llamatron.data.preprocess import preprocess
    from llamatron.data.tokenizer import train_bpe_tokenizer
    from llamatron.parallel.mesh import Mesh
    from llamatron.training.trainer import build_datasets

    texts = [f"doc {i}: " + " ".join(["ab", "cd", "ef"][j % 3] for j in range(i % 31 + 2)) for i in range(400)]
    train_bpe_tokenizer(texts, vocab_size=300, out_dir=str(tmp_path / "tok"))
    with open(tmp_path / "d.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    prefix = preprocess(str(tmp_path / "d.jsonl"), str(tmp_path / "d"), str(tmp_path / "tok"), progress=False)
    values = {"model": "llama-test", "model_overrides": {"vocab_size": 320}, "data": prefix["outputs"]["text"]}
    values |= {"tokenizer": str(tmp_path / "tok"), "split": "80,20,0", "seq_length": 32, "global_batch_size": 4}
    values |= {"eval_iters": 3, "eval_interval": 1}
    valid = []
    for steps in (5, 500):
        cfg = config_from_values({**values, "train_steps": steps})
        ds = build_datasets(cfg, cfg.model_config(), Mesh()).valid
        valid.append(np.stack([np.asarray(ds[i]) for i in range(12)]))
    assert np.array_equal(valid[0], valid[1])
