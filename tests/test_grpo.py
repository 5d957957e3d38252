"""GRPO's rollouts and runs (training/rollouts.py, objectives/grpo_checks.py): the behaviour log-probabilities
kept at sampling time are the training forward's, the truncation mask, the logged fields, an exact resume, and
one-line refusals of bad input before the model is built."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from layout import run_train

from llamatron.config.settings import config_from_values
from llamatron.data.tokenizer import train_bpe_tokenizer
from llamatron.errors import ConfigError, DataError
from llamatron.models import IGNORE_INDEX
from llamatron.parallel.mesh import Mesh
from llamatron.training.engine import build_engine
from llamatron.training.objective_hooks import step_runner
from llamatron.training.validate import validate

SETTINGS = {
    "model": "llama-test",
    "model_overrides": {"vocab_size": 512},
    "device": "cpu",
    "precision": "fp32",
    "objective": "grpo",
    "reward": ["exact_answer"],
    "num_generations": 4,
    "global_batch_size": 8,
    "micro_batch_size": 4,
    "seq_length": 24,
    "max_completion_length": 6,
    "temperature": 0.9,
}


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("grpo")
    train_bpe_tokenizer(["1+2=3 4+5=9 the answer is 7\n" * 40], 300, str(root / "tok"))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(6)))
    return {"tokenizer": str(root / "tok"), "prompts": str(prompts)}


def _engine(task, **changes):
    values = {**SETTINGS, **task, **changes}
    overrides = values.pop("model_overrides")
    cfg = config_from_values({**values, "model_overrides": overrides})
    derived = validate(cfg)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, derived, Mesh())
    runner = step_runner(engine)
    return engine, runner


def test_behaviour_logps_are_the_training_forward(task):
    """The log-probabilities kept while decoding (KV cache, one token a step) are those the training forward
    computes of the same tokens at the positions the labels put them (logits / temperature), so that the
    first iteration's ratios are 1."""
    engine, runner = _engine(task)
    rollouts = runner._rollouts(0, 8)
    model, objective = engine.chunks[0], engine.objective
    model.eval()
    labelled = 0
    with torch.no_grad():
        for mb in rollouts.micro_batches:
            logps = objective.token_logps(model(mb["input_ids"]), mb["labels"])
            mask = mb["labels"] != IGNORE_INDEX
            labelled += int(mask.sum())
            torch.testing.assert_close(logps[mask], mb["old_logps"][mask], rtol=0, atol=1e-5)
            assert (mb["old_logps"][~mask] == 0).all()
    assert labelled > 8  # completions of several tokens were compared


@pytest.mark.parametrize("masked", (False, True))
def test_truncated_completions_masked(task, masked: bool):
    """A completion the length limit cut (the untrained model never says EOS in 2 tokens) trains on nothing
    with --mask-truncated-completions, on its tokens without."""
    _, runner = _engine(task, max_completion_length=2, mask_truncated_completions=masked)
    rollouts = runner._rollouts(0, 8)
    assert rollouts.fields["completions/clipped_ratio"] == 1.0
    labelled = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in rollouts.micro_batches)
    assert labelled == (0 if masked else 16)


def _flags(task, **changes) -> list[str]:
    values = {**SETTINGS, **task, **changes}
    values.pop("model"), values.pop("model_overrides"), values.pop("device"), values.pop("precision")
    out = ["--model-override", "vocab_size=512"]
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        out += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return out


def test_run_logs_rollouts_and_resumes_exactly(task, tmp_path):
    """Every logged field of steps 3-4 is the same when the run stops at step 2 and resumes (the sampling keys
    of each rollout batch are a function of the seed and the batch, so the resumed run samples the same)."""
    flags = _flags(task, num_iterations=2, log_completions_every=2, lr=1e-2, warmup_steps=0, train_steps=4)
    flags += ["--reward", "exact_answer", "regex:[0-9]"]  # the untrained model writes digits now and then
    whole = run_train([*flags, "--save", str(tmp_path / "a"), "--save-interval", "2"], 1, tmp_path, mock_data=False)
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    for key in ("rewards/exact_answer/mean", "frac_reward_zero_std", "completions/mean_length",
                "clip_ratio/region_mean", "rollout_tokens_per_sec", "train_tokens_per_sec"):  # fmt: skip
        assert key in whole[0], key
    assert "completions" in whole[1] and "completions" not in whole[0]
    assert whole[1]["completions"][0]["prompt"].endswith("+1=")
    assert any(r["grad_norm"] > 0 for r in whole)  # the run trained on something
    resumed = run_train([*flags, "--load", str(tmp_path / "a" / "step-2")], 1, tmp_path, mock_data=False)
    assert [r["step"] for r in resumed] == [3, 4]
    timing = {"rollout_tokens_per_sec", "train_tokens_per_sec", "tokens_per_sec", "tflops_per_gpu", "peak_mem_gib"}
    for a, b in zip(whole[2:], resumed):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}


