"""The other commands' own numeric flags (train's are config.py's): out-of-range and non-finite values are one
line and exit 2 before anything is read or built."""

import pytest

from llamatron.cli import main
from llamatron.errors import ConfigError

PLAN = ["plan", "--model", "llama-1b", "--gpus", "8", "--gpu-memory", "80GB", "--seq-length", "4096"]
VERIFY = ["verify", "--load", "nowhere", "--hf", "nowhere"]
GENERATE = ["generate", "--load", "nowhere", "--prompt", "x"]
EVAL = ["eval", "--load", "nowhere", "--tasks", "x"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        ([*PLAN, "--top", "0"], "--top"),
        ([*PLAN, "--top", "-1"], "--top"),
        ([*PLAN, "--global-batch-size", str(10**12)], "--global-batch-size"),
        ([*PLAN, "--gpus-per-node", "0"], "--gpus-per-node"),
        ([*VERIFY, "--tolerance", "nan"], "--tolerance"),
        ([*VERIFY, "--batches", "0"], "--batches"),
        ([*VERIFY, "--seq-length", "0"], "--seq-length"),
        ([*VERIFY, "--seed", "-1"], "--seed"),
        ([*GENERATE, "--temperature", "inf"], "--temperature"),
        ([*GENERATE, "--seed", str(2**40)], "--seed"),
        ([*EVAL, "--batch-size", "0"], "--batch-size"),
        ([*EVAL, "--limit", "0"], "--limit"),
        ([*EVAL, "--num-fewshot", "-1"], "--num-fewshot"),
        ([*EVAL, "--seq-length", "0"], "--seq-length"),
        (["preprocess", "--input", "x", "--output-prefix", "y", "--tokenizer", "t", "--workers", "0"], "--workers"),
    ],
)
def test_out_of_range_flags_are_one_line_and_exit_2(argv, flag, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2, err


def test_the_launcher_checks_the_checkpoints_model_not_the_default_preset(tmp_path, capsys):
    """`--tp 3 --nproc-per-node 3 --load CKPT`: the rules are checked against the checkpoint's 4 heads (issue 23,
    item 8: it used to name the default preset's 8)."""
    small = ["--mock-data", "--device", "cpu", "--seq-length", "32", "--micro-batch-size", "2", "--no-progress"]
    with pytest.raises(SystemExit) as saved:
        main(
            [
                "train",
                "--model",
                "llama-test",
                *small,
                "--global-batch-size",
                "2",
                "--train-steps",
                "1",
                "--save",
                str(tmp_path / "ck"),
            ]
        )
    assert saved.value.code in (0, None)
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(
            [
                "train",
                "--load",
                str(tmp_path / "ck"),
                "--finetune",
                "--tp",
                "3",
                "--nproc-per-node",
                "3",
                *small,
                "--global-batch-size",
                "6",
                "--save",
                str(tmp_path / "ft"),
            ]
        )
    assert done.value.code == 2
    assert "num_attention_heads=4 is not divisible by tp=3" in capsys.readouterr().err


def test_megatron_flag_names_set_the_same_settings():
    """Issue 23, item 14: Megatron-LM's spellings are aliases of the same settings (model-shape ones of
    model_overrides)."""
    import argparse

    from llamatron.config.settings import add_config_arguments, load_config

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    argv = ["--model", "llama-test", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    argv += ["--context-parallel-size", "2", "--train-iters", "7", "--lr-warmup-iters", "3"]
    argv += ["--use-distributed-optimizer", "--data-path", "corpus", "--bf16", "--num-layers", "4"]
    argv += ["--hidden-size", "96", "--num-attention-heads", "6", "--num-query-groups", "2", "--ffn-hidden-size", "64"]
    cfg = load_config(parser.parse_args(argv))
    p, t = cfg.parallel, cfg.train
    assert (p.tp, p.pp, p.cp, p.distributed_optimizer) == (2, 2, 2, True)
    assert (t.train_steps, cfg.optim.warmup_steps, cfg.data.data, t.precision) == (7, 3, "corpus", "bf16")
    model = cfg.model_config()
    assert (model.num_layers, model.hidden_size, model.num_heads, model.num_kv_heads, model.ffn_hidden_size) == (
        4,
        96,
        6,
        2,
        64,
    )


def test_a_blend_is_taken_unquoted_as_megatron_scripts_give_it():
    """Megatron-LM's `--data-path 0.5 a 0.5 b` (and llamatron's --data) take a blend's words unquoted: the same
    setting as the quoted text; one prefix stays one prefix."""
    import argparse

    from llamatron.config.settings import add_config_arguments, load_config

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    for argv in (
        ["--data-path", "0.5", "a", "0.5", "b"],
        ["--data", "0.5", "a", "0.5", "b"],
        ["--data", "0.5 a 0.5 b"],
    ):
        assert load_config(parser.parse_args(argv)).data.data == "0.5 a 0.5 b", argv
    assert load_config(parser.parse_args(["--data-path", "corpus", "--train-iters", "2"])).data.data == "corpus"


def test_megatron_expert_parallel_size_is_refused_where_it_counts_the_tp_ranks():
    """--expert-tensor-parallel-size 1 is --etp 1; beside it, Megatron-core's --expert-model-parallel-size counts the
    tp ranks folded into the expert groups, which --ep does not: refused naming the fix, not taken as --ep."""
    import argparse

    from llamatron.config.settings import add_config_arguments, load_config

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    argv = ["--model", "mixtral-test", "--tp", "2", "--expert-tensor-parallel-size", "1"]
    cfg = load_config(parser.parse_args([*argv, "--ep", "2"]))
    assert (cfg.parallel.etp, cfg.parallel.ep) == (1, 2)
    with pytest.raises(ConfigError, match=r"counts the tp ranks .* give --ep N / 2 instead"):
        load_config(parser.parse_args([*argv, "--expert-model-parallel-size", "4"]))
    same = load_config(parser.parse_args(["--model", "mixtral-test", "--tp", "2", "--expert-model-parallel-size", "2"]))
    assert (same.parallel.ep, same.parallel.etp) == (2, None)  # experts split over tp: the same meaning


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--train-iters", "3", "--train-steps", "5"], "--train-iters 3 and --train-steps 5 both set train_steps"),
        (["--tp", "2", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2 and --tp 2 both set tp"),
        (["--no-distributed-optimizer", "--use-distributed-optimizer"], "--use-distributed-optimizer and --no-"),
        (["--bf16", "--precision", "bf16"], "--bf16 and --precision bf16 both set precision"),
        (["--bf16", "--fp16"], "--bf16 and --fp16 both set precision: give one of them"),
    ],
)
def test_a_megatron_alias_beside_its_own_flag_is_refused_naming_both(argv, message):
    """--train-iters 3 --train-steps 5 used to run 5 steps: whichever came last won, silently."""
    import argparse

    from llamatron.config.settings import add_config_arguments, load_config

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    with pytest.raises(ConfigError, match=message):
        load_config(parser.parse_args(["--model", "llama-test", *argv]))


@pytest.mark.parametrize(
    "flag, instead",
    [
        ("--lr-decay-iters", "decays the learning rate over --train-steps"),
        ("--recompute-granularity", "--recompute full|selective"),
        ("--lr-decay-style", "--lr-schedule constant|linear|cosine"),
        ("--tokenizer-type", "give --tokenizer PATH"),
    ],
)
def test_megatron_flags_not_aliased_say_what_to_give_instead(flag, instead, capsys):
    """Not a near spelling of another flag: --lr-decay-iters was answered 'did you mean --lr-warmup-iters?'."""
    with pytest.raises(SystemExit) as done:
        main(["train", flag, "3"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "did you mean" not in err, err
    assert f"\n{flag} is Megatron-LM's, not aliased (docs/megatron.md): " in err and instead in err, err


def test_no_progress_bar_when_the_output_is_not_a_terminal(tmp_path):
    """Issue 23, item 13: without --no-progress but into a pipe, plain lines per logged step and no bar."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    argv = [sys.executable, "-m", "llamatron", "train", "--model", "llama-test", "--mock-data", "--device", "cpu"]
    argv += ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-steps", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 1: loss" in done.stdout and "step 2: loss" in done.stdout
    assert "\r" not in done.stdout + done.stderr and "step/s" not in done.stderr  # no tqdm bar


def _commands() -> dict:
    import argparse

    from llamatron.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"llamatron": parser, **sub.choices}


def test_every_flag_of_every_command_has_a_description():
    """What --help lists (flags and positional arguments) each says what it is; hidden aliases are not listed."""
    import argparse

    undescribed = [
        f"{name} {action.option_strings[0] if action.option_strings else action.metavar or action.dest}"
        for name, parser in _commands().items()
        for action in parser._actions
        if action.help != argparse.SUPPRESS and not (action.help or "").strip()
    ]
    assert undescribed == []


def test_verify_help_shows_its_tolerances_readably():
    text = _commands()["verify"].format_help()
    assert "{'" not in text  # no dict repr
    assert "0.0001 for fp32, 0.1 for bf16" in " ".join(text.split())


def test_bench_help_lists_only_the_flags_bench_uses():
    import re

    commands = _commands()
    bench, train = commands["bench"].format_help(), commands["train"].format_help()
    ignored = ["--save", "--load", "--train-steps", "--eval-interval", "--metrics-file", "--wandb-project"]
    ignored += [
        "--log-interval",
        "--keep-last",
        "--max-skipped-steps",
        "--progress",
        "--objective",
        "--preference-data",
    ]
    for flag in ignored:
        assert re.search(rf"{flag}\b(?!-)", train), flag
        assert not re.search(rf"{flag}\b(?!-)", bench), flag
    for flag in ["--tp", "--seq-length", "--micro-batch-size", "--attention-backend", "--data", "--dist-timeout"]:
        assert re.search(rf"{flag}\b(?!-)", bench), flag
