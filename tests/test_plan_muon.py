"""`plan` and the simulator price --optimizer muon (issue 53, item 4): its state against what the optimizer
allocates, its Newton-Schulz FLOPs against torch's FLOP counter running the iteration, and its seconds in the
simulated step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from plan_layouts import planned
from torch.utils.flop_counter import FlopCounterMode

from llamatron.config.settings import config_from_values
from llamatron.models import get_preset
from llamatron.optim.muon import newton_schulz
from llamatron.parallel.mesh import build_mesh
from llamatron.planning import plan as P
from llamatron.planning.muon_cost import muon_cost
from llamatron.planning.simulator.evaluate import optimizer_seconds, simulate_layout
from llamatron.planning.simulator.hardware import resolve_hardware
from llamatron.training.engine import build_engine
from llamatron.training.validate import validate

MODEL = "qwen2-moe-test"  # every kind of parameter: matrices, experts, a 1-row gate, router, norms, biases
ONE = planned(1, 1, 1, 1, False, False, "none", 1, 4)


def test_planned_muon_state_is_what_the_optimizer_allocates():
    """fp32 on one process: the plan's optimizer state equals the state tensors Muon allocates (a momentum for each
    hidden matrix, two moments for the rest); AdamW's plan, which the Muon run would otherwise get, does not."""
    cfg = config_from_values({"model": MODEL, "mock_data": True, "device": "cpu", "optimizer": "muon"})
    engine = build_engine(cfg, validate(cfg, 1), build_mesh())
    opt = engine.optimizer
    allocated = sum(t.numel() * t.element_size() for i in range(len(opt.segments)) for t in opt.state(i).values())
    model = engine.model_cfg
    fp32 = P.Precision(dtype="fp32", compiled=False)
    planned_bytes = P._state_bytes(model, ONE, dataclasses.replace(fp32, optimizer="muon"), model.num_layers, 0)[2]
    assert planned_bytes == allocated
    assert P._state_bytes(model, ONE, fp32, model.num_layers, 0)[2] > allocated * 1.2


def test_newton_schulz_flops_are_what_the_iteration_runs():
    """muon_cost's FLOPs on one rank (no sharding, tp 1) against torch's FLOP counter running newton_schulz on every
    hidden matrix of the model, each expert on its own."""
    cfg = config_from_values({"model": MODEL, "mock_data": True, "device": "cpu", "optimizer": "muon"})
    engine = build_engine(cfg, validate(cfg, 1), build_mesh())
    matrices = [p for n, p in engine.chunks[0].named_parameters() if n in engine.optimizer.hidden]
    with FlopCounterMode(display=False) as counter:
        for p in matrices:
            for m in p.detach() if p.ndim == 3 else [p.detach()]:
                newton_schulz(m, (3.4445, -4.7750, 2.0315), 5, torch.float32)
    model = engine.model_cfg
    assert muon_cost(model, ONE, model.num_layers).flops == counter.get_total_flops()


def test_simulated_step_adds_muon_seconds():
    """Llama 2 7B, dp 8 with the distributed optimizer on H100s: the simulated step is longer by Muon's seconds
    (Newton-Schulz on 1/8 of the matrices each, their updates summed and broadcast)."""
    model, hw = get_preset("llama2-7b"), resolve_hardware("h100-sxm")
    lay = planned(1, 1, 1, 8, False, True, "none", 1, 256)
    adamw = simulate_layout(model, lay, 4096, hw).result
    muon_precision = P.Precision(optimizer="muon")
    muon = simulate_layout(model, lay, 4096, hw, muon_precision).result
    extra = optimizer_seconds(model, lay, hw, muon_precision)
    assert 0 < extra < 0.05 * adamw.step_seconds  # 1.7%: 32 micro-batches of one sequence a step
    assert muon.parts["optimizer"] - adamw.parts["optimizer"] == extra


def test_plan_takes_the_yaml_optimizer_and_refuses_an_unknown_one(tmp_path, capsys):
    from llamatron.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("model: llama-test\noptimizer: sgd\n")
    with pytest.raises(SystemExit) as failed:
        main(["plan", "--config", str(config), "--gpus", "1"])
    err = capsys.readouterr().err
    assert failed.value.code == 2 and "optimizer 'sgd': choose one of adamw, muon" in err and "Traceback" not in err
