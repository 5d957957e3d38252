"""`llamatron eval` and --eval-tasks on CUDA (pytest -m gpu): the adapter's log-likelihoods on the GPU equal the
CPU's in fp32 and stay within bf16's rounding in bf16; a bf16 run with --compile (the GPU default) evaluates its
tasks at each evaluation, and the last equals `llamatron eval` of the checkpoint it saved."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("lm_eval")

from test_eval_harness import CONTEXT, PAIRS, TEXTS, build_models, requests, run, write_tasks  # noqa: E402

from llamatron.data.tokenizer import load_tokenizer  # noqa: E402
from llamatron.inference.harness import LlamatronLM  # noqa: E402
from llamatron.inference.model_source import load_model  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("eval-gpu"))


def _scores(models, device: str, dtype: torch.dtype) -> tuple[list[float], list[float]]:
    lm = LlamatronLM(load_model(str(models[0]), device, dtype), load_tokenizer(str(models[2])), batch_size=3)
    pairs = [lp for lp, _ in lm.loglikelihood(requests("loglikelihood", PAIRS))]
    return pairs, lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in TEXTS]))


def test_adapter_on_cuda_equals_cpu(models):
    cpu = _scores(models, "cpu", torch.float32)
    fp32 = _scores(models, "cuda", torch.float32)
    bf16 = _scores(models, "cuda", torch.bfloat16)
    for want, got32, got16 in zip(cpu, fp32, bf16):
        np.testing.assert_allclose(got32, want, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(got16, want, rtol=3e-2, atol=0.5)


def test_eval_tasks_during_a_compiled_bf16_run(models, tmp_path):
    tasks = write_tasks(tmp_path / "tasks")[:2]
    config = tmp_path / "run.yaml"
    config.write_text(f"model: llama-test\nmodel_overrides: {{vocab_size: 320, max_seq_length: {CONTEXT}}}\n")
    metrics = tmp_path / "metrics.jsonl"
    train = ["train", "--config", config, "--tokenizer", models[2], "--mock-data", "--device", "cuda"]
    train += ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-steps", "2"]
    train += ["--eval-interval", "1", "--eval-iters", "1", "--eval-tasks", ",".join(tasks), "--eval-limit", "3"]
    train += ["--eval-include-path", tmp_path / "tasks", "--metrics-file", metrics, "--save", tmp_path / "ck"]
    assert run(*train, "--no-progress") == 0
    evals = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("split") == "valid"]
    assert [r["step"] for r in evals] == [0, 1, 2]
    out = tmp_path / "results.json"
    args = ["--tasks", ",".join(tasks), "--include-path", tmp_path / "tasks", "--limit", "3", "--output", out]
    assert run("eval", "--load", tmp_path / "ck", *args, "--device", "cuda", "--precision", "bf16") == 0
    saved = json.loads(out.read_text())["results"]
    assert evals[-1]["local_pages/bits_per_byte"] == pytest.approx(saved["local_pages"]["bits_per_byte,none"], rel=2e-2)
