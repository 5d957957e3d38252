"""`llamatron plan` as a user runs it (issue 23, item 11): defaults for the GPU memory and sequence length, the
top layout as `train` flags that `train` accepts, and output piped into `head`."""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from llamatron.cli import main
from llamatron.config import add_config_arguments, load_config, validate

REPO = str(Path(__file__).resolve().parents[1])


def test_plan_defaults_to_80gb_and_the_models_context_and_prints_train_flags(capsys):
    assert main_code(["plan", "--model", "llama2-7b", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "llama2-7b on 8 x 80 GB, seq 4096" in out
    flags = out.split("#1 as `llamatron train` flags: ")[1].strip()
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg = load_config(parser.parse_args(["--model", "llama2-7b", *shlex.split(flags)]))
    validate(cfg, world_size=8)  # the layout the planner prints is one train accepts on those GPUs
    assert cfg.data.seq_length == 4096 and cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp <= 8


def test_plan_json_lists_train_flags_for_every_layout(capsys):
    assert main_code(["plan", "--model", "llama2-7b", "--gpus", "8", "--json", "--top", "3"]) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert len(layouts) == 3 and all(lay["train_flags"].startswith("--tp ") for lay in layouts)


def test_plan_into_a_closed_pipe_ends_quietly():
    env = {**os.environ, "PYTHONPATH": REPO}
    plan = [
        sys.executable,
        "-m",
        "llamatron",
        "plan",
        "--model",
        "llama2-70b",
        "--gpus",
        "64",
        "--json",
        "--top",
        "1000",
    ]
    done = subprocess.run(f"{shlex.join(plan)} | head -c 10", shell=True, capture_output=True, text=True, env=env)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def main_code(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0
