"""The built-in demo corpus (standard library sources): build, read back, reuse."""

import json
import os
import re
import time

import numpy as np

from llamatron.data.demo_corpus import prepare_demo_data, stdlib_source_files
from llamatron.data.indexed import IndexedDataset
from llamatron.data.samples import build_datasets
from llamatron.data.tokenizer import load_tokenizer


def test_demo_data_builds_reads_and_is_reused(tmp_path):
    said: list[str] = []
    result = prepare_demo_data(str(tmp_path / "demo"), vocab_size=512, max_bytes=400_000, say=said.append)
    # each phase is said as it starts (the demo is otherwise silent while its tokenizer trains), then the end
    phases = ["collecting up to 0.381 MiB", "training a 512-token byte-level BPE tokenizer", "tokenizing", "built in"]
    assert len(said) == len(phases) and all(p in line for p, line in zip(phases, said)), said
    assert f"({result['tokens']:,} tokens)" in said[-1]
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
    again = prepare_demo_data(str(tmp_path / "demo"), vocab_size=512, max_bytes=400_000, say=said.append)
    assert time.perf_counter() - start < 1.0
    assert said[-1] == f"demo corpus: built before, in {tmp_path / 'demo'}"
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
    said: list[str] = []
    prefix = prepare_demo_pairs(str(tmp_path / "demo"), corpus["prefix"], count=50, prompt=16, reply=8, say=said.append)
    assert said == [f"demo pairs: building 50 preference pairs (16-token prompts, 8-token replies) in {prefix}"]
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


def test_a_logs_step_lines_give_the_progress_bars_percentage_and_time_left(monkeypatch, capsys):
    """Without a terminal (a log) there is no bar: each step line ends with what the bar would show, the share of
    the steps done and the time left at the run's pace so far, as tqdm's own meter computes them (a resumed run
    counts its own steps' pace)."""
    from types import SimpleNamespace

    from tqdm import tqdm

    from llamatron.config.settings import RunConfig
    from llamatron.models import get_preset
    from llamatron.training import metrics

    cfg = RunConfig()
    cfg.train.train_steps, cfg.train.progress = 1000, False
    mesh = SimpleNamespace(is_logging_rank=True, world_size=1)
    engine = SimpleNamespace(cfg=cfg, mesh=mesh, model_cfg=get_preset("llama-test"), device="cpu")
    now = [100.0]
    monkeypatch.setattr(metrics, "time", SimpleNamespace(monotonic=lambda: now[0], perf_counter=lambda: now[0]))
    record = {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "steps_in_record": 1}
    speed = {"tokens_per_sec": 10.0, "mfu": None}
    for start, step, seconds in ((0, 130, 250.0), (400, 430, 7300.0), (0, 1000, 90.0)):
        log = metrics.MetricsLog(engine, start)  # type: ignore[arg-type]
        log.start_clock()
        now[0] += seconds
        log._show({**record, "step": step}, speed)
        line = capsys.readouterr().out.strip()
        meter = tqdm.format_meter(step, 1000, seconds, initial=start)  # e.g. " 13%|#3   | 130/1000 [04:10<27:53, ...]"
        percent, left = meter.split("|")[0].strip(), meter.split("<")[1].split(",")[0]
        assert line.startswith(f"step {step}: loss 1.0000") and f"| {percent} of 1000 steps, " in line, (line, meter)
        assert f"{metrics.duration(seconds)} elapsed" in line
        if step < 1000:  # to the second (tqdm truncates, we round), past an hour to the minute
            gap = abs(_clock(line.split("ETA ")[1]) - _clock(left))
            assert gap <= (60 if _clock(left) >= 3600 else 1), (line, meter)
        else:
            assert "ETA" not in line


def _clock(text: str) -> int:
    """Seconds of ours (45s, 4m07s, 2h05m) or tqdm's (04:07, 2:05:30)."""
    if ":" in text:
        return sum(int(p) * 60**i for i, p in enumerate(reversed(text.split(":"))))
    h, m, s = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text).groups()  # type: ignore[union-attr]
    return int(h or 0) * 3600 + int(m or 0) * 60 + int(s or 0)


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
