"""Mixture of experts under every layout against the single-process run (issue 20): expert parallelism alone and
with tensor parallelism (each expert split over tp, or whole under --etp 1), pipelines, the distributed optimizer,
FSDP, recompute and resumes across layouts.

Each run compares every logged field (loss, gradient norm, the load-balancing and z-losses, the dropped share and
every expert's share of the token choices, and the evaluations) with the single process (fp32, gloo, relative
1e-4). The router losses are per sequence, so the micro-batch size does not change them either."""

from __future__ import annotations

import pytest
from layout import assert_matches, run_train

from llamatron.checkpoint.reader import load_full_tensors

Z_LOSS = ["--config", "z.yaml"]  # turns the z-loss on, so its gradient is checked too


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    (path / "z.yaml").write_text("model_overrides:\n  router_z_loss_coef: 0.001\n")
    return path


@pytest.fixture(scope="module")
def reference(workdir):
    return run_train(Z_LOSS, 1, workdir, model="mixtral-test")


@pytest.fixture(scope="module")
def reference4(workdir):
    return run_train(Z_LOSS, 1, workdir, model="mixtral-test4")


@pytest.fixture(scope="module")
def saved_whole(workdir):
    """The single process's checkpoint after step 2 of 5 (workdir / "ep1")."""
    run_train(Z_LOSS + ["--train-steps", "2", "--save", "ep1"], 1, workdir, model="mixtral-test")
    return load_full_tensors(workdir / "ep1" / "step-2")


def _assert_same_routing(reference: list[dict], got: list[dict]) -> None:
    assert_matches(reference, got)
    for ref, rec in zip(reference, got):
        assert rec["expert_token_share"] == pytest.approx(ref["expert_token_share"], abs=1e-6), rec["step"]


@pytest.mark.parametrize(
    "nproc, extra",
    [
        (2, ["--ep", "2"]),
        (4, ["--ep", "4", "--micro-batch-size", "1"]),
        (4, ["--ep", "2", "--tp", "2", "--sequence-parallel"]),
        (4, ["--ep", "2", "--tp", "2", "--distributed-optimizer"]),
        (2, ["--ep", "2", "--distributed-optimizer", "--recompute", "full", "--bucket-size", "20000"]),
        (2, ["--tp", "2"]),  # experts split along ffn only
        # expert tensor parallelism 1: whole experts over ep x tp = 4 ranks, each tp rank routing its sequence shard
        (4, ["--ep", "2", "--tp", "2", "--sequence-parallel", "--etp", "1", "--distributed-optimizer"]),
        (4, ["--tp", "2", "--sequence-parallel", "--etp", "1", "--fsdp"]),  # 2 experts a rank, sharded over dp 2
        (1, ["--micro-batch-size", "1", "--recompute", "full"]),  # per-sequence router losses; no double counting
    ],
)
def test_moe_layout_matches_single_process(workdir, reference, nproc, extra):
    _assert_same_routing(reference, run_train(Z_LOSS + extra, nproc, workdir, model="mixtral-test"))


def test_expert_parallel_with_a_pipeline_matches_single_process(workdir, reference4):
    got = run_train(Z_LOSS + ["--ep", "2", "--pp", "2", "--distributed-optimizer"], 4, workdir, model="mixtral-test4")
    _assert_same_routing(reference4, got)


def test_resume_across_expert_layouts(workdir, reference, saved_whole):
    """Saved at ep 2 (distributed optimizer), resumed in one process; saved in one process, resumed at ep 2 x tp 2:
    the resumed steps are the uninterrupted run's. (Saved after step 2 of 2: the cosine schedule's first two steps
    are those of a 5-step run.)"""
    run_train(
        Z_LOSS + ["--ep", "2", "--distributed-optimizer", "--train-steps", "2", "--save", "ep2"],
        2,
        workdir,
        model="mixtral-test",
    )
    resumed = run_train(Z_LOSS + ["--load", "ep2"], 1, workdir, model="mixtral-test")
    _assert_same_routing(reference[2:], resumed)
    # the ep 2 checkpoint's full tensors (the experts written in boxes by two ranks) are the single process's
    sharded, whole = load_full_tensors(workdir / "ep2" / "step-2"), saved_whole
    assert sharded.keys() == whole.keys() and "layers.0.mlp.experts.gate_up" in whole
    for name, tensor in whole.items():
        assert (sharded[name] - tensor).abs().max() <= 1e-5, name
    resumed = run_train(Z_LOSS + ["--load", "ep1", "--ep", "2", "--tp", "2"], 4, workdir, model="mixtral-test")
    _assert_same_routing(reference[2:], resumed)


def test_resume_across_expert_tensor_parallel_sizes(workdir, reference, saved_whole):
    """Saved at tp 2 with whole experts (--etp 1: each tp rank writes its own two), resumed at tp 2 with the experts
    split over tp (the default --etp) and in one process: the uninterrupted run's steps, and the checkpoint's full
    tensors are the single process's."""
    etp1 = ["--tp", "2", "--sequence-parallel", "--etp", "1"]
    run_train(Z_LOSS + [*etp1, "--train-steps", "2", "--save", "etp1"], 2, workdir, model="mixtral-test")
    sharded, whole = load_full_tensors(workdir / "etp1" / "step-2"), saved_whole
    assert sharded.keys() == whole.keys() and "layers.0.mlp.experts.down" in whole
    for name, tensor in whole.items():
        assert (sharded[name] - tensor).abs().max() <= 1e-5, name
    resumed = run_train(
        Z_LOSS + ["--load", "etp1", "--tp", "2", "--sequence-parallel"], 2, workdir, model="mixtral-test"
    )
    _assert_same_routing(reference[2:], resumed)
    _assert_same_routing(reference[2:], run_train(Z_LOSS + ["--load", "etp1"], 1, workdir, model="mixtral-test"))
