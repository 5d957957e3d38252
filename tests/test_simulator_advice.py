"""`plan --explain`'s "what would reduce it" (llamatron/planning/simulator/advice.py): each suggestion is the named
change simulated on the same hardware, and a part that costs little gets none."""

from dataclasses import replace

from llamatron.planning.plan import Layout
from llamatron.planning.simulator.advice import suggestions
from llamatron.planning.simulator.evaluate import simulate_layout
from llamatron.planning.simulator.hardware import resolve_hardware
from llamatron.planning.simulator.runs import run_model

MODEL = run_model({"model": "llama2-7b"})
HW = resolve_hardware("h100-sxm", "8x400Gb-ndr")


def _layout(**kw) -> Layout:
    base = dict(tp=1, pp=4, vpp=1, dp=2, sequence_parallel=False, distributed_optimizer=True, recompute="none")
    base.update(micro_batch_size=1, global_batch_size=8)
    base.update(kw)
    return Layout(**base)


def test_a_pipeline_bubble_gets_interleaving_with_its_simulated_speed():
    lay = _layout()
    sim = simulate_layout(MODEL, lay, 4096, HW)
    assert sim.result.parts["bubble"] / sim.result.step_seconds > 0.1  # 4 micro-batches on 4 stages
    lines = suggestions(sim)
    vpp2 = simulate_layout(MODEL, replace(lay, vpp=2), 4096, HW).result.tokens_per_sec_per_gpu
    line = next(x for x in lines if "--vpp 2" in x)
    assert line.startswith("  bubble") and f"{vpp2:,.0f} tokens/s" in line
    assert vpp2 > sim.result.tokens_per_sec_per_gpu


def test_without_a_pipeline_there_is_no_bubble_advice():
    sim = simulate_layout(MODEL, _layout(pp=1, dp=8, global_batch_size=64), 4096, HW)
    assert not any(x.startswith("  bubble") for x in suggestions(sim))


def test_exposed_tensor_parallel_traffic_gets_the_overlap_and_a_smaller_tp():
    sim = simulate_layout(MODEL, _layout(tp=8, pp=1, dp=1, sequence_parallel=True, global_batch_size=8), 4096, HW)
    lines = [x for x in suggestions(sim) if x.startswith("  tp")]
    assert any("userbuffers" in x for x in lines) and any("--tp 4" in x for x in lines)


def test_a_change_the_batch_cannot_take_is_said_not_simulated():
    """One micro-batch per rank: halving the pipeline would leave dp 4 ranks half a micro-batch each."""
    sim = simulate_layout(MODEL, _layout(global_batch_size=2), 4096, HW)
    lines = suggestions(sim)
    line = next(x for x in lines if "--pp 2" in x)
    assert "not possible here" in line and "not a multiple" in line
    interleave = next(x for x in lines if "--vpp 2" in x)  # 2 micro-batches on 4 stages: the trainer refuses it
    assert "not possible here" in interleave and "multiple of pp=4" in interleave
