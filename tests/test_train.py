"""The single-process trainer through its public command."""

import json
import os
import subprocess
import sys

import pytest
from layout import BASE_ARGS, run_train

PY = sys.executable


def llamatron(*args, cwd, check=True):
    proc = subprocess.run(
        [PY, "-m", "llamatron", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **_pythonpath()},
    )
    if check and proc.returncode != 0:
        raise AssertionError(proc.stdout[-2000:] + proc.stderr[-4000:])
    return proc


def _pythonpath():
    import os

    return {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "HOME", "VIRTUAL_ENV")}


def test_no_progress_prints_one_plain_line_per_logged_step(tmp_path):
    proc = llamatron(
        "train",
        "--model",
        "llama-test",
        "--mock-data",
        "--device",
        "cpu",
        "--seq-length",
        "16",
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "1",
        "--train-steps",
        "4",
        "--log-interval",
        "2",
        "--no-progress",
        cwd=tmp_path,
    )
    logged = [line.split(":")[0] for line in proc.stdout.splitlines() if ": loss " in line]
    assert logged == ["step 2", "step 4"], proc.stdout
    assert "tokens/s" in proc.stdout and "\r" not in proc.stdout  # no progress bar redraws


def test_issue_command_writes_30_records_and_loss_falls(tmp_path):
    # The issue's command, with a short sequence to keep the suite fast.
    llamatron(
        "train",
        "--model",
        "llama-tiny",
        "--mock-data",
        "--train-steps",
        "30",
        "--device",
        "cpu",
        "--metrics-file",
        "m.jsonl",
        "--seq-length",
        "64",
        "--lr",
        "3e-3",
        "--no-progress",
        cwd=tmp_path,
    )
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    steps = [r for r in records if r.get("split") is None]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for r in steps:
        assert {
            "step",
            "loss",
            "lr",
            "grad_norm",
            "tokens_per_sec",
            "tflops_per_gpu",
            "mfu",
            "peak_mem_gib",
            "global_batch_size",
            "consumed_samples",
        } <= set(r)
        assert r["mfu"] is None  # CPU: unknown peak, never a guess
    assert steps[-1]["consumed_samples"] == 30 * 16
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    valid = [r for r in records if r.get("split") == "valid"]
    assert valid and {"loss", "perplexity", "accuracy"} <= set(valid[-1])


def test_bad_config_fails_before_training(tmp_path):
    proc = llamatron(
        "train",
        "--model",
        "llama-test",
        "--mock-data",
        "--tp",
        "3",
        "--metrics-file",
        "m.jsonl",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2
    assert "world size 1 is not divisible by tp*pp = 3*1" in proc.stderr and "Traceback" not in proc.stderr
    assert "launch a multiple of 3 processes" in proc.stderr
    assert not (tmp_path / "m.jsonl").exists()


def test_seed_makes_runs_repeatable_and_accumulation_matches(tmp_path):
    a = run_train([], 1, tmp_path)
    b = run_train([], 1, tmp_path)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    # 4 micro-batches of 2 vs one of 8: the same global batch, the same training.
    c = run_train(["--micro-batch-size", "8"], 1, tmp_path)
    for x, y in zip(a, c):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"]
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-4 * x["grad_norm"]


def test_resume_is_exact(tmp_path):
    full = run_train(["--train-steps", "6"], 1, tmp_path)
    run_train(["--train-steps", "6", "--save", "ck", "--save-interval", "3"], 1, tmp_path)
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-6"
    resumed = run_train(["--train-steps", "6", "--load", "ck/step-3"], 1, tmp_path)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[3:]]
    assert resumed[-1]["consumed_samples"] == full[-1]["consumed_samples"]


def test_keep_last_and_generate(tmp_path):
    run_train(["--train-steps", "4", "--save", "ck", "--save-interval", "1", "--keep-last", "2"], 1, tmp_path)
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == ["step-3", "step-4"]
    from llamatron.inference.generate import load_for_generation, sample

    model, meta = load_for_generation(str(tmp_path / "ck"))
    assert meta["step"] == 4
    out = sample(model, [1, 2, 3], max_new_tokens=5, seed=0)
    assert len(out) == 5 and all(0 <= t < model.cfg.vocab_size for t in out)


def test_load_of_other_architecture_lists_mismatches(tmp_path):
    run_train(["--train-steps", "1", "--save", "ck"], 1, tmp_path)
    with pytest.raises(AssertionError, match=r"does not fit this model[\s\S]*layers.0.attn.qkv.weight"):
        run_train(["--train-steps", "1", "--load", "ck", "--finetune"], 1, tmp_path, model="llama3-test")