def test_failing_reward_is_one_line(task, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def r(completions, **kw):\n    return [None] * len(completions)\n")
    cmd = [sys.executable, "-m", "llamatron", "train", "--model", "llama-test", "--device", "cpu", "--train-steps", "1"]
    cmd += _flags(task, reward=[f"{bad}:r"])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env={"OMP_NUM_THREADS": "1", **_env()})
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and f"reward {bad}:r returned None for a completion of prompts-file line" in err[0], err


def _env() -> dict[str, str]:
    import os

    repo = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": repo}


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"num_generations": 1}, ConfigError, "--num-generations 1 must be >= 2"),
        ({"reward": ["missing.py:f"]}, ConfigError, "--reward missing.py:f: no file missing.py"),
        ({"max_completion_length": 40}, DataError, "line 1: a prompt of 4 tokens and --max-completion-length 40"),
        ({"seq_length": 200, "max_completion_length": 126}, DataError, "126 exceed the model's context of 128 tokens"),
        ({"global_batch_size": 6, "micro_batch_size": 2}, ConfigError, "must be a multiple of --num-generations"),
        ({"beta": 0.1}, ConfigError, "--beta > 0 needs LoRA"),
        ({"tp": 1, "pp": 2}, ConfigError, "--pp is not supported yet"),
        ({"prompts": None}, ConfigError, "--objective grpo needs --prompts"),
        ({"mock_data": True}, ConfigError, "drop --mock-data"),
        ({"num_iterations": 2, "save_interval": 3}, ConfigError, "--save-interval 3 must be a multiple"),
        ({"rampup_batch_size": [4, 4, 8]}, ConfigError, "--rampup-batch-size is not supported"),
    ],
)
def test_bad_input_is_one_line_before_the_model(task, changes, error, message):
    values = {**SETTINGS, **task, **changes}
    overrides = values.pop("model_overrides")
    cfg = config_from_values({**{k: v for k, v in values.items() if v is not None}, "model_overrides": overrides})
    with pytest.raises(error, match=message.replace("(", "\\(")) as e:
        validate(cfg, world_size=2 if changes.get("pp") else 1)
    assert "\n" not in str(e.value)


def test_prompts_without_the_answer_field(task, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')
    cfg = config_from_values({**SETTINGS, **task, "prompts": str(prompts)})
    with pytest.raises(DataError, match=f"--prompts {prompts} line 1: has no answer field, which --reward needs"):
        validate(cfg)


def test_the_demo_runs_a_few_steps(tmp_path, monkeypatch, capsys):
    """`llamatron train --objective grpo` with no data: the single-digit-sums task (data/demo_grpo.py), its
    records carrying the reward, and the summary of the saved policy's greedy answers (3 steps: the demo itself,
    150 steps, is README's)."""
    from llamatron.cli import main

    monkeypatch.chdir(tmp_path)
    metrics = tmp_path / "m.jsonl"
    args = ["train", "--objective", "grpo", "--train-steps", "3", "--log-interval", "1", "--no-progress"]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--metrics-file", str(metrics), "--global-batch-size", "32", "--micro-batch-size", "32"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(0 <= r["reward"] <= 1 for r in records)
    assert "step 3: loss" in out and ", reward " in out
    assert "greedy answers right:" in out and "of the 55 sums" in out
    assert (tmp_path / "runs/demo/grpo-checkpoint/step-3").is_dir()


def test_conversational_prompts(task, tmp_path):
    """A prompt given as messages is rendered in the chat format (ChatML for this tokenizer) with the assistant's
    turn opened, its completions stop at the end of turn, and a reward function gets them as TRL gives them:
    [{"role": "assistant", "content": ...}]."""
    from llamatron.data.sft import ChatRenderer
    from llamatron.data.tokenizer import load_tokenizer

    messages = [{"role": "user", "content": "1+1="}]
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"prompt": messages, "answer": "2"}) + "\n")
    check = tmp_path / "check.py"
    check.write_text(
        "def r(prompts, completions, **kw):\n"
        "    assert all(p[0]['role'] == 'user' for p in prompts)\n"
        "    return [float(c[0]['role'] == 'assistant' and isinstance(c[0]['content'], str)) for c in completions]\n"
    )
    _, runner = _engine(task, prompts=str(prompts), reward=[f"{check}:r"], seq_length=64, global_batch_size=4)
    rendered = ChatRenderer(task["tokenizer"]).prompt(messages)
    assert load_tokenizer(task["tokenizer"]).decode(runner.prompts.ids[0]) == rendered
    assert rendered.endswith("<|im_start|>assistant\n") and runner.stop.strings == ["<|im_end|>"]
    rollouts = runner._rollouts(0, 4)
    assert rollouts.fields[f"rewards/{check}:r/mean"] == 1.0
