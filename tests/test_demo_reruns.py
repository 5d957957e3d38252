"""A demo run again keeps what the earlier ones saved: each run saves to a directory of its own (runs/demo/checkpoint,
then checkpoint-2, ...), a LoRA checkpoint built on the first still loads, and the DPO demo starts from the newest."""

import functools
import hashlib
import os

import pytest

from llamatron import cli
from llamatron.checkpoint.reader import BASE_KEY, CheckpointReader
from llamatron.commands import demo
from llamatron.data import demo_corpus, demo_preference

TINY = ["--device", "cpu", "--no-progress", "--train-steps", "1", "--eval-interval", "1", "--eval-iters", "1"]
TINY += ["--seq-length", "24", "--micro-batch-size", "2", "--global-batch-size", "2"]


@pytest.fixture
def small_demo(tmp_path, monkeypatch):
    """The demo's corpus and pairs, small (a 512-token vocabulary, 100 kB of source, 100 pairs of 16 + 8 tokens)."""
    monkeypatch.chdir(tmp_path)
    corpus = functools.partial(demo_corpus.prepare_demo_data, vocab_size=512, max_bytes=100_000)
    pairs = functools.partial(demo_preference.prepare_demo_pairs, count=100, prompt=16, reply=8)
    monkeypatch.setattr(demo_corpus, "prepare_demo_data", corpus)
    monkeypatch.setattr(demo, "prepare_demo_data", corpus)
    monkeypatch.setattr(demo, "prepare_demo_pairs", pairs)
    return tmp_path


def _files(root) -> dict:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def _train(*flags: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", *TINY, *flags])
    assert exit_.value.code == 0


def test_a_demo_rerun_keeps_the_earlier_runs_and_a_lora_checkpoint_built_on_them(small_demo, capsys):
    first = small_demo / "runs/demo/checkpoint"
    _train()
    assert (first / "step-1").is_dir()
    _train("--load", "runs/demo/checkpoint", "--finetune", "--lora-rank", "2", "--save", "lora")
    assert BASE_KEY in CheckpointReader(small_demo / "lora").run_meta  # adapters only: it needs its base
    saved = _files(first)
    capsys.readouterr()

    _train("--tensorboard-dir", "runs/demo/tb")  # README's second demo run
    out = capsys.readouterr().out
    assert "this demo run saves to runs/demo/checkpoint-2; the earlier demo runs' checkpoints are kept" in out, out
    assert _files(first) == saved
    assert (small_demo / "runs/demo/checkpoint-2/step-1").is_dir()
    CheckpointReader(small_demo / "lora")  # its base is still there, unchanged

    _train("--objective", "dpo", "--seq-length", "23")
    out = capsys.readouterr().out
    assert "DPO from the language-model demo's checkpoint runs/demo/checkpoint-2" in out, out
    assert (small_demo / "runs/demo/dpo-checkpoint/step-1").is_dir()


def test_the_demo_picks_one_directory_for_all_ranks_and_resumes_in_place(tmp_path, monkeypatch):
    """A directory holding no checkpoint yet (rank 0 of this run made it, or a run stopped before its first save)
    is taken again; a resume (--load without --finetune) saves where it loads."""
    from llamatron.config.settings import config_from_values

    monkeypatch.chdir(tmp_path)
    base = "runs/demo/checkpoint"
    assert demo.fresh_run_dir(base) == base
    (tmp_path / base / "step-200").mkdir(parents=True)
    (tmp_path / "runs/demo/checkpoint-3").mkdir()  # a gap: numbers only go up
    assert demo.fresh_run_dir(base) == "runs/demo/checkpoint-3"
    (tmp_path / "runs/demo/checkpoint-3/latest").write_text("step-1\n")
    assert demo.fresh_run_dir(base) == "runs/demo/checkpoint-4"
    assert demo.newest_run_checkpoint(base) == "runs/demo/checkpoint-3"
    resume = config_from_values({"load": "runs/demo/checkpoint/step-200"})
    demo.apply_demo_defaults(resume)
    assert resume.train.save == os.path.realpath(base)


def test_dpo_fine_tuning_a_loaded_model_without_pairs_is_one_line_before_any_work(tmp_path):
    """Not the DPO demo (whose pairs are of the demo's tokenizer): the error the docs promise, and no demo corpus
    built in ./runs/demo."""
    from layout import run_train
    from test_train import llamatron

    run_train(["--train-steps", "1", "--save", "base"], 1, tmp_path)
    proc = llamatron("train", "--load", "base", "--finetune", "--objective", "dpo", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--objective dpo needs --preference-data PREFIX" in proc.stderr and not (tmp_path / "runs").exists()
