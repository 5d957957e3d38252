"""Routing and balancing options on the GPU (pytest -m gpu): a capacity through the grouped GEMMs against the
per-expert loop; a compiled bf16 run with every option, and its bitwise resume."""

import pytest
import torch
from layout import run_train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = ["--device", "cuda", "--precision", "bf16", "--seq-length", "128", "--lr", "3e-3"]


def _moe(backend: str):
    from llamatron.models import get_preset
    from llamatron.models.moe import MoE

    cfg = get_preset("mixtral-test").with_changes(
        {"hidden_size": 256, "ffn_hidden_size": 512, "num_experts": 8, "moe_capacity_factor": 0.5}
    )
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    moe = moe.cuda().bfloat16()
    moe.experts.backend = backend
    return moe


def test_capacity_through_grouped_gemms_matches_the_loop():
    """The same router (so the same drops), the experts as grouped GEMMs or the loop: outputs and gradients."""
    grouped, loop = _moe("auto"), _moe("loop")
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16)
    outs = []
    for moe in (grouped, loop):
        xi = x.clone().requires_grad_()
        out = moe(xi)
        (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        outs.append((out.float(), xi.grad.float(), moe.experts.gate_up.grad.float()))
    for a, b, name in zip(outs[0], outs[1], ("output", "input gradient", "gate_up gradient")):
        assert (a - b).norm() / b.norm() < 1e-2, name
    dropless = _moe("auto")
    dropless.capacity_factor = None
    assert (dropless(x).float() - outs[0][0]).norm() / outs[0][0].norm() > 1e-2  # something was dropped


def test_compiled_run_with_every_option_trains_and_resumes_bitwise(tmp_path):
    (tmp_path / "all.yaml").write_text(
        "model_overrides:\n  router_aux_loss_scope: global_batch\n  router_expert_bias: true\n"
        "  moe_capacity_factor: 1.0\n"
    )
    args = [*CUDA, "--config", "all.yaml", "--train-steps", "5"]
    whole = run_train([*args, "--save-interval", "3", "--save", "ck"], 1, tmp_path, model="mixtral-test")
    assert all(r["moe_aux_loss"] > 1.0 for r in whole)
    resumed = run_train([*args, "--load", "ck/step-3"], 1, tmp_path, model="mixtral-test")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[3:]]