def test_nproc_per_node_starts_torchrun_itself(tmp_path):
    ref = run_train([], 1, tmp_path)
    llamatron(
        "train",
        "--nproc-per-node",
        "2",
        "--model",
        "llama-test",
        *BASE_ARGS,
        "--distributed-optimizer",
        "--metrics-file",
        "m2.jsonl",
        cwd=tmp_path,
    )
    got = [json.loads(line) for line in (tmp_path / "m2.jsonl").read_text().splitlines()]
    got = [r for r in got if r.get("split") is None]
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"]


def test_nproc_per_node_checks_cuda_settings_against_the_gpus_it_sees(monkeypatch):
    """The settings are validated once before torchrun starts, knowing whether CUDA is there: GPU-only flags
    (a forced attention kernel, a Triton backend) pass on a GPU machine and are refused without one."""
    import torch

    from llamatron import cli
    from llamatron.commands import launch

    launched = []
    monkeypatch.setattr(launch, "relaunch_with_torchrun", lambda n: launched.append(n) or 0)
    argv = [
        "train",
        "--nproc-per-node",
        "2",
        "--model",
        "llama-test",
        "--mock-data",
        "--attention-backend",
        "cudnn",
        "--swiglu-backend",
        "triton",
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0 and launched == [2]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and launched == [2]


def test_user_mistakes_exit_2_with_a_message(tmp_path):
    proc = llamatron("train", "--model", "llama-tinyy", cwd=tmp_path, check=False)
    assert (
        proc.returncode == 2 and "unknown model preset 'llama-tinyy'" in proc.stderr and "Traceback" not in proc.stderr
    )
    (tmp_path / "bad.yaml").write_text("lr: [\n")
    proc = llamatron("train", "--config", "bad.yaml", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "is not valid YAML" in proc.stderr
    run_train(["--train-steps", "1", "--save", "ck"], 1, tmp_path)  # mock data: no tokenizer
    proc = llamatron("generate", "--load", "ck", "--prompt", "x", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "records no tokenizer" in proc.stderr and "--tokenizer" in proc.stderr


@pytest.mark.parametrize("seq_flags", [["--seq-length", "256"], []])
def test_sequence_beyond_the_models_context_warns_when_the_user_asked_for_it(seq_flags, tmp_path, capsys):
    """A --seq-length given beyond the context warns; the default (512, beyond llama-test's 128) does not."""
    from llamatron.cli import main

    flags = ["--model", "llama-test", "--mock-data", "--device", "cpu", "--micro-batch-size", "1"]
    with pytest.raises(SystemExit) as exc:
        main(["train", *flags, *seq_flags, "--global-batch-size", "1", "--train-steps", "1", "--no-progress"])
    assert exc.value.code in (0, None)
    err = capsys.readouterr().err
    if seq_flags:
        assert "--seq-length 256 is beyond llama-test's context of 128 tokens" in err and "factor: 2" in err
    else:
        assert "is beyond" not in err, err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data", "-1 data/a 2 data/b"], "weight -1 for data/a must be > 0 (a positive finite number)"),
        (["--data", "nan data/a 1 data/b"], "weight nan for data/a must be > 0"),
        (["--data", "0 data/a 1 data/b"], "weight 0 for data/a must be > 0"),
        (
            ["--data", "data/a data/b"],
            "2 prefixes without weights; to blend them give each a weight, e.g. '1 data/a 1 data/b'",
        ),
        (["--data", "0.5 data/a 0.5"], "expected 'WEIGHT PREFIX' pairs (a weight or a prefix is missing)"),
        (["--data", "data/a", "--split", "abc"], "split='abc': expected comma-separated numbers like '98,2,0'"),
        (["--data", "data/a", "--split", "nan,1"], "split='nan,1': need 1 to 3 finite non-negative weights"),
        (["--sft-data", "data/a", "--split", "1,2,3,4"], "split='1,2,3,4': need 1 to 3"),
    ],
)
def test_bad_data_and_split_flags_are_configuration_errors(flags, message, capsys):
    from llamatron.cli import main

    with pytest.raises(SystemExit) as exc:  # refused before any file is opened: data/a need not exist
        main(["train", "--model", "llama-test", "--device", "cpu", "--no-progress", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "llamatron train: configuration error:" in err and message in err, err


def test_nproc_per_node_failure_is_reported_once_with_the_ranks_exit_code(tmp_path):
    """A bad setting under --nproc-per-node: the rank's clean message, one summary line, exit 2; no gloo
    traceback from a rank left waiting and no torchrun traceback."""
    proc = llamatron(
        "train",
        "--nproc-per-node",
        "2",
        "--model",
        "llama-test",
        "--data",
        "data/nope",
        "--device",
        "cpu",
        "--seq-length",
        "32",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("data error: data/nope.idx: file not found") == 1
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert "llamatron: the job failed (rank 0: exit code 2; rank 1: " in proc.stderr


def test_log_interval_records_average_their_steps_and_time_only_training(tmp_path, monkeypatch):
    """--log-interval 4: one record per 4 steps, in step order with the evaluations, its loss the mean of its
    steps, its speed from the training time of its steps alone (a clock that moves 1 s per step, 50 s per
    evaluation and 70 s per save: every record must read exactly one step's tokens per second)."""
    from llamatron import cli
    from llamatron.training import metrics
    from llamatron.training import trainer as train
    from llamatron.training.checkpointing import Checkpointing
    from llamatron.training.evaluation import Evaluation

    clock = [0.0]

    class FakeTimer:
        def __init__(self, device):
            self.start = clock[0]

        def elapsed(self, sync=True):
            return clock[0] - self.start

        def reset(self):
            self.start = clock[0]

    def advancing(fn, seconds):
        def wrapped(*args, **kwargs):
            clock[0] += seconds
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(metrics, "Timer", FakeTimer)
    monkeypatch.setattr(train, "train_step", advancing(train.train_step, 1.0))
    monkeypatch.setattr(Evaluation, "run", advancing(Evaluation.run, 50.0))
    monkeypatch.setattr(Checkpointing, "save", advancing(Checkpointing.save, 70.0))
    monkeypatch.chdir(tmp_path)
    args = ["train", "--model", "llama-test", *BASE_ARGS, "--train-steps", "8", "--eval-interval", "3"]

    def records(extra, name):
        with pytest.raises(SystemExit) as exit_:
            cli.main([*args, *extra, "--metrics-file", name])
        assert exit_.value.code == 0
        return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]

    every = [r for r in records(["--log-interval", "1"], "every.jsonl") if r.get("split") is None]
    got = records(["--log-interval", "4", "--save", "ck", "--save-interval", "3"], "four.jsonl")
    assert [(r["step"], r.get("split")) for r in got] == [
        (0, "valid"),
        (3, "valid"),
        (4, None),
        (6, "valid"),
        (8, None),
        (8, "valid"),
    ]
    tokens_per_step = 8 * 32  # --global-batch-size 8, --seq-length 32 (BASE_ARGS)
    for record in (r for r in got if r.get("split") is None):
        window = every[record["step"] - 4 : record["step"]]
        assert record["steps_in_record"] == 4
        assert record["loss"] == pytest.approx(sum(r["loss"] for r in window) / 4, rel=1e-6)
        assert record["grad_norm"] == pytest.approx(window[-1]["grad_norm"], rel=1e-6)
        assert record["tokens_per_sec"] == pytest.approx(tokens_per_step)  # 4 steps' tokens in 4 s
        assert record["consumed_samples"] == 8 * record["step"]


def test_local_launcher_reports_ctrl_c_in_one_line(monkeypatch, capsys):
    """Ctrl-C under --nproc-per-node: torchrun stops the ranks; the launcher says so instead of a traceback."""
    import signal as signals

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from llamatron import local_launch

    def interrupted(args):
        raise SignalException("Process 1 got signal: 2", sigval=signals.SIGINT)

    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "")  # main() sets it: restored after the test
    monkeypatch.setattr(local_launch, "run", interrupted)
    monkeypatch.setattr(local_launch.signal, "signal", lambda *a: None)  # leave pytest's own handlers alone
    assert local_launch.main(["--nproc-per-node", "2", "-m", "llamatron", "train"]) == 130
    assert "llamatron: stopped by SIGINT" in capsys.readouterr().err
    # the launcher names itself only to its ranks: run inside this process it left the environment as it was (a
    # later in-process `llamatron` call would have taken this process for its own child and stopped it)
    assert local_launch.PARENT_ENV not in os.environ


def test_a_process_named_as_its_own_parent_is_not_stopped(monkeypatch):
    from llamatron.parent_watch import PARENT_ENV, stop_with_parent

    monkeypatch.setenv(PARENT_ENV, str(os.getpid()))
    stop_with_parent()  # SIGTERM to itself would end this test process
    assert PARENT_ENV not in os.environ
