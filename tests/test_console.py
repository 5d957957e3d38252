"""A run is not its console (issue 39): when the reader of its output goes away, training goes on, saves and writes
its metrics file, and the exit status says how the run ended."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from layout import BASE_ARGS

from llamatron.cli import Console

REPO = str(Path(__file__).resolve().parents[1])


def test_a_run_whose_reader_goes_away_trains_to_the_end_and_saves(tmp_path):
    """`llamatron train ... | head -2`: the reader closes after two lines; the run still takes every step."""
    steps = 12
    cmd = [sys.executable, "-m", "llamatron", "train", "--model", "llama-test", *BASE_ARGS]
    cmd += ["--train-steps", str(steps), "--save", "ck", "--metrics-file", "m.jsonl", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    first = [proc.stdout.readline() for _ in range(2)]
    proc.stdout.close()  # the reader goes away
    assert proc.wait(timeout=300) == 0
    assert all(line for line in first)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("split") is None] == list(range(1, steps + 1))
    assert (tmp_path / "ck" / "latest").read_text().strip() == f"step-{steps}"


def test_a_console_whose_pipe_closed_swallows_writes_and_says_so():
    read, write = os.pipe()
    stream = os.fdopen(write, "w")
    console = Console(stream)
    os.close(read)
    console.write("x" * 10)
    console.flush()  # EPIPE here: the descriptor now points at /dev/null
    assert console.lost
    console.write("more\n")
    console.flush()
    stream.close()


def test_other_write_errors_are_not_hidden():
    class Full:
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        Console(Full()).write("x")  # type: ignore[arg-type]
