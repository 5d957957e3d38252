"""`llamatron plan` weighs pipelines whose stages do not divide the layers (Llama 3.1 405B's 126, Qwen3-235B's 94):
the most even --pp-layers split, carried by the Layout into the memory model, the simulator and the train flags."""

from __future__ import annotations

import pytest
from plan_layouts import planned

from llamatron.planning import candidates as C
from llamatron.planning.plan import Layout, Precision, layout_memory
from llamatron.planning.simulator.evaluate import simulate_layout
from llamatron.planning.simulator.hardware import resolve_hardware


def _ends_inward_split(num_layers: int, chunks: int) -> list[int]:
    """Written out: base layers each, one more for each chunk but the lightest C - extra, which are the last, the
    first, the second last, the second, ..."""
    base, extra = divmod(num_layers, chunks)
    order = []
    for i in range((chunks + 1) // 2):
        order += [chunks - 1 - i, i] if chunks - 1 - i != i else [i]
    lighter = order[: chunks - extra]
    return [base if c in lighter else base + 1 for c in range(chunks)]


@pytest.mark.parametrize(("num_layers", "chunks"), [(126, 16), (126, 32), (94, 8), (7, 2), (7, 4), (10, 4), (5, 3)])
def test_the_split_is_the_most_even_with_the_lighter_chunks_at_the_ends(num_layers, chunks):
    counts = [int(c) for c in C.balanced_split(num_layers, chunks).split(",")]
    assert sum(counts) == num_layers and len(counts) == chunks and max(counts) - min(counts) <= 1
    assert counts == _ends_inward_split(num_layers, chunks)


def test_llama3_405b_over_16_stages_takes_one_layer_fewer_at_each_end():
    assert C.balanced_split(126, 16) == ",".join(["7"] + ["8"] * 14 + ["7"])


def test_the_search_weighs_uneven_pipelines_the_trainer_accepts():
    """llama-1b cut to 7 layers on 8 GPUs one a node: pp 2 and pp 4 need uneven splits (pp 8 > 7 layers cannot);
    every such layout is one the trainer validates (candidate_layouts asks training.validate) and its train
    flags carry the split."""
    shape = {"num_layers": 7}
    splits = {(lay.pp, lay.vpp, lay.pp_layers) for lay in C.candidate_layouts("llama-1b", 8, 2048, 1, 16, shape)}
    assert (2, 1, "4,3") in splits and (4, 1, "2,2,2,1") in splits
    assert {pp for pp, _, _ in splits} == {1, 2, 4}
    assert all(pp_layers is None for pp, _, pp_layers in splits if pp == 1)
    lay = next(lay for lay in C.candidate_layouts("llama-1b", 8, 2048, 1, 16, shape) if lay.pp == 4)
    assert f"--pp 4 --pp-layers {lay.pp_layers}" in lay.train_flags(2048)


def test_divisible_layer_counts_keep_even_splits_only():
    """80 layers: every pp dividing them gets the even split alone (the search as before); pp 32 does not divide
    80 and gets the most even split."""
    assert C.pipeline_splits(80, 4) == [(1, None), (2, None), (4, None), (5, None)]
    assert C.pipeline_splits(80, 32) == [(1, C.balanced_split(80, 32))]


def _layout(pp_layers: str | None, **kw) -> Layout:
    return planned(1, 2, 1, 1, False, False, "none", 1, 8, pp_layers=pp_layers, **kw)


def test_memory_and_the_simulated_step_follow_the_layouts_split():
    """The same pipeline with 6 of 8 layers on its first stage needs more memory there than the even 4,4, and with
    6 on its last (beside the head and the loss) steps slower: the split reaches the memory model and the
    simulator through the Layout."""
    model = C.planned_model("llama-1b", {"num_layers": 8})
    hw = resolve_hardware("h100-sxm")
    even, first_heavy, last_heavy = _layout(None), _layout("6,2"), _layout("2,6")
    assert layout_memory(model, first_heavy, 2048).total > 1.2 * layout_memory(model, even, 2048).total
    step = {lay: simulate_layout(model, lay, 2048, hw, Precision()).result.step_seconds for lay in (even, last_heavy)}
    assert step[last_heavy] > 1.2 * step[even]


def test_an_uneven_mixture_of_experts_pipeline_with_fsdp_is_simulated():
    """The per-rank MoE and --fsdp figures count the layers of the busiest stage of the given split (they asked
    for the even split before, which a 7-layer pipeline of 2 does not have)."""
    model = C.planned_model("mixtral-8x7b", {"num_layers": 7})
    lay = planned(1, 2, 1, 4, False, False, "full", 1, 64, ep=2, fsdp=True, pp_layers="4,3")
    record = simulate_layout(model, lay, 4096, resolve_hardware("h100-sxm")).to_dict()
    per_layer = simulate_layout(
        model, planned(1, 1, 1, 4, False, False, "full", 1, 64, ep=2, fsdp=True), 4096, resolve_hardware("h100-sxm")
    ).to_dict()
    assert record["moe"]["expert_weights_gb_per_rank"] == pytest.approx(
        4 / 7 * per_layer["moe"]["expert_weights_gb_per_rank"]
    )
