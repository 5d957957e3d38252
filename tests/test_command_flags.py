"""The other commands' own numeric flags (train's are config.py's): out-of-range and non-finite values are one
line and exit 2 before anything is read or built."""

import pytest

from llamatron.cli import main

PLAN = ["plan", "--model", "llama-1b", "--gpus", "8", "--gpu-memory", "80GB", "--seq-length", "4096"]
VERIFY = ["verify", "--load", "nowhere", "--hf", "nowhere"]
GENERATE = ["generate", "--load", "nowhere", "--prompt", "x"]


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
