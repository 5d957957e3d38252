"""FP8 on the GPU (pytest -m gpu, FP8 tensor cores): torchao's real FP8 matmuls, compiled, against bf16 and against
its own emulation; a compiled training run."""

import dataclasses

import pytest
import torch
from layout import assert_matches, run_train

from llamatron.kernels.cross_entropy_op import cross_entropy_per_token

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=256, ffn_hidden_size=768, num_heads=4, num_kv_heads=2, num_layers=2, vocab_size=512)


def _fp8_hardware() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _fp8_hardware(), reason="needs FP8 tensor cores (compute capability 8.9+)")


def _model(recipe: str, emulate: bool = False, compiled: bool = True):
    from llamatron.models import build_model, get_preset, materialize
    from llamatron.training.engine import apply_compile
    from llamatron.training.fp8 import apply_fp8

    cfg = dataclasses.replace(get_preset("llama-test"), **SHAPE)
    model = build_model(cfg)
    apply_fp8(model, recipe, emulate=emulate)
    model = materialize(model, cfg, 0, "cuda", torch.bfloat16)
    if compiled:
        apply_compile(model)
    return cfg, model


def _loss_and_grads(cfg, model, tokens):
    loss = cross_entropy_per_token(model(tokens), tokens).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


@needs_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_fp8_model_is_within_fp8s_error_of_bf16(recipe):
    cfg, bf16 = _model("none")
    _, fp8 = _model(recipe)
    tokens = torch.randint(0, cfg.vocab_size, (4, 256), device="cuda")
    ref_loss, ref_grads = _loss_and_grads(cfg, bf16, tokens)
    loss, grads = _loss_and_grads(cfg, fp8, tokens)
    assert abs(float(loss - ref_loss)) < 1e-2 * float(ref_loss)
    rels = {n: float((g - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-6)) for n, g in grads.items()}
    linear_rels = [r for n, r in rels.items() if n.startswith("layers.") and n.endswith(("qkv.weight", "down.weight"))]
    assert max(rels.values()) < 0.2, rels  # e4m3 forward, e5m2 gradients: percents, not more
    assert min(linear_rels) > 1e-4, rels  # and the linears did run in FP8


@needs_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_tensor_cores_compute_what_the_emulation_does(recipe):
    from llamatron.training.fp8 import FP8Matmul

    torch.manual_seed(0)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2048, 1024, device="cuda") / 32).to(torch.bfloat16)
    real = FP8Matmul(recipe, emulate=False)(x, w).float()
    emulated = FP8Matmul(recipe, emulate=True)(x, w).float()
    exact = x.float() @ w.float().t()
    assert (real - emulated).norm() / emulated.norm() < 1e-2  # the same quantisation; accumulation order differs
    assert (real - exact).norm() / exact.norm() < 0.08


@needs_fp8
def test_fp8_training_run_on_cuda_tracks_bf16(tmp_path):
    args = ["--device", "cuda", "--precision", "bf16", "--seq-length", "128", "--train-steps", "6", "--lr", "3e-3"]
    bf16 = run_train(args, 1, tmp_path)
    fp8 = run_train([*args, "--fp8", "tensorwise"], 1, tmp_path)
    assert_matches(bf16, fp8, rtol=2e-2, keys=("loss",))
    assert [r["loss"] for r in bf16] != [r["loss"] for r in fp8]
