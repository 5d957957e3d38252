"""Training with LoRA (`--lora-rank`): from a base checkpoint with --finetune, only the adapters train (the base
weights are saved bitwise unchanged, optimizer state exists for the adapters alone), a resume continues exactly,
and what LoRA does not run yet is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import llamatron

from llamatron.checkpoint.reader import CheckpointReader, load_full_tensors

RUN = ["--model", "llama-test", "--mock-data", "--device", "cpu", "--seq-length", "16", "--global-batch-size", "2"]
RUN += ["--micro-batch-size", "1", "--no-progress", "--lr", "1e-2", "--warmup-steps", "0"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,v,down"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A base checkpoint; LoRA on it for 6 steps (saved at 3 and 6), and resumed from step 3 to 6."""
    d = tmp_path_factory.mktemp("lora")
    llamatron("train", *RUN, "--train-steps", "2", "--save", str(d / "base"), cwd=d)
    start = [*RUN, *LORA, "--load", str(d / "base"), "--finetune", "--train-steps", "6", "--save-interval", "3"]
    llamatron("train", *start, "--save", str(d / "a"), "--metrics-file", str(d / "a.jsonl"), cwd=d)
    resume = ["--load", str(d / "a" / "step-3"), "--train-steps", "6", "--metrics-file", str(d / "b.jsonl")]
    llamatron("train", *RUN, *LORA, *resume, cwd=d)
    return d


def _losses(path) -> dict[int, float]:
    records = map(json.loads, path.read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r and r.get("grad_norm") is not None}  # training steps


def test_only_the_adapters_train(runs):
    base, tuned = load_full_tensors(runs / "base"), load_full_tensors(runs / "a")
    adapters = {n for n in tuned if n.endswith((".lora_a", ".lora_b"))}
    assert adapters == {
        f"layers.{i}.{m}.{x}" for i in range(2) for m in ("attn.qkv", "mlp.down") for x in ("lora_a", "lora_b")
    }
    assert set(tuned) - adapters == set(base)
    assert all(torch.equal(tuned[n], base[n]) for n in base)  # the base is frozen
    assert all(tuned[n].abs().max() > 0 for n in adapters if n.endswith("lora_b"))  # B left zero: it trained
    reader = CheckpointReader(runs / "a")
    assert reader.names("exp_avg") == adapters  # no optimizer state for the base


def test_a_lora_run_resumes_exactly(runs):
    straight, resumed = _losses(runs / "a.jsonl"), _losses(runs / "b.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == pytest.approx(straight[s], rel=1e-6) for s in resumed), (straight, resumed)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-targets", "qkv"], "--lora-targets qkv names no linear"),
        (["--tp", "2", "--nproc-per-node", "2"], "--lora-rank does not run with --tp 2 yet"),
        (["--lora-rank", "-1"], "--lora-rank"),
    ],
)
def test_what_lora_cannot_do_is_one_line(tmp_path, flags, message):
    proc = llamatron("train", *RUN, *LORA, *flags, "--train-steps", "1", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_lora_checkpoint_is_not_read_as_a_plain_model(runs, tmp_path):
    proc = llamatron("export-hf", str(runs / "a"), str(tmp_path / "hf"), cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "is a LoRA checkpoint" in proc.stderr, proc.stderr
    proc = llamatron("train", *RUN, "--load", str(runs / "a"), "--train-steps", "7", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "load it with those flags" in proc.stderr, proc.stderr
