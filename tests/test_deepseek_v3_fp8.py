"""FP8 (--fp8) on DeepSeek-V3's latent attention: which of its projections run FP8 and the shapes FP8 matmuls take
(on CPU, torchao's emulation), and on a GPU with FP8 tensor cores (pytest -m gpu) a short run against bf16.

The shapes are the layers' own (models/inventory.py): the deepseek-v3-test preset's kv_a projection has
kv_lora_rank + qk_rope_head_dim = 16 + 8 = 24 outputs, which torch._scaled_mm does not take (multiples of 16), so
FP8 runs use it with 16-wide rotary heads (FP8_SHAPE)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from layout import assert_matches, run_train
from torch import nn

from llamatron.models import build_model, get_preset
from llamatron.parallel.layout import ParallelLayout
from llamatron.parallel.mesh import Mesh
from llamatron.parallel.tensor import apply_tensor_parallel
from llamatron.training.fp8 import FP8Matmul, apply_fp8, fp8_problems

MODEL = "deepseek-v3-test"
FP8_SHAPE = {"qk_rope_head_dim": 16, "head_dim": 32}  # kv_a: 16 + 16 outputs
MLA = ("q_a", "q_b", "kv_a", "kv_b", "o")


def _fp8_cfg():
    return dataclasses.replace(get_preset(MODEL), **FP8_SHAPE)


def _problems(model, tp: int = 1) -> list[str]:
    args = dict(recipe="tensorwise", emulate=False, device="cuda", dtype_name="bf16", tp=tp, tokens_per_matmul=64)
    return fp8_problems(model=model, capability=(9, 0), **args)


def test_latent_attentions_projection_shapes_are_checked():
    """Every MLA projection's inputs and outputs on a rank (hidden_size, q_lora_rank, heads x widths / tp,
    kv_lora_rank + qk_rope_head_dim, kv_lora_rank) must be multiples of 16."""
    (odd,) = _problems(get_preset(MODEL))
    assert "attn.kv_a outputs per rank = 24" in odd and "multiple of 16" in odd
    assert _problems(_fp8_cfg()) == [] and _problems(_fp8_cfg(), tp=2) == []
    (latent,) = _problems(dataclasses.replace(_fp8_cfg(), kv_lora_rank=24))  # kv_a 24 + 16, kv_b reads 24
    assert "attn.kv_a outputs per rank = 40" in latent and "attn.kv_b inputs per rank = 24" in latent
    (heads,) = _problems(dataclasses.replace(_fp8_cfg(), v_head_dim=12), tp=2)  # o reads 2 heads x 12 on a rank
    assert "attn.o inputs per rank = 24" in heads
    assert _problems(get_preset("deepseek-v3"), tp=8) == []  # the published shape


def _attention_linears(model: nn.Module) -> list[str]:
    return [f"layers.{i}.attn.{name}" for i in model.layers for name in MLA]


def test_latent_attentions_five_projections_run_fp8_and_the_router_does_not():
    model = build_model(_fp8_cfg())
    converted = apply_fp8(model, "tensorwise", emulate=True)
    assert [n for n in converted if ".attn." in n] == _attention_linears(model)
    assert not any(n.endswith("router") for n in converted) and type(model.layers["1"].mlp.router) is nn.Linear
    # under tensor parallelism: the replicated down-projections are torchao's Float8Linear, the split ones FP8Matmul
    tp = build_model(_fp8_cfg())
    apply_tensor_parallel(tp, Mesh(ParallelLayout(tp=2), tp_rank=1), sequence_parallel=True)
    assert [n for n in apply_fp8(tp, "tensorwise", emulate=True) if ".attn." in n] == _attention_linears(tp)
    attn = tp.layers["0"].attn
    assert type(attn.q_a).__name__ == type(attn.kv_a).__name__ == "Float8Linear"
    assert all(isinstance(getattr(attn, name).linear, FP8Matmul) for name in ("q_b", "kv_b", "o"))


def _config(workdir: Path) -> list[str]:
    path = workdir / "fp8-shape.yaml"
    path.write_text("model_overrides:\n" + "".join(f"  {k}: {v}\n" for k, v in FP8_SHAPE.items()))
    return ["--config", str(path)]


def test_emulated_fp8_trains_close_to_bf16(tmp_path):
    """torchao's FP8 numerics on CPU (--fp8-emulate): within FP8's error of bf16, and not bf16."""
    args = [*_config(tmp_path), "--precision", "bf16", "--lr", "3e-3", "--train-steps", "3"]
    bf16 = run_train(args, 1, tmp_path, model=MODEL)
    fp8 = run_train([*args, "--fp8", "tensorwise", "--fp8-emulate"], 1, tmp_path, model=MODEL)
    assert_matches(bf16, fp8, rtol=5e-3, keys=("loss",))
    assert [r["loss"] for r in bf16] != [r["loss"] for r in fp8]


needs_fp8 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs FP8 tensor cores (compute capability 8.9+)",
)


@pytest.mark.gpu
@needs_fp8
def test_fp8_on_the_gpu_tracks_bf16_and_runs_latent_attention_in_fp8(tmp_path):
    """A few steps of --fp8 tensorwise against bf16 (the loss within 2%), and one forward and backward in which
    MLA's projections' weight gradients differ from bf16's by FP8's error: they ran FP8 matmuls."""
    from llamatron.kernels.cross_entropy_op import cross_entropy_per_token
    from llamatron.models import materialize

    args = [*_config(tmp_path), "--device", "cuda", "--precision", "bf16", "--seq-length", "128"]
    args += ["--train-steps", "6", "--lr", "3e-3"]
    bf16 = run_train(args, 1, tmp_path, model=MODEL)
    fp8 = run_train([*args, "--fp8", "tensorwise"], 1, tmp_path, model=MODEL)
    assert_matches(bf16, fp8, rtol=2e-2, keys=("loss",))
    assert [r["loss"] for r in bf16] != [r["loss"] for r in fp8]

    cfg, grads = _fp8_cfg(), []
    tokens = torch.randint(0, cfg.vocab_size, (4, 128), device="cuda")
    for recipe in ("none", "tensorwise"):
        model = build_model(cfg)
        apply_fp8(model, recipe)
        model = materialize(model, cfg, 0, "cuda", torch.bfloat16)
        cross_entropy_per_token(model(tokens), tokens).float().mean().backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if ".attn." in n and p.grad is not None})
    for name, want in grads[0].items():
        if any(f".attn.{linear}.weight" in name for linear in MLA):
            rel = float((grads[1][name] - want).norm() / want.norm())
            assert 1e-4 < rel < 0.2, (name, rel)
