"""`llamatron plan` as a user runs it (issue 23, item 11): defaults for the GPU memory and sequence length, the
top layout as `train` flags that `train` accepts, and output piped into `head`."""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from plan_layouts import planned

from llamatron.cli import main
from llamatron.config.settings import add_config_arguments, load_config
from llamatron.training.validate import validate

REPO = str(Path(__file__).resolve().parents[1])


def test_plan_defaults_to_80gb_and_the_models_context_and_prints_train_flags(capsys):
    assert main_code(["plan", "--model", "llama2-7b", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "llama2-7b on 8 x 80 GB, seq 4096" in out
    flags = out.split("#1 as `llamatron train` flags: ")[1].splitlines()[0]
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
        "--no-simulate",  # a long JSON quickly (simulating 1000 layouts takes a minute)
    ]
    done = subprocess.run(f"{shlex.join(plan)} | head -c 10", shell=True, capture_output=True, text=True, env=env)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def main_code(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_plan_evaluates_the_layout_of_a_train_config_or_of_flags(tmp_path, capsys):
    """`plan --config X.yaml` reads the run's model, shape and layout and evaluates that layout (issue 21, item 3);
    flags change it; the speed is the step simulator's for that layout (on the default H100 profile), beside the
    ranking model's."""
    from llamatron.config.settings import config_from_values
    from llamatron.planning.plan import estimate_speed
    from llamatron.planning.simulator.evaluate import simulate_layout
    from llamatron.planning.simulator.hardware import resolve_hardware

    config = tmp_path / "run.yaml"
    config.write_text(
        "model: llama-1b\nmodel_overrides: {num_layers: 8, hidden_size: 1536, num_heads: 24}\n"
        "seq_length: 2048\ntp: 2\nmicro_batch_size: 2\nglobal_batch_size: 64\nrecompute: full\nsave: runs/x\n"
    )
    assert main_code(["plan", "--config", str(config), "--gpus", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["tp"], got["pp"], got["dp"], got["micro_batch_size"], got["recompute"]) == (2, 1, 4, 2, "full")
    model = config_from_values(yaml_values(config)).model_config()
    assert model.hidden_size == 1536  # the overrides' shape, not the preset's
    layout = planned(2, 1, 1, 4, True, True, "full", 2, 64)
    expected = simulate_layout(model, layout, 2048, resolve_hardware("h100-sxm")).result
    assert got["tokens_per_sec_per_gpu"] == expected.tokens_per_sec_per_gpu
    assert got["tflops_per_gpu"] == pytest.approx(expected.mfu * 989.4) and got["fits"] is True
    ranking = estimate_speed(model, layout, 2048, 8, 8)
    assert got["ranking_model_tokens_per_sec_per_gpu"] == ranking.tokens_per_sec_per_gpu
    assert got["train_flags"].startswith("--tp 2 --pp 1")
    assert main_code(["plan", "--config", str(config), "--gpus", "8", "--json", "--pp", "2", "--tp", "1"]) == 0
    flagged = json.loads(capsys.readouterr().out)
    assert (flagged["tp"], flagged["pp"], flagged["dp"]) == (1, 2, 4)
    assert main_code(["plan", "--config", str(config), "--gpus", "8", "--search", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["layouts"]) > 1  # the shape searched, not the layout


def test_a_fixed_layout_that_cannot_run_or_fit_says_so(capsys):
    assert main_code(["plan", "--model", "llama2-7b", "--gpus", "8", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "not divisible by tp" in err and "give --gpus a multiple of 3" in err and "launch" not in err, err
    assert main_code(["plan", "--model", "llama2-70b", "--gpus", "8", "--tp", "8", "--micro-batch-size", "1"]) == 1
    assert "does NOT fit in 80 GB" in capsys.readouterr().out
    assert main_code(["plan", "--gpus", "8"]) == 2
    assert "plan needs a model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, message",
    [
        ("{moe_capacity_factor: 0}", "moe_capacity_factor 0 must be > 0"),
        ("{experts_per_token: 200}", "experts_per_token 200 must be in 1..num_experts"),
        ("{num_layerz: 2}", "unknown model field 'num_layerz'"),
    ],
)
def test_a_bad_model_override_is_a_configuration_error_not_a_misfit(tmp_path, capsys, overrides, message):
    config = tmp_path / "p.yaml"
    config.write_text(f"model: qwen3-30b-a3b\nmodel_overrides: {overrides}\n")
    assert main_code(["plan", "--config", str(config), "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert message in err and "does not fit" not in err and len(err.strip().splitlines()) == 1, err


def yaml_values(path):
    import yaml

    return {k: v for k, v in yaml.safe_load(path.read_text()).items() if k in ("model", "model_overrides")}


def test_each_speed_says_which_model_gave_it(capsys):
    """A search ranks by the step simulator (--simulate, still accepted, is the default), by the closed-form model
    with --no-simulate; one layout is simulated: the two numbers for one layout differ, so each table says which
    it shows (issue 39)."""
    search = ["plan", "--model", "llama-1b", "--gpus", "2", "--top", "1"]
    for flags in ([], ["--simulate"]):
        assert main_code([*search, *flags]) == 0
        out = capsys.readouterr().out
        assert "tok/s/gpu and mfu: the step simulator's" in out and "fastest by the step simulator" in out
    assert main_code([*search, "--no-simulate"]) == 0
    ranked = capsys.readouterr().out
    assert "tok/s/gpu and mfu: the closed-form ranking model's" in ranked and "the step simulator's" not in ranked
    one = ["plan", "--model", "llama-1b", "--gpus", "2", "--tp", "1", "--micro-batch-size", "2"]
    assert main_code([*one, "--json"]) == 0
    ranking = json.loads(capsys.readouterr().out)["ranking_model_tokens_per_sec_per_gpu"]
    assert main_code(one) == 0
    assert f"the step simulator's (llamatron/planning/simulator); the ranking model's estimate: {ranking:,.0f}" in (
        capsys.readouterr().out
    )


def test_the_distributed_optimizer_is_not_recommended_without_replicas(capsys):
    """With one dp x cp replica the distributed optimizer has nothing to shard over: plan says so and leaves it out
    of the train flags; with two it stays."""
    one = ["plan", "--model", "llama-1b", "--tp", "1", "--distributed-optimizer", "--micro-batch-size", "2", "--json"]
    assert main_code([*one, "--gpus", "1"]) == 0
    assert "--distributed-optimizer" not in json.loads(capsys.readouterr().out)["train_flags"]
    assert main_code([*one[:-1], "--gpus", "1"]) == 0
    assert "with one it saves nothing" in capsys.readouterr().out
    assert main_code([*one, "--gpus", "2"]) == 0
    assert "--distributed-optimizer" in json.loads(capsys.readouterr().out)["train_flags"]


def test_a_fixed_layout_with_whole_experts_is_simulated_and_trained_as_such(capsys):
    """--etp 1 on Mixtral 8x22B at tp 2 x ep 4 (one node's 8 ranks an all-to-all): the experts whole, one a rank,
    fewer all-to-all bytes than with each expert split over tp (each tp rank sends its own shard: 7/16 of the
    split layout's 3/4 of the micro-batch's copies), a faster simulated step, and --etp 1 in the train flags."""
    base = ["plan", "--model", "mixtral-8x22b", "--gpus", "128", "--tp", "2", "--pp", "8", "--vpp", "7", "--ep", "4"]
    base += ["--micro-batch-size", "1", "--global-batch-size", "256", "--seq-length", "4096", "--json"]
    runs = {}
    for etp in ("2", "1"):
        assert main_code([*base, "--etp", etp]) in (0, 1)  # 1: does not fit in 80 GB, still simulated
        runs[etp] = json.loads(capsys.readouterr().out)
    split, whole = runs["2"], runs["1"]
    assert (split["simulation"]["moe"]["experts_per_rank"], whole["simulation"]["moe"]["experts_per_rank"]) == (2, 1)
    gb = "all_to_all_gb_per_rank_and_step"
    assert whole["simulation"]["moe"][gb] == pytest.approx(split["simulation"]["moe"][gb] * (7 / 16) / (3 / 4))
    assert whole["tokens_per_sec_per_gpu"] > split["tokens_per_sec_per_gpu"]
    assert "--etp 1" in whole["train_flags"] and "--etp" not in split["train_flags"]
