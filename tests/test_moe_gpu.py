"""The mixture of experts on the GPU (pytest -m gpu): grouped GEMMs against the per-expert loop, compiled; a compiled
training run with router statistics."""

import dataclasses

import pytest
import torch
from layout import run_train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPE = dict(hidden_size=256, ffn_hidden_size=512, num_heads=4, num_kv_heads=2, num_layers=2, vocab_size=512)


def _model(backend: str, compiled: bool):
    from llamatron.engine import apply_compile
    from llamatron.models import build_model, get_preset, materialize
    from llamatron.models.moe import Experts

    cfg = dataclasses.replace(get_preset("mixtral-test"), **SHAPE, num_experts=8)
    model = materialize(build_model(cfg), cfg, 0, "cuda", torch.bfloat16)
    for m in model.modules():
        if isinstance(m, Experts):
            m.backend = backend
    if compiled:
        apply_compile(model)
    return cfg, model


@pytest.mark.parametrize("compiled", [False, True])
def test_grouped_gemm_experts_match_the_loop(compiled):
    cfg, grouped = _model("auto", compiled)
    _, loop = _model("loop", compiled)
    tokens = torch.randint(0, cfg.vocab_size, (4, 256), device="cuda")
    results = []
    for model in (grouped, loop):
        loss = model(tokens, labels=tokens).float().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (ref_loss, ref), (loss, grads) = results[1], results[0]
    assert abs(float(loss - ref_loss)) < 2e-3 * float(ref_loss)
    for name, g in ref.items():
        err = (grads[name] - g).norm() / g.norm().clamp_min(1e-12)
        # bf16 rounding in another order; a norm weight's gradient sums over every token, with cancellation
        # (5% apart between a compiled grouped run and the eager loop, seen on an H200)
        assert err < (3e-2 if g.ndim > 1 else 1e-1), (name, float(err))


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
