"""--load restores each rank's random states (Python's, NumPy's, torch's), so a run that draws random numbers in
its steps (dropout) continues after a resume exactly as if it had not stopped (issue 39: reading the states but
never setting them changed no test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from layout import BASE_ARGS

RANDOM_TRAINING = str(Path(__file__).resolve().parent / "random_training.py")
REPO = str(Path(__file__).resolve().parents[1])


def losses(workdir: Path, *args: str) -> list[float]:
    metrics = workdir / "m.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, RANDOM_TRAINING, "train", "--model", "llama-test", *BASE_ARGS, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    done = subprocess.run(
        [*cmd, "--lr-schedule", "constant", "--metrics-file", str(metrics)],
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r.get("split") is None]


def test_a_run_with_random_steps_resumes_exactly(tmp_path):
    whole = losses(tmp_path, "--train-steps", "6")
    first = losses(tmp_path, "--train-steps", "3", "--save", "ck")
    assert first == whole[:3]
    resumed = losses(tmp_path, "--train-steps", "6", "--load", "ck")
    assert resumed == whole[3:]
    # the steps are random: the same resume without the saved states (it warns and goes on) trains otherwise
    (tmp_path / "ck" / "step-3" / "rng" / "rank-00000.json").unlink()
    assert losses(tmp_path, "--train-steps", "6", "--load", "ck") != whole[3:]
