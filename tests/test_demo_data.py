"""The built-in demo corpus (standard library sources): build, read back, reuse."""

import json
import os
import time

import numpy as np

from llamatron.data.demo_corpus import prepare_demo_data, stdlib_source_files
from llamatron.data.indexed import IndexedDataset
from llamatron.data.samples import build_datasets
from llamatron.data.tokenizer import load_tokenizer


def test_demo_data_builds_reads_and_is_reused(tmp_path):
    result = prepare_demo_data(str(tmp_path / "demo"), vocab_size=512, max_bytes=400_000)
    dataset = IndexedDataset(result["prefix"])
    assert len(dataset) == result["documents"] == result["files"] > 10
    assert dataset.num_tokens == result["tokens"]
    assert result["bytes"] <= 400_000

    tokenizer = load_tokenizer(result["tokenizer"])
    assert tokenizer.vocab_size == 512
    text = 'def greet(name: str) -> str:\n    return f"Hello, {name}!"  # ünïcode\n'
    assert tokenizer.decode(tokenizer.encode(text)) == text
    # documents decode back to the collected files, each followed by the EOD token
    first = dataset[0]
    assert first[-1] == tokenizer.eod_id
    with open(result["jsonl"], encoding="utf-8") as f:
        assert tokenizer.decode(first[:-1]) == json.loads(f.readline())["text"]

    train, valid = build_datasets(result["prefix"], "90,10,0", 64, 32, 4, seed=0)
    assert train[0].shape == (65,) and train[0].max() < 512 and valid is not None

    marker_time = os.path.getmtime(tmp_path / "demo" / "demo_data.json")
    start = time.perf_counter()
    again = prepare_demo_data(str(tmp_path / "demo"), vocab_size=512, max_bytes=400_000)
    assert time.perf_counter() - start < 1.0
    assert again["prefix"] == result["prefix"] and again["tokens"] == result["tokens"]
    assert os.path.getmtime(tmp_path / "demo" / "demo_data.json") == marker_time


def test_source_selection_is_deterministic_and_capped():
    first = stdlib_source_files(200_000)
    assert first == stdlib_source_files(200_000)
    assert sum(len(text.encode()) for _, text in first) <= 200_000
    names = [name for name, _ in first]
    assert all(name.endswith(".py") for name in names)
    assert not any("site-packages" in n or "/test/" in n or n.startswith("test/") for n in names)


def test_incomplete_build_is_redone(tmp_path):
    work_dir = str(tmp_path / "demo")
    result = prepare_demo_data(work_dir, vocab_size=300, max_bytes=100_000)
    os.remove(result["prefix"] + ".bin")  # as if a crash lost it
    redone = prepare_demo_data(work_dir, vocab_size=300, max_bytes=100_000)
    assert np.array_equal(IndexedDataset(redone["prefix"])[0], IndexedDataset(result["prefix"])[0])


def test_the_demo_summary_shows_progress_only_between_two_evaluations():
    from llamatron.commands.demo import validation_summary

    first = {"step": 0, "split": "valid", "loss": 8.371, "consumed_samples": 0}
    assert validation_summary([]) is None
    assert validation_summary([first]) == "validation loss 8.371 at step 0, the only evaluation of this run"
    later = {"step": 250, "split": "valid", "loss": 2.5, "consumed_samples": 2000}
    assert validation_summary([first, later]).startswith("validation loss 8.371 at step 0 -> 2.500 at step 250 (")


def test_the_dpo_demos_pairs_are_real_against_swapped_continuations(tmp_path):
    from llamatron.data.demo_preference import prepare_demo_pairs
    from llamatron.data.preference_dataset import PreferencePairs

    corpus = prepare_demo_data(str(tmp_path / "demo"), vocab_size=512, max_bytes=200_000)
    prefix = prepare_demo_pairs(str(tmp_path / "demo"), corpus["prefix"], count=50, prompt=16, reply=8)
    pairs, text = PreferencePairs(prefix), IndexedDataset(corpus["prefix"])
    assert len(pairs) == 50
    joined = np.concatenate([text[i] for i in range(len(text))])
    for i in range(50):
        chosen, rejected = pairs.tokens[0][i], pairs.tokens[1][i]
        assert pairs.masks[0][i].tolist() == pairs.masks[1][i].tolist() == [0] * 16 + [1] * 8
        windows = np.lib.stride_tricks.sliding_window_view(joined, 24)
        assert (windows == chosen).all(axis=1).any()  # a real stretch of the corpus
        assert (chosen[:16] == rejected[:16]).all() and sorted(chosen[16:]) == sorted(rejected[16:])
        assert 0 < (chosen != rejected).sum() <= 4 or (chosen == rejected).all()  # two swaps (of equal tokens: none)
    marker = os.path.getmtime(prefix + ".json")
    assert prepare_demo_pairs(str(tmp_path / "demo"), corpus["prefix"], count=50, prompt=16, reply=8) == prefix
    assert os.path.getmtime(prefix + ".json") == marker  # reused


def test_the_dpo_demo_summary_says_a_rising_language_model_loss_is_expected(capsys):
    from llamatron.commands.demo import print_dpo_demo_summary

    def record(step, loss, accuracy, margin, dpo):
        return {"step": step, "loss": loss, "rewards_accuracy": accuracy, "rewards_margin": margin, "dpo_loss": dpo}

    print_dpo_demo_summary([record(0, 5.04, 0.0, 0.0, 0.693), record(100, 5.63, 0.93, 0.64, 0.457)], "ck")
    out = capsys.readouterr().out
    assert "language-model loss on their responses 5.040 -> 5.630, a rise DPO is expected to give" in out, out
    print_dpo_demo_summary([record(0, 5.04, 0.0, 0.0, 0.693), record(100, 4.9, 0.93, 0.64, 0.457)], "ck")
    assert "expected" not in capsys.readouterr().out
    print_dpo_demo_summary([], "ck")  # no validation split (--split 100,0,0): no traceback
    assert capsys.readouterr().out == "no held-out pairs were evaluated (no validation split)\ncheckpoint: ck\n"
