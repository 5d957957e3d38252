"""Llama 4 on the GPU (pytest -m gpu): the chunked layers' flex-attention block mask, the NoPE layers' temperature
and the sigmoid-routed experts (grouped GEMMs in bf16) against the CPU's dense-mask reference, eager and compiled."""

import copy
import dataclasses

import pytest
import torch

from llamatron.models import build_model, get_preset, materialize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _models(dtype: torch.dtype):
    """The same weights on the CPU (fp32, the reference) and the GPU (`dtype`): chunks of 16 tokens and a
    temperature step every 8 positions over 128 tokens (flex attention's block), head_dim 64."""
    shape = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, init_std=0.1, max_seq_length=256)
    cfg = dataclasses.replace(get_preset("llama4-test"), **shape)
    cpu = materialize(build_model(cfg), cfg, 0, "cpu", torch.float32)
    return cfg, cpu, copy.deepcopy(cpu).to("cuda", dtype)


def _tokens(cfg, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seed))


def test_fp32_on_the_gpu_equals_the_cpu_reference():
    cfg, cpu, gpu = _models(torch.float32)
    tokens = _tokens(cfg, 128, 0)
    with torch.no_grad():
        expected, got = cpu.eval()(tokens), gpu.eval()(tokens.cuda()).cpu()
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_training_step_follows_the_fp32_reference(compiled):
    """bf16 (grouped GEMMs, the flex block mask; compiled or not) within bf16's tolerance of fp32 on the CPU, loss
    and gradients."""
    cfg, cpu, gpu = _models(torch.bfloat16)
    tokens = _tokens(cfg, 129, 1)
    losses = []
    for model, device in ((cpu, "cpu"), (torch.compile(gpu) if compiled else gpu, "cuda")):
        t = tokens.to(device)
        logits = model(t[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 0.02 * losses[0]
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        assert (q.grad.float().cpu() - p.grad).norm() <= 0.05 * p.grad.norm() + 1e-6, name
