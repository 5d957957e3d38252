"""The mixture of experts on the GPU (pytest -m gpu): grouped GEMMs against the per-expert loop, compiled; a compiled
training run with router statistics."""

import dataclasses

import pytest
import torch
from layout import run_train

from llamatron.kernels.cross_entropy_op import cross_entropy_per_token

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPE = dict(hidden_size=256, ffn_hidden_size=512, num_heads=4, num_kv_heads=2, num_layers=2, vocab_size=512)


def _model(backend: str, compiled: bool):
    from llamatron.models import build_model, get_preset, materialize
    from llamatron.models.moe import Experts
    from llamatron.training.engine import apply_compile

    cfg = dataclasses.replace(get_preset("mixtral-test"), **SHAPE, num_experts=8)
    model = materialize(build_model(cfg), cfg, 0, "cuda", torch.bfloat16)
    for m in model.modules():
        if isinstance(m, Experts):
            m.backend = backend
    if compiled:
        apply_compile(model)
    return cfg, model


def test_gather_sum_kernel_on_cuda_is_the_fp32_sum_rounded_once():
    """The combine's Triton kernel (kernels/gather_sum_op.py), eager and inside a compiled function, at a
    fine-grained shape (k 8, hidden 2048): within one bf16 rounding of the fp64 sum."""
    from llamatron.kernels.gather_sum_op import gather_sum

    torch.manual_seed(0)
    tokens, k, hidden = 1000, 8, 2048
    rows = torch.randn(tokens * k, hidden, device="cuda", dtype=torch.bfloat16)
    index = torch.randperm(tokens * k, device="cuda")
    weights = torch.rand(tokens, k, device="cuda", dtype=torch.bfloat16)
    for w in (weights, None):
        ref = rows.double()[index].view(tokens, k, hidden)
        ref = (ref if w is None else ref * w.double().unsqueeze(-1)).sum(1)
        for fn in (gather_sum, torch.compile(gather_sum, fullgraph=True)):
            out = fn(rows, index, w, k)
            torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
def test_grouped_gemm_experts_match_the_loop(compiled):
    """The experts alone, on the same sorted rows (skewed counts, empty experts included), so that no routing
    decision can differ: grouped GEMMs (eager or compiled) against the per-expert loop, forward and backward."""
    from llamatron.models.moe import Experts

    torch.manual_seed(0)
    grouped = Experts(8, 256, 512).cuda().bfloat16()
    for p in grouped.parameters():
        torch.nn.init.normal_(p, std=0.05)
    loop = Experts(8, 256, 512).cuda().bfloat16()
    loop.load_state_dict(grouped.state_dict())
    loop.backend = "loop"
    counts = torch.tensor([0, 700, 100, 0, 50, 74, 0, 100], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    forward = torch.compile(grouped.forward) if compiled else grouped.forward
    outs = []
    for run in (forward, loop.forward):
        xi = x.clone().requires_grad_()
        out = run(xi, counts)
        (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        outs.append((out.float(), xi.grad.float()))
    for (a, b), name in zip(zip(outs[0], outs[1]), ("output", "input gradient")):
        assert (a - b).norm() / b.norm() < 1e-2, name
    for name, p in grouped.named_parameters():
        q = dict(loop.named_parameters())[name]
        assert (p.grad.float() - q.grad.float()).norm() / q.grad.float().norm() < 1e-2, name


def test_compiled_moe_model_matches_the_loop_in_loss():
    """Whole compiled models: the loss agrees (their gradients may not: a bf16 rounding can flip a near-tied
    top-2 choice at initialisation, moving a token's whole contribution to another expert)."""
    cfg, grouped = _model("auto", True)
    _, loop = _model("loop", True)
    tokens = torch.randint(0, cfg.vocab_size, (4, 256), device="cuda")
    losses = [float(cross_entropy_per_token(m(tokens), tokens).float().mean()) for m in (grouped, loop)]
    assert abs(losses[0] - losses[1]) < 2e-3 * losses[1]


def test_compiled_mixture_of_experts_trains_on_the_gpu(tmp_path):
    records = run_train(
        ["--device", "cuda", "--precision", "bf16", "--seq-length", "128", "--train-steps", "8", "--lr", "3e-3"],
        1,
        tmp_path,
        model="mixtral-test",
    )
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["moe_aux_loss"] > 1.0 for r in records)  # about k = 2 when balanced
    assert all(abs(sum(r["expert_token_share"]) - 1) < 1e-5 for r in records)


def test_moe_resume_on_cuda_is_bitwise(tmp_path):
    """Routing's sorts, gathers and scatters are deterministic on CUDA: a resumed run repeats the uninterrupted
    one's losses exactly (design principle 4). The first two steps' learning rates are those of a 4-step run."""
    cuda = ["--device", "cuda", "--precision", "bf16", "--seq-length", "128", "--lr", "3e-3"]
    whole = run_train(cuda + ["--train-steps", "4"], 1, tmp_path, model="mixtral-test")
    run_train(cuda + ["--train-steps", "2", "--save", "ck"], 1, tmp_path, model="mixtral-test")
    resumed = run_train(cuda + ["--train-steps", "4", "--load", "ck"], 1, tmp_path, model="mixtral-test")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[2:]]
