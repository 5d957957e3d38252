"""The decoding step captured in a CUDA graph (pytest -m gpu): it gives the tokens of the same step run eagerly
(bf16: the same kernels, replayed), those of recomputing the whole sequence (fp32), and with torch.compile those of
the eager step (fp32); prompts of different lengths decode together as each alone; the graph is captured once and
replayed across calls."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode import PROMPTS, TOKENS

from llamatron.inference.decode import Decoder
from llamatron.inference.generate import generate_batch, sample
from llamatron.inference.sampling import Sampling
from llamatron.models import RopeScaling, build_model, get_preset, materialize

pytestmark = pytest.mark.gpu

NEW = 64


def gpu_model(preset: str, dtype: torch.dtype):
    cfg = dataclasses.replace(get_preset(preset), init_std=0.3)
    return materialize(build_model(cfg), cfg, 1, "cuda", dtype).eval()


@pytest.mark.parametrize("preset", ["llama-test", "mistral-test", "qwen3-test", "llama-tiny"])
def test_the_captured_step_gives_the_eager_steps_tokens_bf16(preset):
    model = gpu_model(preset, torch.bfloat16)
    graphed = Decoder(model, len(PROMPTS), 11 + NEW)
    assert graphed.cuda_graph and graphed.check_every > 1  # the default on CUDA
    eager = Decoder(model, len(PROMPTS), 11 + NEW, cuda_graph=False)
    expected = eager.generate(PROMPTS, NEW)
    assert graphed.generate(PROMPTS, NEW) == expected
    graph = graphed.graph
    assert graph is not None
    assert graphed.generate(PROMPTS[1:], NEW) == expected[1:]  # replayed: the same graph, a dummy row
    assert graphed.graph is graph
    assert all(len(set(row)) >= 4 for row in expected)  # tokens that depend on the context


@pytest.mark.parametrize("preset", ["llama-test", "mistral-test", "qwen3-test"])
def test_the_captured_step_gives_the_full_recompute_tokens_fp32(preset):
    model = gpu_model(preset, torch.float32)
    batched = generate_batch(model, PROMPTS, NEW)
    for prompt, tokens in zip(PROMPTS, batched):
        assert tokens == sample(model, prompt, NEW, temperature=0, use_cache=False)


def test_sampling_in_the_graph_draws_the_eager_tokens():
    model = gpu_model("llama-tiny", torch.bfloat16)
    sampling = Sampling(temperature=0.9, top_k=100, top_p=0.9, repetition_penalty=1.2)
    graphed = Decoder(model, 4, 11 + NEW, sampling).generate(PROMPTS, NEW, seed=5)
    assert graphed == Decoder(model, 4, 11 + NEW, sampling, cuda_graph=False).generate(PROMPTS, NEW, seed=5)
    assert graphed != Decoder(model, 4, 11 + NEW, sampling).generate(PROMPTS, NEW, seed=6)


def test_stops_end_rows_when_checked_every_few_steps():
    model = gpu_model("llama-test", torch.bfloat16)
    decoder = Decoder(model, 4, 11 + NEW)
    free = decoder.generate(PROMPTS, NEW)
    eos = {free[1][4], free[3][20]}
    stopped = decoder.generate(PROMPTS, NEW, stop_ids=eos)
    for row, tokens in zip(free, stopped):
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        assert tokens == row[:end]


def test_the_compiled_captured_step_gives_the_eager_tokens_fp32():
    model = gpu_model("llama-tiny", torch.float32)
    compiled = Decoder(model, 4, 11 + 32, compile=True).generate(PROMPTS, 32)
    assert compiled == Decoder(model, 4, 11 + 32, cuda_graph=False).generate(PROMPTS, 32)


def test_a_batch_of_32_decodes_each_prompt_as_alone_fp32():
    model = gpu_model("llama-tiny", torch.float32)
    prompts = [TOKENS[: 1 + i % 11] * (1 + i // 11) for i in range(32)]  # lengths 1 to 33
    together = generate_batch(model, prompts, 48)
    assert together == [generate_batch(model, [p], 48, cuda_graph=False)[0] for p in prompts]


def test_models_the_graph_cannot_hold_decode_eagerly_on_cuda():
    """Dynamic NTK rope (a host read of the positions) and a mixture of experts run the same step eagerly."""
    shapes = {
        "dynamic": dict(rope_scaling=RopeScaling("dynamic", 2.0, 96)),
        "moe": dict(num_experts=4, experts_per_token=2),
    }
    for changes in shapes.values():
        cfg = dataclasses.replace(get_preset("llama-test"), init_std=0.3, **changes)
        model = materialize(build_model(cfg), cfg, 1, "cuda", torch.float32).eval()
        decoder = Decoder(model, len(PROMPTS), 11 + 32)
        assert not decoder.cuda_graph
        for prompt, tokens in zip(PROMPTS, decoder.generate(PROMPTS, 32)):
            assert tokens == sample(model, prompt, 32, temperature=0, use_cache=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "heads, kv_heads, dim, window, chunk",
    [(32, 8, 64, None, None), (32, 32, 128, 100, None), (8, 2, 128, None, 64), (12, 4, 80, None, None)],
)
def test_the_decode_attention_kernel_matches_its_torch_ops(dtype, heads, kv_heads, dim, window, chunk):
    """kernels/decode_attention_op.py's kernel compiled for CUDA against the torch ops it replaces, in fp32
    (the kernel computes in fp32; its inputs and output in `dtype`)."""
    from decode_reference import torch_step

    from llamatron.kernels.decode_attention_op import decode_attention_op

    torch.manual_seed(0)
    batch, slots = 5, 300
    positions = torch.tensor([299, 0, 17, 150, 64], device="cuda")
    q = torch.randn(batch, 1, heads, dim, device="cuda", dtype=dtype).transpose(1, 2)
    k_new, v_new = (torch.randn(batch, kv_heads, 1, dim, device="cuda", dtype=dtype) for _ in range(2))
    keys, values = (torch.randn(batch, kv_heads, slots, dim, device="cuda", dtype=dtype) for _ in range(2))
    ref, ref_keys, ref_values = torch_step(q, k_new, v_new, keys, values, positions, window, chunk)
    out = decode_attention_op(q, k_new, v_new, keys, values, positions, window or 0, chunk or 0)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
