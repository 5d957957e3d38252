"""LoRA with --fp8: the frozen base's matmuls run FP8 (torchao's, emulated on CPU) and the adapters stay bf16, on
one process and on tensor-parallel shards; training stays within FP8's error of bf16 LoRA and its layouts match."""

from __future__ import annotations

import pytest
import torch
from layout import assert_matches, run_train

from llamatron.adapters.lora import LoraLinear, LoraMatmul, low_rank_update
from llamatron.adapters.targets import apply_lora, find_targets
from llamatron.models import build_model, get_preset
from llamatron.parallel.layout import ParallelLayout
from llamatron.parallel.mesh import Mesh
from llamatron.parallel.tensor import apply_tensor_parallel
from llamatron.training.fp8 import FP8Matmul, apply_fp8, fp8_layers

pytest.importorskip("torchao")

MODEL = get_preset("llama-test")
LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
EXPECTED = [f"layers.{i}.{linear}" for i in range(MODEL.num_layers) for linear in LINEARS]


def test_an_adapted_linear_runs_its_base_in_fp8_and_its_adapters_in_bf16():
    torch.manual_seed(0)
    model = build_model(MODEL, device="cpu").to(torch.bfloat16)
    apply_lora(model, find_targets(model, MODEL, ["all-linear"]), 4, 8.0, 0.0)
    for m in model.modules():
        if isinstance(m, LoraLinear):
            torch.nn.init.normal_(m.lora_b, std=0.02)  # a trained adapter, not zero
    assert apply_fp8(model, "tensorwise", emulate=True) == fp8_layers(model) == EXPECTED
    layer = model.get_submodule("layers.0.mlp.down")
    x = torch.randn(2, 16, layer.weight.shape[1], dtype=torch.bfloat16)
    update = layer.scale * low_rank_update(x, layer.lora_a, layer.lora_b, layer.onehot, 0.0, False)
    fp8_base = FP8Matmul("tensorwise", emulate=True)(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), fp8_base + update)
    bf16 = torch.nn.functional.linear(x, layer.weight, layer.bias) + update
    assert (layer(x) - bf16).float().norm() / bf16.float().norm() > 1e-3  # FP8 does run


def test_tensor_parallel_adapted_layers_run_their_base_in_fp8():
    model = build_model(MODEL)
    targets = find_targets(model, MODEL, ["all-linear"])
    apply_tensor_parallel(model, Mesh(ParallelLayout(tp=2), tp_rank=1), sequence_parallel=True)
    apply_lora(model, targets, 4, 8.0, 0.0)
    assert apply_fp8(model, "tensorwise", emulate=True) == EXPECTED
    for name in EXPECTED:
        matmul = model.get_submodule(name).linear
        assert isinstance(matmul, LoraMatmul) and isinstance(matmul.inner, FP8Matmul)


LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all-linear"]
ARGS = [*LORA, "--precision", "bf16", "--lr", "3e-3", "--train-steps", "4"]


def test_lora_trains_in_fp8_close_to_bf16_and_tensor_parallel_matches(tmp_path):
    bf16 = run_train(ARGS, 1, tmp_path)
    fp8 = run_train([*ARGS, "--fp8", "tensorwise", "--fp8-emulate"], 1, tmp_path)
    assert_matches(bf16, fp8, rtol=2e-3, keys=("loss",))
    assert [r["loss"] for r in fp8] != [r["loss"] for r in bf16]  # the base ran FP8
    tp = run_train([*ARGS, "--fp8", "tensorwise", "--fp8-emulate", "--tp", "2", "--sequence-parallel"], 2, tmp_path)
    assert_matches(fp8, tp, rtol=1e-3, keys=("loss",))
