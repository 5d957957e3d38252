"""DPO under parallel layouts equals the single process (fp32, gloo): per-step loss and grad norm, each layout
computing its own reference pass (its own --data-cache-path). Resumes continue exactly, read the reference table
the run started with, and recompute it only where the base is the reference (LoRA from zero adapters)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from layout import assert_matches, run_train

from llamatron.data.indexed import IndexedDatasetWriter
from llamatron.data.preference import response_prefix
from llamatron.data.sft import mask_prefix

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all-linear"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> str:
    """Preference pairs written directly (token ids below llama-test's 256): the chosen response repeats the
    prompt's last tokens, the rejected one is random; both fit --seq-length 32."""
    prefix = str(tmp_path_factory.mktemp("pairs") / "p_pref")
    rng = np.random.default_rng(0)
    writers = {}
    for response in ("chosen", "rejected"):
        writers[response] = IndexedDatasetWriter(response_prefix(prefix, response), np.uint16)
        writers[f"{response}_mask"] = IndexedDatasetWriter(mask_prefix(response_prefix(prefix, response)), np.uint8)
    for _ in range(64):
        prompt = rng.integers(3, 256, int(rng.integers(4, 12)))
        n = int(rng.integers(2, prompt.size + 1))
        for response, reply in (("chosen", prompt[-n:][::-1]), ("rejected", rng.integers(3, 256, n))):
            writers[response].add_document(np.concatenate([prompt, reply]))
            writers[f"{response}_mask"].add_document(np.r_[np.zeros(prompt.size), np.ones(n)].astype(np.uint8))
    for writer in writers.values():
        writer.finalize()
    return prefix


def dpo(pairs: str, workdir) -> list[str]:
    return ["--objective", "dpo", "--preference-data", pairs, "--data-cache-path", str(workdir), "--lr", "1e-2"]


# The rewards are beta (0.1) x a difference of log-probabilities of about -25 (these pairs), each agreeing to the
# layouts' rtol 1e-4: the rewards to 0.1 x 1e-4 x 25 x 2 (a reward doubled, ~1e-3 at step 5, is still caught).
REWARDS_ATOL = dict.fromkeys(("rewards_chosen", "rewards_rejected", "rewards_margin"), 5e-4)

# name -> (flags, processes)
LAYOUTS = {
    "dp2-distopt": (["--distributed-optimizer"], 2),
    "tp2-sp": (["--tp", "2", "--sequence-parallel"], 2),
    "pp2": (["--pp", "2"], 2),
    "cp2": (["--cp", "2"], 2),
    "lora-dp2": (LORA, 2),
}


@pytest.fixture(scope="module")
def reference(pairs, tmp_path_factory):
    cache: dict[bool, list[dict]] = {}

    def get(lora: bool) -> list[dict]:
        if lora not in cache:
            d = tmp_path_factory.mktemp("dpo-single")
            cache[lora] = run_train([*dpo(pairs, d), *(LORA if lora else [])], 1, d, mock_data=False, include_eval=True)
        return cache[lora]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_layout_matches_single_process(name, pairs, reference, tmp_path):
    flags, nproc = LAYOUTS[name]
    everything = run_train([*dpo(pairs, tmp_path), *flags], nproc, tmp_path, mock_data=False, include_eval=True)
    got, single = ([r for r in rs if r.get("split") is None] for rs in (everything, reference(flags == LORA)))
    assert_matches(single, got, atol=REWARDS_ATOL)  # every field: the loss, grad norm, rewards, log-probs, accuracy
    # evaluation's DPO metrics on the validation pairs (their reference computed by the same pass)
    (valid,), (single_valid,) = ([r for r in rs if r.get("split")] for rs in (everything, reference(flags == LORA)))
    assert_matches([single_valid], [valid], atol=REWARDS_ATOL)
    # the layout's own reference pass gives its first step the starting model's log-probs: a tie, log 2
    assert abs(got[0]["loss"] - math.log(2)) < 1e-6 and got[0]["rewards_margin"] == 0


def _losses(path) -> dict[int, float]:
    records = map(json.loads, path.read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r.get("split") is None}


@pytest.mark.parametrize("lora", [False, True])
def test_a_dpo_run_resumes_exactly(pairs, tmp_path, lora):
    """From step 3 of a 6-step run: the same losses; with the reference table damaged, one line saying what works;
    deleted, a LoRA run from zero adapters recomputes it from the base (adapters off), a full fine-tuning run is
    refused in one line."""
    from test_train import llamatron

    flags = [*dpo(pairs, tmp_path), *(LORA if lora else []), "--model", "llama-test", "--device", "cpu"]
    flags += ["--precision", "fp32", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8"]
    flags += ["--no-progress", "--log-interval", "1", "--eval-interval", "0", "--warmup-steps", "0"]
    whole = tmp_path / "whole.jsonl"
    llamatron(
        "train",
        *flags,
        "--train-steps",
        "6",
        "--save",
        "ckpt",
        "--save-interval",
        "3",
        "--metrics-file",
        str(whole),
        cwd=tmp_path,
    )
    after_3 = {s: v for s, v in _losses(whole).items() if s > 3}
    resume = ["--load", "ckpt/step-3", "--train-steps", "6"]
    if not lora:  # the table is read back
        llamatron("train", *flags, *resume, "--metrics-file", str(tmp_path / "read.jsonl"), cwd=tmp_path)
        assert _losses(tmp_path / "read.jsonl") == after_3
    (table,) = tmp_path.glob("*-reference-*.npy")
    table.write_bytes(b"not a table")  # damaged: the message says what works for this run
    proc = llamatron("train", *flags, *resume, cwd=tmp_path, check=False)
    (line,) = proc.stderr.splitlines()
    assert proc.returncode == 2 and "unreadable reference log-probs" in line, proc.stderr
    if lora:  # from zero adapters: computed again from the base
        assert line.endswith("delete it: the next run computes them again"), line
    else:  # the weights are no longer the reference: deleting it would not help
        assert "delete it" not in line and line.endswith("start the DPO run again from the checkpoint it started from")
    table.unlink()
    proc = llamatron(
        "train", *flags, *resume, "--metrics-file", str(tmp_path / "again.jsonl"), cwd=tmp_path, check=False
    )
    if lora:
        assert proc.returncode == 0, proc.stderr
        assert _losses(tmp_path / "again.jsonl") == after_3
    else:
        assert proc.returncode == 2 and "are gone" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_the_reference_table_is_reused_for_the_same_data_and_not_for_rewritten_data(pairs, tmp_path):
    """Pairs rewritten with the same lengths are other pairs: their reference is computed again."""
    import shutil
    from pathlib import Path

    for f in Path(pairs).parent.iterdir():
        shutil.copy(f, tmp_path / f.name)
    prefix = str(tmp_path / Path(pairs).name)
    args = [*dpo(prefix, tmp_path), "--train-steps", "1"]
    first = run_train(args, 1, tmp_path, mock_data=False)
    assert len(list(tmp_path.glob("*-reference-*.npy"))) == 1
    again = run_train(args, 1, tmp_path, mock_data=False)  # the same table read back
    assert [r["loss"] for r in again] == [r["loss"] for r in first]
    assert len(list(tmp_path.glob("*-reference-*.npy"))) == 1
    chosen = tmp_path / (Path(response_prefix(prefix, "chosen")).name + ".bin")
    tokens = np.fromfile(chosen, dtype=np.uint16)
    (255 - tokens % 200).astype(np.uint16).tofile(chosen)  # other token ids, the same sizes
    run_train(args, 1, tmp_path, mock_data=False)
    assert len(list(tmp_path.glob("*-reference-*.npy"))) == 2
