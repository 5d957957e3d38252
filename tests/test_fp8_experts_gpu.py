"""FP8 experts on the GPU (pytest -m gpu; torch._scaled_grouped_mm: compute capability 9.0 or 10.0): torchao's FP8
grouped GEMMs against the emulation (forward, both gradients, expert parallelism's hand-written backward), eager and
compiled; a compiled MoE model and a compiled training run beside bf16."""

import dataclasses

import pytest
import torch
from layout import assert_matches, run_train

from llamatron.kernels.cross_entropy_op import cross_entropy_per_token

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=512, ffn_hidden_size=1024, num_heads=4, num_kv_heads=2, num_layers=2, vocab_size=512)


def _grouped_fp8_hardware() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() in ((9, 0), (10, 0))


needs_grouped_fp8 = pytest.mark.skipif(not _grouped_fp8_hardware(), reason="needs compute capability 9.0 or 10.0")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@needs_grouped_fp8
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_grouped_gemm_computes_what_the_emulation_does(compiled):
    """The same quantisation on tensor cores and in the emulation: equal up to accumulation order and torchao's
    fast accumulation; both within e4m3's error of the exact product. Skewed counts, an empty expert, groups that
    are not multiples of 16."""
    from llamatron.training.fp8_experts import FP8GroupedMM

    torch.manual_seed(0)
    counts = torch.tensor([0, 700, 101, 0, 53, 77, 1, 100], device="cuda")
    x = torch.randn(int(counts.sum()), 1024, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(8, 2048, 1024, device="cuda") / 32).to(torch.bfloat16)
    grad = torch.randn(x.shape[0], 2048, device="cuda", dtype=torch.bfloat16)
    results = []
    for emulate in (False, True):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        mm = FP8GroupedMM(emulate)
        run = torch.compile(mm.__call__) if compiled and not emulate else mm
        out = run(xi, wi, counts)
        out.backward(grad)
        results.append((out, xi.grad, wi.grad))
    for real, emulated, name in zip(results[0], results[1], ("output", "input gradient", "weight gradient")):
        assert _rel(real, emulated) < 1e-2, name
    assert torch.equal(results[0][2][0], torch.zeros_like(w[0]))  # the empty expert
    ends = torch.cumsum(counts, 0).tolist()
    exact = torch.cat([x[a:b].float() @ w[e].float().t() for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends))])
    assert 1e-3 < _rel(results[0][0], exact) < 0.08


@needs_grouped_fp8
def test_expert_parallel_backward_on_tensor_cores_is_autograds():
    """Experts.input_grad / weight_grad (parallel/expert.py's hand-written backward) against autograd through
    torchao's function: the same FP8 GEMMs."""
    from llamatron.models.moe import Experts
    from llamatron.training.fp8_experts import FP8GroupedMM

    torch.manual_seed(1)
    counts = torch.tensor([300, 0, 45, 211], device="cuda")
    experts = Experts(4, 512, 512).cuda()
    experts.grouped_mm = FP8GroupedMM(emulate=False)
    x = torch.randn(int(counts.sum()), 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4, 1024, 512, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(x.shape[0], 1024, device="cuda", dtype=torch.bfloat16)
    experts.project(x, w, counts).backward(grad)
    assert _rel(experts.input_grad(grad, w.detach(), counts), x.grad) < 1e-3
    assert _rel(experts.weight_grad(grad, x.detach(), counts, w.detach()), w.grad) < 1e-3


@needs_grouped_fp8
def test_gradient_gemms_accumulate_in_full_precision_unlike_torchaos_function():
    """The forward is torchao's MoE function's, bit for bit; the gradients, summed over thousands of an expert's rows,
    are closer to the emulation (the same FP8 operands, fp32 accumulation) than that function's, whose three GEMMs all
    accumulate fast (the one difference of the autograd function written out in training/fp8_experts.py)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as torchao_grouped_mm

    from llamatron.training.fp8_experts import FP8, FP8GroupedMM, pad, padded_groups, unpad

    torch.manual_seed(2)
    counts = torch.tensor([4096, 3000, 1000], device="cuda")
    x = torch.randn(int(counts.sum()), 1024, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(3, 2048, 1024, device="cuda") / 32).to(torch.bfloat16)
    grad = torch.randn(x.shape[0], 2048, device="cuda", dtype=torch.bfloat16)

    def torchaos(xi, wi, c):
        groups = padded_groups(c, xi.shape[0])
        return unpad(
            torchao_grouped_mm(pad(xi, groups), wi.transpose(-2, -1), groups.offsets, torch.bfloat16, FP8, False),
            groups,
        )

    results = []
    for run in (FP8GroupedMM(emulate=False), FP8GroupedMM(emulate=True), torchaos):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = run(xi, wi, counts)
        out.backward(grad)
        results.append((out, xi.grad, wi.grad))
    ours, emulated, theirs = results
    assert torch.equal(ours[0], theirs[0])
    assert _rel(ours[2], emulated[2]) < _rel(theirs[2], emulated[2])  # the weight gradient: a sum over rows
    assert _rel(ours[1], emulated[1]) <= _rel(theirs[1], emulated[1])  # the input gradient: a sum over 2,048


def _model(fp8_experts: bool, recipe: str = "rowwise"):
    from llamatron.models import build_model, get_preset, materialize
    from llamatron.training.engine import apply_compile
    from llamatron.training.fp8 import apply_fp8

    cfg = dataclasses.replace(get_preset("mixtral-test"), **SHAPE, num_experts=8)
    model = build_model(cfg)
    apply_fp8(model, recipe, experts=fp8_experts)
    model = materialize(model, cfg, 0, "cuda", torch.bfloat16)
    apply_compile(model)
    return cfg, model


def _loss_and_grads(cfg, model, tokens):
    loss = cross_entropy_per_token(model(tokens), tokens).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


@needs_grouped_fp8
def test_compiled_moe_with_fp8_experts_is_within_fp8s_error_of_bf16():
    cfg, bf16 = _model(False, recipe="none")
    _, dense_only = _model(False)
    _, fp8 = _model(True)
    tokens = torch.randint(0, cfg.vocab_size, (4, 512), device="cuda")
    ref_loss, ref_grads = _loss_and_grads(cfg, bf16, tokens)
    _, dense_grads = _loss_and_grads(cfg, dense_only, tokens)
    loss, grads = _loss_and_grads(cfg, fp8, tokens)
    assert abs(float(loss - ref_loss)) < 1e-2 * float(ref_loss)
    experts = [n for n in grads if n.endswith(("experts.gate_up", "experts.down"))]
    assert len(experts) == 2 * cfg.num_layers
    for n in experts:
        assert _rel(grads[n], ref_grads[n]) < 0.2, n  # e4m3 throughout: percents
        assert _rel(grads[n], dense_grads[n]) > 1e-3, n  # and the experts did run FP8


@needs_grouped_fp8
def test_fp8_experts_training_run_on_cuda_tracks_bf16(tmp_path):
    args = ["--device", "cuda", "--precision", "bf16", "--seq-length", "128", "--train-steps", "6", "--lr", "3e-3"]
    args += ["--compile"]
    bf16 = run_train(args, 1, tmp_path, model="mixtral-test")
    fp8 = run_train([*args, "--fp8", "rowwise", "--fp8-experts"], 1, tmp_path, model="mixtral-test")
    dense_only = run_train([*args, "--fp8", "rowwise"], 1, tmp_path, model="mixtral-test")
    assert_matches(bf16, fp8, rtol=2e-2, keys=("loss",))
    assert [r["loss"] for r in fp8] != [r["loss"] for r in dense_only]
