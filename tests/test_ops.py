"""Operations (issue 9, parts 3-4): metric sinks, evaluation metrics, skipped steps, pre-emption, timeouts."""

from __future__ import annotations

import glob
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from layout import BASE_ARGS, free_port

from llamatron.errors import STOPPED_EARLY_EXIT

REPO = str(Path(__file__).resolve().parents[1])
INJECT_FAULTS = str(Path(__file__).resolve().parent / "inject_faults.py")


def _command(args: list[str], nproc: int, via_cli: bool = False, faults: Sequence[str] = ()) -> list[str]:
    """faults: tests/inject_faults.py's flags (e.g. ["--nan-steps", "3"]); it runs the command with them."""
    cmd = [sys.executable]
    if via_cli:  # llamatron's own --nproc-per-node starts torchrun
        args = [*args, "--nproc-per-node", str(nproc)]
    elif nproc > 1:
        cmd += [
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
        ]
    entry = [INJECT_FAULTS, *faults, "--"] if faults else ["-m", "llamatron"]
    return cmd + [*entry, "train", "--model", "llama-test", *BASE_ARGS, *args, "--metrics-file", "m.jsonl"]


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
        **extra,
    }


def train(workdir: Path, args: list[str], nproc: int = 1, check: bool = True, faults: Sequence[str] = (), **env: str):
    """Run `llamatron train` in `workdir` (with faults injected); returns (process, step records, evaluation
    records)."""
    metrics = workdir / "m.jsonl"
    metrics.unlink(missing_ok=True)
    proc = subprocess.run(
        _command(args, nproc, faults=faults),
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(**env),
        cwd=workdir,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return (proc, *_records(metrics))


def _records(metrics: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return [r for r in records if "split" not in r], [r for r in records if "split" in r]


def _tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    from llamatron.checkpoint.reader import load_full_tensors  # checkpoints are pieces: read them whole

    return {
        **load_full_tensors(step_dir),
        **{
            f"optim.{name}.{kind}": v
            for kind in ("exp_avg", "exp_avg_sq", "step")
            for name, v in load_full_tensors(step_dir, kind).items()
        },
    }


# --- non-finite steps -------------------------------------------------------------------------------------------


def test_nan_step_is_skipped_leaving_parameters_and_optimizer_state_unchanged(tmp_path):
    _, steps, _ = train(
        tmp_path, ["--train-steps", "4", "--save", "ck", "--save-interval", "1"], faults=["--nan-steps", "3"]
    )
    assert [r["skipped"] for r in steps] == [False, False, True, False]
    assert [r["skipped_steps"] for r in steps] == [0, 0, 1, 1]
    assert steps[2]["loss"] is None and steps[2]["grad_norm"] is None  # NaN is written as null (strict JSON)
    assert all(math.isfinite(r["loss"]) for r in steps if not r["skipped"])
    before, after, next_step = (_tensors(tmp_path / "ck" / f"step-{s}") for s in (2, 3, 4))
    for name, tensor in before.items():  # weights, moments and AdamW step counts
        assert torch.equal(tensor, after[name]), name
    assert not torch.equal(after["layers.0.attn.qkv.weight"], next_step["layers.0.attn.qkv.weight"])
    assert after["optim.layers.0.attn.qkv.weight.step"].item() == 2  # the skipped step did not count


def test_consecutive_nan_steps_stop_the_run_with_a_clear_message(tmp_path):
    proc, steps, _ = train(
        tmp_path, ["--train-steps", "8", "--max-skipped-steps", "2"], check=False, faults=["--nan-steps", "2,4,5"]
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "stopped: 2 steps in a row (steps 4-5) had a non-finite loss or gradient norm" in proc.stderr
    assert "--max-skipped-steps 2" in proc.stderr and "those after step 3." in proc.stderr
    assert "Traceback" not in proc.stderr
    # Step 2's skip was not part of the streak (step 3 succeeded); the records up to the stop are all written.
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r["skipped_steps"] for r in steps] == [0, 1, 1, 2, 3]


def test_fp16_overflow_while_the_loss_scale_backs_off_is_not_a_fault(tmp_path):
    # Scale 4 -> 2 (step 2: the scaler calibrating) -> 1 (step 3, the floor) -> 1 (step 4): only 3 and 4 count.
    proc, steps, _ = train(
        tmp_path,
        ["--train-steps", "6", "--precision", "fp16", "--initial-loss-scale", "4", "--max-skipped-steps", "2"],
        check=False,
        faults=["--nan-steps", "2,3,4"],
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "stopped: 2 steps in a row (steps 3-4)" in proc.stderr and "those after step 1." in proc.stderr
    assert [r["loss_scale"] for r in steps] == [4.0, 2.0, 1.0, 1.0]
    assert [r["skipped_steps"] for r in steps] == [0, 1, 2, 3]
    skipped = "loss nan, grad norm nan: not finite, step skipped"
    assert f"step 2: {skipped}" not in proc.stdout and f"step 3: {skipped}" in proc.stdout  # calibration: no fault


# --- pre-emption: SIGTERM / SIGUSR1 / SIGINT --------------------------------------------------------------------------

# A constant learning rate makes the losses independent of --train-steps, so a run interrupted anywhere in
# 10000 steps can be compared with short uninterrupted runs.
CONSTANT_LR = ["--lr-schedule", "constant"]


def _interrupt(
    workdir: Path, nproc: int, signum: int, target_rank: int | None, via_cli: bool = False
) -> tuple[subprocess.CompletedProcess, int]:
    """Start a long run, send `signum` once two steps are logged (to one worker rank, or to the launched
    process itself), and return the finished process and the step its checkpoint holds."""
    metrics = workdir / "m.jsonl"
    metrics.unlink(missing_ok=True)
    args = ["--train-steps", "10000", "--save", "ck", *CONSTANT_LR]
    proc = subprocess.Popen(
        _command(args, nproc, via_cli),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=workdir,
    )
    try:
        deadline = time.monotonic() + 240
        while (metrics.read_text().count("\n") if metrics.exists() else 0) < 2:  # complete lines only
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.05)
        pid = proc.pid if target_rank is None else _worker_pids(proc.pid)[target_rank]
        os.kill(pid, signum)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    # Saved, but not finished: not 0 (a scheduler would call it done), nor a failure's 1 or bad input's 2. Plain
    # torchrun calls any rank's non-zero status a failure and exits 1; llamatron's own launcher keeps the 3.
    want = STOPPED_EARLY_EXIT if nproc == 1 or via_cli else 1
    assert done.returncode == want, f"exit {done.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    step = int((workdir / "ck" / "latest").read_text().strip().removeprefix("step-"))
    return done, step


def _worker_pids(parent: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes, from /proc."""
    from llamatron.local_launch import children

    out = {}
    for pid in children(parent):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            out[int(next(e for e in env if e.startswith(b"RANK="))[5:])] = pid
        except (OSError, StopIteration):
            continue
    return out


def _check_resume_is_exact(workdir: Path, interrupted: list[dict], step: int, nproc: int) -> None:
    total = step + 3
    _, reference, _ = train(workdir, ["--train-steps", str(total), *CONSTANT_LR], nproc)
    assert [r["loss"] for r in interrupted] == [r["loss"] for r in reference[:step]]
    _, resumed, _ = train(workdir, ["--train-steps", str(total), "--load", "ck", *CONSTANT_LR], nproc)
    assert [r["step"] for r in resumed] == list(range(step + 1, total + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference[step:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in reference[step:]]


def test_sigterm_saves_a_checkpoint_exits_3_and_resume_is_exact(tmp_path):
    done, step = _interrupt(tmp_path, 1, signal.SIGTERM, None)
    assert 2 <= step < 10000
    assert f"stopping after step {step}: received SIGTERM" in done.stdout
    assert f"saved ck/step-{step}, resume with --load ck" in done.stdout
    interrupted, _ = _records(tmp_path / "m.jsonl")
    assert [r["step"] for r in interrupted] == list(range(1, step + 1))  # every step up to the stop is logged
    _check_resume_is_exact(tmp_path, interrupted, step, 1)


def test_signal_to_one_rank_stops_all_ranks_of_a_torchrun_job(tmp_path):
    # Only rank 1 receives SIGUSR1; the ranks agree at the step boundary, save together, and all exit 3.
    done, step = _interrupt(tmp_path, 2, signal.SIGUSR1, target_rank=1)
    assert 2 <= step < 10000
    assert f"stopping after step {step}: received SIGUSR1" in done.stdout
    interrupted, _ = _records(tmp_path / "m.jsonl")
    _check_resume_is_exact(tmp_path, interrupted, step, 2)


def test_sigterm_to_nproc_per_node_reaches_the_ranks_which_save_before_it_returns(tmp_path):
    """`llamatron train --nproc-per-node 2` killed with SIGTERM (a scheduler): the ranks stop after the same
    step and save; the command returns 3 only after they finished (it returned at once, leaving them running)."""
    done, step = _interrupt(tmp_path, 2, signal.SIGTERM, target_rank=None, via_cli=True)
    assert 2 <= step < 10000 and f"stopping after step {step}: received SIGTERM" in done.stdout
    assert "Traceback" not in done.stderr and "failed" not in done.stderr, done.stderr[-3000:]
    here = str(tmp_path)
    left = [d.name for d in Path("/proc").iterdir() if d.name.isdigit() and _cwd(d) == here]
    assert not left, f"processes of the job still running: {left}"


def test_ctrl_c_stops_after_the_step_saves_and_exits_3(tmp_path):
    """A Ctrl-C (SIGINT) is a stop request like a scheduler's: no KeyboardInterrupt traceback, a checkpoint."""
    done, step = _interrupt(tmp_path, 1, signal.SIGINT, None)
    assert f"stopping after step {step}: received SIGINT (Ctrl-C); saved ck/step-{step}" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_sigint_to_the_nproc_per_node_command_reaches_the_ranks(tmp_path):
    """SIGINT to `llamatron train --nproc-per-node 2` alone (an IDE's stop button, a supervisor): it was ignored,
    and the ranks trained on; now they stop after the same step, save, and the command exits 3."""
    done, step = _interrupt(tmp_path, 2, signal.SIGINT, target_rank=None, via_cli=True)
    assert 2 <= step < 10000 and f"stopping after step {step}: received SIGINT (Ctrl-C)" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_sigkill_of_the_nproc_per_node_command_stops_the_ranks_with_a_save(tmp_path):
    """SIGKILL to `llamatron train --nproc-per-node 2` (a scheduler's hard kill, the OOM killer) gives it no chance
    to pass a stop on: its launcher and ranks trained on, orphaned. Now each gets SIGTERM from the kernel when its
    parent dies (parent_watch.py): the ranks stop after the step, save, and every process of the job ends."""
    metrics = tmp_path / "m.jsonl"
    args = ["--train-steps", "10000", "--save", "ck", *CONSTANT_LR]
    proc = subprocess.Popen(
        _command(args, 2, via_cli=True), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 240
        while (metrics.read_text().count("\n") if metrics.exists() else 0) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 120
        while _job_processes(tmp_path):
            assert time.monotonic() < deadline, "the launcher or the ranks outlived the killed command"
            time.sleep(0.2)
    finally:
        for pid in _job_processes(tmp_path):
            os.kill(pid, signal.SIGKILL)
    steps, _ = _records(metrics)
    assert (tmp_path / "ck" / "latest").read_text().strip() == f"step-{steps[-1]['step']}"
    assert steps[-1]["step"] < 10000


def _job_processes(workdir: Path) -> list[int]:
    """Pids of the processes running in `workdir` (the job's launcher and ranks)."""
    where = str(workdir)
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _cwd(d) == where]


def _cwd(proc_dir: Path) -> str | None:
    try:
        return os.readlink(proc_dir / "cwd")
    except OSError:
        return None


def test_exit_duration_saves_and_exits_3(tmp_path):
    # 0.001 minutes have passed before the first step ends: the run stops after it, agreed by both ranks.
    args = ["--train-steps", "50", "--save", "ck", "--exit-duration-mins", "0.001"]
    proc = subprocess.run(
        _command(args, 2, via_cli=True), capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path
    )
    steps, _ = _records(tmp_path / "m.jsonl")
    assert proc.returncode == STOPPED_EARLY_EXIT and not proc.stderr.strip(), proc.stderr[-3000:]
    last = steps[-1]["step"]  # 1, or 2 when the first step ended within 0.06 s of the rank's start
    assert f"stopping after step {last}: --exit-duration-mins 0.001 reached" in proc.stdout
    assert [r["step"] for r in steps] == list(range(1, last + 1)) and last < 50
    assert (tmp_path / "ck" / "latest").read_text().strip() == f"step-{last}"


# --- a hung rank ------------------------------------------------------------------------------------------------


def test_hung_rank_fails_within_dist_timeout_naming_it(tmp_path):
    start = time.monotonic()
    proc, steps, _ = train(
        tmp_path, ["--train-steps", "5", "--dist-timeout", "4"], nproc=2, check=False, faults=["--hang", "1:2:300"]
    )  # rank 1 sleeps 300 s before step 2
    assert proc.returncode != 0
    assert time.monotonic() - start < 150, "the run waited for the hung rank instead of timing out"
    assert "rank 0: a collective operation did not complete within --dist-timeout (4 s)" in proc.stderr
    assert "4000ms" in proc.stderr  # the collective itself gave up after --dist-timeout
    assert "rank(s) 1 did not report this failure: they are hung, crashed or killed" in proc.stderr
    assert [r["step"] for r in steps] == [1]


# --- TensorBoard and W&B ----------------------------------------------------------------------------------------


def _installed(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def test_tensorboard_event_file_has_the_metric_records(tmp_path):
    args = ["--train-steps", "3", "--tensorboard-dir", "tb", "--eval-metrics", "accuracy"]
    if not _installed("tensorboard"):  # the optional package is missing: a clear error instead
        proc, _, _ = train(tmp_path, args, check=False)
        assert proc.returncode == 2 and "pip install tensorboard" in proc.stderr
        return
    _, steps, valid = train(tmp_path, args)
    assert list(valid[-1]) == ["step", "split", "loss", "accuracy", "consumed_samples"]  # --eval-metrics chose
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    assert [e.value for e in events.Scalars("valid/accuracy")] == pytest.approx([valid[-1]["accuracy"]])
    assert "valid/perplexity" not in events.Tags()["scalars"]
    assert "train/mfu" not in events.Tags()["scalars"]  # null on CPU: left out, not logged as 0


def test_wandb_offline_run_is_written_without_network(tmp_path):
    args = ["--train-steps", "2", "--wandb-project", "llamatron-test", "--wandb-mode", "offline"]
    if not _installed("wandb"):
        proc, _, _ = train(tmp_path, args, check=False)
        assert proc.returncode == 2 and "--wandb-project needs the 'wandb' package" in proc.stderr
        assert "pip install wandb" in proc.stderr
        return
    # No network: an unroutable proxy makes any attempt to reach the service fail.
    _, steps, valid = train(
        tmp_path, args, WANDB_DIR=str(tmp_path), HTTPS_PROXY="http://127.0.0.1:9", WANDB_SILENT="true"
    )
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    data = Path(runs[0]).read_bytes()
    assert b"train/loss" in data and b"valid/perplexity" in data
    for record in steps + valid:  # each value is stored as its JSON text
        assert json.dumps(record["loss"]).encode() in data


@pytest.mark.skipif(not _installed("wandb"), reason="the missing-package path is tested above")
def test_wandb_mode_comes_from_the_environment_and_a_failed_login_stops_before_training(tmp_path):
    """Without --wandb-mode, W&B's own WANDB_MODE applies; an online run that cannot log in is a configuration
    error before the model is built (it was a traceback after it)."""
    no_network = {
        "WANDB_DIR": str(tmp_path),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "WANDB_SILENT": "true",
        "HOME": str(tmp_path),
        "WANDB_API_KEY": "",
        "NETRC": str(tmp_path / "no-netrc"),
    }
    train(tmp_path, ["--train-steps", "1", "--wandb-project", "env-mode"], WANDB_MODE="offline", **no_network)
    assert len(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))) == 1
    proc, steps, _ = train(
        tmp_path,
        ["--train-steps", "1", "--wandb-project", "no-login", "--wandb-mode", "online"],
        check=False,
        **no_network,
    )
    assert proc.returncode == 2 and not steps, proc.stderr[-3000:]
    assert "--wandb-project no-login: W&B could not start a run" in proc.stderr and "wandb login" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_logging_packages_fail_before_training_naming_the_package(monkeypatch):
    from llamatron.config.settings import ConfigError, config_from_values
    from llamatron.training.validate import validate

    for module, flag, value, package in (
        ("wandb", "wandb_project", "p", "wandb"),
        ("torch.utils.tensorboard", "tensorboard_dir", "tb", "tensorboard"),
    ):
        monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
        cfg = config_from_values({"model": "llama-test", "mock_data": True, flag: value})
        with pytest.raises(ConfigError, match=rf"needs the '{package}' package.*pip install {package}"):
            validate(cfg)


def test_skipped_step_count_continues_after_resume(tmp_path):
    """skipped_steps counts the whole run: a resumed run starts from the checkpoint's count, also for skips not
    yet logged when the checkpoint was written (log interval 2, save after step 3)."""
    train(tmp_path, ["--train-steps", "3", "--save", "ck", "--log-interval", "2"], faults=["--nan-steps", "2,3"])
    _, steps, _ = train(tmp_path, ["--train-steps", "5", "--load", "ck"])
    assert [r["step"] for r in steps] == [4, 5]
    assert [r["skipped_steps"] for r in steps] == [2, 2]
