"""`llamatron train --eval-tasks` (issue 37): lm-eval tasks at each evaluation, logged as TASK/METRIC; the last
equals `llamatron eval` of the saved checkpoint; data parallelism (lm-eval's own request split and gather) gives
the single process's numbers. (Its refusals are in test_eval_harness.py, whose process has lm-eval's task index.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_eval_harness import CONTEXT, build_models, run, write_tasks

pytest.importorskip("lm_eval")


REPO = Path(__file__).resolve().parents[1]
TASKS = ["local_mc", "local_pages"]
METRICS = ["local_mc/acc", "local_mc/acc_norm", "local_pages/word_perplexity", "local_pages/bits_per_byte"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("eval-train"))


def train_args(models, workdir, tag: str) -> list:
    """Two steps of 2 x 2 sequences, evaluating the first two local tasks (3 examples each) at every step."""
    config = workdir / "run.yaml"
    config.write_text(f"model: llama-test\nmodel_overrides: {{vocab_size: 320, max_seq_length: {CONTEXT}}}\n")
    args = ["train", "--config", config, "--tokenizer", models[2], "--mock-data", "--device", "cpu"]
    args += ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-steps", "2"]
    args += ["--lr", "1e-2", "--eval-interval", "1", "--eval-iters", "1", "--eval-tasks", ",".join(TASKS)]
    args += ["--eval-limit", "3", "--eval-include-path", workdir / "tasks", "--no-progress"]
    return args + ["--metrics-file", workdir / f"{tag}.jsonl", "--save", workdir / f"ck-{tag}"]


def evaluations(path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") == "valid"]


@pytest.fixture(scope="module")
def single(models, tmp_path_factory):
    """The one-process run: its directory and evaluation records."""
    workdir = tmp_path_factory.mktemp("eval-train-single")
    write_tasks(workdir / "tasks")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        assert run(*train_args(models, workdir, "single")) == 0
    return workdir, evaluations(workdir / "single.jsonl")


def test_eval_tasks_during_training_are_the_saved_models_results(single, tmp_path, monkeypatch):
    """The task metrics are in every evaluation record; those after the last step equal `llamatron eval` of the
    checkpoint saved there; the weights change between evaluations and so do the numbers."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    workdir, evals = single
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all(name in r for r in evals for name in METRICS) and "loss" in evals[-1]  # validation metrics stay
    assert not any(k.endswith("sample_len") for k in evals[-1])
    out = tmp_path / "results.json"
    args = ["--tasks", ",".join(TASKS), "--include-path", workdir / "tasks", "--limit", "3", "--output", out]
    assert run("eval", "--load", workdir / "ck-single", *args) == 0
    saved = json.loads(out.read_text())["results"]
    for name in METRICS:
        task, metric = name.split("/")
        assert evals[-1][name] == pytest.approx(saved[task][f"{metric},none"], rel=1e-6), name
    assert evals[0]["local_pages/bits_per_byte"] != evals[-1]["local_pages/bits_per_byte"]


def test_eval_tasks_under_data_parallelism_equal_the_single_process(models, single, tmp_path):
    """dp 2 with the distributed optimizer (gloo, fp32): lm-eval splits the requests between the ranks and gathers
    the metrics; every evaluation equals the single process's (step 0 exactly: the same initial weights)."""
    write_tasks(tmp_path / "tasks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "llamatron", *map(str, train_args(models, tmp_path, "dp2")), "--nproc-per-node", "2"]
    argv.append("--distributed-optimizer")  # its weight all-gather overlaps the next forward, an evaluation too
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    dp = evaluations(tmp_path / "dp2.jsonl")
    assert [r["step"] for r in dp] == [0, 1, 2]
    for ours, theirs in zip(dp, single[1]):
        for name in METRICS:
            assert ours[name] == pytest.approx(theirs[name], rel=0 if ours["step"] == 0 else 1e-5), (ours["step"], name)
