"""The planner and step simulator know a mixture of experts' capacity factor and global-batch load balancing (issue
34 item 6, models/moe_balance.py): a capacity caps the rows the experts see (their GEMMs, the permutation, the
all-to-all, the activations saved), global-batch balancing runs the step's micro-batches forward once more without
gradient. Each checked against the formula written out."""

import pytest
from plan_layouts import planned

from llamatron.models.inventory import layers
from llamatron.planning.activations import LayerKernels, layer_activation_terms
from llamatron.planning.simulator.calibration import load_calibration
from llamatron.planning.simulator.chunks import build_chunks
from llamatron.planning.simulator.costs import Costs, Shape, StepOptions
from llamatron.planning.simulator.hardware import resolve_hardware
from llamatron.planning.simulator.runs import run_model
from llamatron.planning.simulator.step import simulate_step
from llamatron.planning.speed import estimate_speed

FINE = {"num_experts": 64, "experts_per_token": 8, "ffn_hidden_size": 704}  # run 21's fine-grained shape
CAL, H200 = load_calibration(), resolve_hardware("h200")
MBS4 = Shape(micro_batch_size=4)


def _model(**overrides):
    return run_model({"model": "mixtral-1b", "model_overrides": {**FINE, **overrides}})


def _costs(shape: Shape = MBS4, **overrides) -> Costs:
    return Costs(_model(**overrides), shape, H200, CAL)


@pytest.mark.parametrize("factor", [1.0, 1.25, 4.0])
def test_a_capacity_of_at_least_one_drops_nothing_from_the_even_loads_simulated(factor):
    dropless, capped = _costs(), _costs(moe_capacity_factor=factor)
    assert capped.expert_gemm_forward() == dropless.expert_gemm_forward()
    assert capped.elementwise_total() == dropless.elementwise_total()


def test_a_capacity_below_one_caps_the_expert_rows_the_permutation_and_the_all_to_all():
    shape = Shape(micro_batch_size=4, ep=4)
    dropless, half = _costs(shape), _costs(shape, moe_capacity_factor=0.5)
    m, tokens = dropless.model, 4 * 4096
    # the all-to-all: T x kept choices x hidden x 2 bytes, 3/4 of them off the rank
    assert half.all_to_all_bytes() == pytest.approx(tokens * 8 * 0.5 * m.hidden_size * 2 * 3 / 4)
    assert half.all_to_all_bytes() == pytest.approx(dropless.all_to_all_bytes() / 2)
    # the permutation's passes over the (choices, hidden) rows and SwiGLU over the experts' ffn: half of each
    pass_bytes = CAL.permutation_passes * 2 * 8 * m.hidden_size + CAL.elementwise_per_ffn * 2 * 8 * m.ffn_hidden_size
    saved = pass_bytes * 0.5 * tokens / (H200.gpu.hbm_bw * CAL.elementwise_hbm_efficiency)
    assert dropless.elementwise_total() - half.elementwise_total() == pytest.approx(saved)
    # the experts' GEMMs: half the FLOPs, on half the rows per expert (a worse shape factor)
    router = layers(m)[0].params("router")
    expert = layers(m)[0].params("expert") / m.num_experts

    def gemm(share: float) -> float:
        rows = tokens * 8 * share * 4 / 64
        factor = rows / (rows + CAL.grouped_rows_half) * 704 / (704 + CAL.gemm_width_half)
        rate = H200.gpu.peak_flops * CAL.gemm_efficiency * CAL.grouped_gemm_efficiency * factor
        return 2 * tokens * (router + 8 * share * expert) / rate

    assert dropless.expert_gemm_forward() == pytest.approx(gemm(1.0))
    assert half.expert_gemm_forward() == pytest.approx(gemm(0.5))


def test_a_capacity_caps_the_activations_the_planner_counts():
    """The k dispatched copies (2a x k x h) and the experts' SwiGLU (3a x k x ffn, compiled) per token."""
    dropless, half = _model(), _model(moe_capacity_factor=0.5)
    compiled = LayerKernels(compiled=True)
    a, b = layer_activation_terms(dropless, 2, kernels=compiled), layer_activation_terms(half, 2, kernels=compiled)
    assert a["moe_dispatch"] - b["moe_dispatch"] == pytest.approx(2 * 2 * 4 * 2048)
    assert a["mlp"] - b["mlp"] == pytest.approx(3 * 2 * 4 * 704)


def _step(pp: int, **overrides) -> tuple[float, float]:
    """(step seconds without idle, the routing pass's seconds) of the fine-grained shape on `pp` H200s."""
    model = _model(**overrides)
    shape = Shape(pp=pp, micro_batch_size=4)
    result = simulate_step(model, shape, H200, StepOptions(micro_batches=4), CAL)
    return result.step_seconds * (1 - CAL.idle_share), result.parts.get("routing_pass", 0.0)


def test_global_batch_balancing_adds_the_forward_only_pass_of_every_micro_batch():
    model = _model(router_aux_loss_scope="global_batch")
    costs = Costs(model, Shape(micro_batch_size=4), H200, CAL)
    forward = build_chunks(model, costs.s, costs, 1, None)[0].forward.seconds  # the layers' and the head's
    step, routing = _step(1, router_aux_loss_scope="global_batch")
    assert routing == pytest.approx(4 * forward)
    assert step - _step(1)[0] == pytest.approx(4 * forward)


def test_global_batch_balancing_on_a_pipeline_runs_the_forward_only_schedule():
    """Two stages, four micro-batches, forward only: the first stage's first forward, its send, then the last
    stage's four forwards back to back (the last stage, with the head, is the slower)."""
    model = _model(router_aux_loss_scope="global_batch")
    costs = Costs(model, Shape(pp=2, micro_batch_size=4), H200, CAL)
    first, last = (ch.forward.seconds for ch in build_chunks(model, costs.s, costs, 1, None))
    assert last > first
    routing = _step(2, router_aux_loss_scope="global_batch")[1]
    assert routing == pytest.approx(first + costs.p2p(across_nodes=False) + 4 * last)


def test_the_planners_ranking_model_knows_both():
    """Its compute: a third of the model FLOPs more with the routing pass; the dropped choices' expert FLOPs
    (6 x expert parameters per layer x k/2 x layers) fewer at a capacity of 0.5."""

    def compute(**overrides) -> float:
        lay = planned(1, 1, 1, 1, False, True, "none", 4, 8)
        return estimate_speed(_model(**overrides), lay, 4096, 1, 8).parts["compute"]

    from llamatron.models.inventory import flops_per_token

    model_flops = flops_per_token(_model(), 4096)
    assert compute(router_aux_loss_scope="global_batch") / compute() == pytest.approx(4 / 3)
    dropped = 6 * 3 * 2048 * 704 * 4 * 16
    assert compute(moe_capacity_factor=0.5) / compute() == pytest.approx(1 - dropped / model_flops)
