"""What `train` checks before it starts: where it saves, and what it loads. Nothing already saved is lost."""

import hashlib
import re

import pytest
from layout import run_train
from test_train import llamatron

ARGS = [
    "--model",
    "llama-test",
    "--mock-data",
    "--device",
    "cpu",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--no-progress",
]


def _fingerprint(root) -> dict:
    """Every checkpoint file's hash (not the .lock, which names the run that holds the directory now)."""
    files = (p for p in root.rglob("*") if p.is_file() and p.name != ".lock")
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture
def saved(tmp_path):
    """A run's checkpoints at steps 1 and 2 in tmp_path/ck, and their fingerprint."""
    run_train(["--train-steps", "2", "--save", "ck", "--save-interval", "1"], 1, tmp_path)
    return tmp_path / "ck", _fingerprint(tmp_path / "ck")


def test_a_fresh_run_refuses_to_save_over_another_runs_checkpoints(tmp_path, saved):
    ck, before = saved
    proc = llamatron(
        "train",
        *ARGS,
        "--train-steps",
        "2",
        "--save",
        "ck",
        "--save-interval",
        "1",
        "--keep-last",
        "1",
        "--seed",
        "9",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--save ck already holds another run's checkpoints (2 checkpoints, the latest step-2)" in proc.stderr
    assert "Resume that run with --load ck" in proc.stderr and "Traceback" not in proc.stderr
    assert "step 1" not in proc.stdout  # refused before training
    assert _fingerprint(ck) == before


def test_fine_tuning_into_the_directory_it_loads_is_refused(tmp_path, saved):
    ck, before = saved
    proc = llamatron(
        "train",
        *ARGS,
        "--train-steps",
        "2",
        "--load",
        "ck",
        "--finetune",
        "--save",
        "ck",
        "--keep-last",
        "1",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2 and "fine-tuning starts again at step 0" in proc.stderr, proc.stderr[-2000:]
    assert _fingerprint(ck) == before


def test_resuming_saves_into_its_own_directory_from_latest_or_a_step(tmp_path, saved):
    ck, before = saved
    run_train(["--train-steps", "3", "--load", "ck", "--save", "ck", "--save-interval", "1"], 1, tmp_path)
    assert (ck / "latest").read_text().strip() == "step-3"
    unchanged = {k: v for k, v in _fingerprint(ck).items() if not k.startswith("step-3")}
    assert unchanged.keys() == before.keys() and all(unchanged[k] == before[k] for k in before if k != "latest")
    # going back to an earlier step of the same run (after a loss spike, say) is resuming too
    run_train(["--train-steps", "2", "--load", "ck/step-1", "--save", "ck", "--save-interval", "1"], 1, tmp_path)
    assert (ck / "latest").read_text().strip() == "step-2"


def test_save_path_that_cannot_be_a_directory_fails_before_training(tmp_path):
    (tmp_path / "afile").write_text("hi\n")
    proc = llamatron("train", *ARGS, "--train-steps", "3", "--save", "afile", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "--save afile is a file, not a directory" in proc.stderr, proc.stderr[-2000:]
    assert "step 1" not in proc.stdout and (tmp_path / "afile").read_text() == "hi\n"
    proc = llamatron("train", *ARGS, "--train-steps", "3", "--save", "afile/sub", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "--save afile/sub: cannot create the directory" in proc.stderr


def test_a_checkpoint_of_another_model_is_refused_before_the_model_is_built(tmp_path, saved, monkeypatch, capsys):
    """--model llama2-7b would take ~100 GB on the CPU before the shapes were compared: they are compared first."""
    from llamatron import cli

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the checkpoint was checked")

    # train's own name only: patching llamatron.training.engine first made a fresh
    # `import llamatron.training.trainer` take the stand-in, which monkeypatch then "restored" there for every
    # later test of the process
    monkeypatch.setattr("llamatron.training.trainer.build_engine", no_engine)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", *ARGS[2:], "--model", "llama2-7b", "--load", "ck", "--finetune", "--train-steps", "1"])
    first, *weights = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and "does not fit this model (llama2-7b)" in first and "leave out --model" in first
    # five of the weights, then how many more (llama2-7b's 32 layers differ in all of theirs)
    assert len(weights) == 6 and re.fullmatch(r"  \.\.\. \d+ more", weights[-1]), weights


def test_a_checkpoint_missing_a_rank_file_is_refused_before_the_model_is_built(tmp_path, saved, monkeypatch, capsys):
    from llamatron import cli

    ck, _ = saved
    shard = next((ck / "step-2").glob("*.safetensors"))
    shard.unlink()
    monkeypatch.setattr("llamatron.training.trainer.build_engine", lambda *a, **k: pytest.fail("engine built first"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", *ARGS, "--load", "ck", "--save", "ck", "--train-steps", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{shard.name} is listed in its index but missing" in err


def test_a_tokenizer_too_large_for_a_loaded_checkpoint_names_the_checkpoint(tmp_path, saved, monkeypatch, capsys):
    """--load without --model takes the checkpoint's architecture: the error names it, not the default preset."""
    from llamatron import cli
    from llamatron.data.tokenizer import train_bpe_tokenizer

    texts = [f"word{i} other{i * 7} thing{i % 13}" for i in range(400)]
    train_bpe_tokenizer(texts, vocab_size=600, out_dir=str(tmp_path / "tok"))  # llama-test has 256 ids
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(
            [
                "train",
                "--load",
                "ck",
                "--finetune",
                "--data",
                "unused",
                "--tokenizer",
                "tok",
                "--device",
                "cpu",
                "--save",
                "ft",
                "--train-steps",
                "1",
            ]
        )
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "but the model of checkpoint ck only 256" in err, err
    assert "use the tokenizer ck was trained with" in err and "llama-tiny" not in err


def test_a_refused_demo_run_leaves_the_previous_demo_checkpoints(tmp_path, monkeypatch, capsys):
    """A demo run refused for bad input (--min-lr above --lr, training.validate's) leaves runs/demo/checkpoint as
    it was (the DPO demo and any --load start from it) and makes no directory of its own."""
    from llamatron import cli
    from llamatron.commands.demo import apply_demo_defaults
    from llamatron.config.settings import config_from_values

    monkeypatch.chdir(tmp_path)
    cfg = config_from_values({})
    apply_demo_defaults(cfg)
    previous = tmp_path / cfg.train.save / "step-200"
    previous.mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--model", "llama-tiny", "--lr", "1e-4", "--min-lr", "1e-3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "min" in err, err
    assert previous.is_dir() and sorted(p.name for p in previous.parent.parent.iterdir()) == ["checkpoint"]


def test_resuming_names_the_settings_that_changed_and_an_empty_run(tmp_path, saved):
    """The schedule and the data position depend on the settings: a resume that changes them says so."""
    # BASE_ARGS of the saved run: --lr 1e-3, --seq-length 32, --train-steps 2
    proc = llamatron(
        "train",
        *ARGS,
        "--precision",
        "fp32",
        "--load",
        "ck",
        "--save",
        "ck",
        "--train-steps",
        "3",
        "--lr",
        "5e-2",
        "--min-lr",
        "1e-4",
        "--warmup-steps",
        "1",
        cwd=tmp_path,
    )
    note = next(line for line in proc.stdout.splitlines() if line.startswith("note: resuming"))
    assert "--train-steps 2 -> 3" in note and "--lr 0.001 -> 0.05" in note and "--seq-length 32 -> 16" in note
    assert "--global-batch-size 8 -> 2" in note and "data position" in note and "--min-lr" not in note
    proc = llamatron(
        "train",
        *ARGS,
        "--precision",
        "fp32",
        "--load",
        "ck",
        "--save",
        "ck",
        "--train-steps",
        "2",
        "--lr",
        "5e-2",
        "--min-lr",
        "1e-4",
        "--warmup-steps",
        "1",
        cwd=tmp_path,
    )
    assert "note: nothing to train: the checkpoint is at step 3 and --train-steps is 2" in proc.stdout


def test_a_checkpoint_directory_without_latest_names_its_steps(tmp_path, saved):
    from llamatron.checkpoint.reader import resolve_checkpoint
    from llamatron.errors import CheckpointError

    ck, _ = saved
    (ck / "latest").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"has no `latest` file; load one of its checkpoints by name "
        r"\(step-1, step-2\), e\.g\. --load .*ck/step-2",
    ):
        resolve_checkpoint(ck)
    assert resolve_checkpoint(ck / "step-1") == ck / "step-1"
