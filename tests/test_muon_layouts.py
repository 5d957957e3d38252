"""--optimizer muon under the layouts against the single process (issue 53, item 3): tensor parallelism with sequence
parallelism (each matrix orthogonalised whole, gathered over tp), the distributed optimizer and FSDP (each rank's
segment of the momentum, the update made whole over the shard group before Newton-Schulz), a pipeline, expert
parallelism (each rank's experts, one at a time).

Each run compares every logged field of every step and evaluation with the single process's (layout.assert_matches:
fp32, gloo, relative 1e-4) and the final weights to 1e-3 of each tensor's norm. The model has every kind of
parameter: embedding, head, norms, q/k/v biases, routers, experts, a shared expert and its 1-row gate. Newton-Schulz
runs in fp32 here (--muon-ns-dtype fp32): in bf16 the summation order's last-bit differences between layouts are
rounded into visible ones."""

from __future__ import annotations

import pytest
from layout import BASE_ARGS, assert_matches, assert_same_weights, run_train, single_runs

from llamatron.checkpoint.reader import CheckpointReader

MODEL = "qwen2-moe-test"
MUON = ["--optimizer", "muon", "--muon-ns-dtype", "fp32", "--muon-adamw-lr", "5e-4"]
LAYOUTS = {  # name -> (flags, processes)
    "tp2-sp": (["--tp", "2", "--sequence-parallel"], 2),
    "dp2-distopt": (["--distributed-optimizer"], 2),
    "dp2-fsdp": (["--fsdp"], 2),
    "pp2": (["--pp", "2"], 2),
    "ep2": (["--ep", "2"], 2),
    "hsdp-2x2": (["--fsdp", "--fsdp-shard-group", "2"], 4),
}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return single_runs(tmp_path_factory, lambda _key, _path: list(MUON), lambda _key: MODEL)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layouts_match_the_single_process(name, single, tmp_path):
    flags, nproc = LAYOUTS[name]
    reference, weights = single("")
    got = run_train([*MUON, *flags, "--save", "ck"], nproc, tmp_path, model=MODEL)
    assert_matches(reference, got)  # every logged field of every step and evaluation
    assert_same_weights(weights, tmp_path / "ck" / "step-5")


def test_muon_checkpoint_at_tp2_dp2_resumes_exactly_in_one_process_and_at_fsdp4(tmp_path, capsys):
    """Saved at tp 2 x dp 2 with the distributed optimizer after step 3, resumed on one process and at --fsdp over
    4 ranks (each rank's momentum shard a flat range across rows of the matrices): steps 4 and 5 equal
    the uninterrupted run's (the momentum came across: without it, step 5 differs). The checkpoint keeps Muon's
    momentum for the hidden matrices and AdamW's moments for the rest, by the kinds the optimizer declares."""
    steps = ["--save", "ck", "--save-interval", "3"]
    first = run_train([*MUON, "--tp", "2", "--distributed-optimizer", *steps], 4, tmp_path, model=MODEL)
    resumed = run_train([*MUON, "--load", "ck/step-3"], 1, tmp_path, model=MODEL)
    assert_matches(first[3:], resumed)
    fsdp4 = run_train([*MUON, "--fsdp", "--micro-batch-size", "1", "--load", "ck/step-3"], 4, tmp_path, model=MODEL)
    assert_matches(first[3:], fsdp4)
    reader = CheckpointReader(tmp_path / "ck" / "step-3")
    assert "layers.0.mlp.experts.gate_up" in reader.names("momentum_buffer")
    assert {"embed.weight", "layers.0.mlp.router.weight"} <= reader.names("exp_avg")
    assert not reader.names("momentum_buffer") & reader.names("exp_avg")

    from llamatron.cli import main  # resuming with another optimizer is refused in one line

    with pytest.raises(SystemExit) as failed:
        main(["train", "--model", MODEL, *BASE_ARGS, "--load", str(tmp_path / "ck" / "step-3")])
    err = capsys.readouterr().err
    assert failed.value.code == 2 and "trained with --optimizer muon, this run uses --optimizer adamw" in err, err
    assert "Traceback" not in err
