"""Kernels per model (models/kernels.py): two models with different choices in one process each run their own,
eager and compiled (torch.compile's caches on), and a model built without apply_kernels runs auto."""

import dataclasses
import weakref

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from llamatron.kernels import triton_check
from llamatron.models import KernelChoices, apply_kernels, build_model, get_preset, materialize
from llamatron.models.layers import RMSNorm
from llamatron.objectives.language_model import LanguageModelObjective
from llamatron.parallel.mesh import Mesh
from llamatron.training.engine import apply_compile

# The aten op each forced SDPA kernel shows as (math: eager only; compiled, it becomes the layer's own matmuls).
SDPA_OPS = {
    "cpu": {
        "math": "aten::_scaled_dot_product_attention_math",
        "flash": "aten::_scaled_dot_product_flash_attention_for_cpu",
    },
    "cuda": {
        "math": "aten::_scaled_dot_product_attention_math",
        "flash": "aten::_scaled_dot_product_flash_attention",
        "efficient": "aten::_scaled_dot_product_efficient_attention",
        "cudnn": "aten::_scaled_dot_product_cudnn_attention",
    },
}
TRITON_OPS = {
    "swiglu": {"llamatron::swiglu"},
    "rmsnorm": {"llamatron::rms_norm", "llamatron::add_rms_norm"},
    "rope": {"llamatron::qkv_rope"},
    "cross_entropy": {"llamatron::cross_entropy"},
}


_OBJECTIVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # each test model's objective


def _model(choices: KernelChoices | None, device: str = "cpu", **changes):
    """A model with `choices` applied, and its language-model objective with the choice of loss kernel."""
    cfg = dataclasses.replace(get_preset("llama-test"), **changes)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = materialize(build_model(cfg), cfg, 0, torch.device(device), dtype)
    if choices is not None:
        apply_kernels(model, choices)
    kernel = choices.cross_entropy if choices is not None else "auto"
    _OBJECTIVES[model] = LanguageModelObjective.build([model], cfg, Mesh(), torch.device(device), kernel)
    return model


def _ops_run(model) -> set[str]:
    """Names of the ops one forward and backward of `model` ran (after one unprofiled step, which compiles)."""
    x = torch.randint(0, model.cfg.vocab_size, (2, 32), device=model.head_weight().device)
    objective = _OBJECTIVES[model]
    objective.per_token(model(x), x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        objective.per_token(model(x), x).sum().backward()
    return {event.key for event in prof.key_averages()}


def _sdpa_kernels_run(model, device: str) -> set[str]:
    ran = _ops_run(model)
    return {backend for backend, op in SDPA_OPS[device].items() if op in ran}


@pytest.fixture
def compile_caches_on():
    """torch.compile's FX graph and autograd caches on, and the check that nothing turned them off."""
    with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(enable_autograd_cache=True):
        yield
        assert inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_two_models_in_one_process_each_run_their_own_attention_kernel(compiled, compile_caches_on):
    """SDPA's math kernel in one model, its CPU flash kernel in the other: both built (and compiled) before
    either runs, then run in turn, the first again last."""
    counters.clear()
    math, flash = _model(KernelChoices(attention="math")), _model(KernelChoices(attention="flash"))
    if compiled:
        apply_compile(math)
        apply_compile(flash)
    ran = [_sdpa_kernels_run(m, "cpu") for m in (math, flash, math)]
    expected_math = set() if compiled else {"math"}
    assert ran == [expected_math, {"flash"}, expected_math]
    assert not counters["graph_break"]  # sdpa_kernel is traced into each layer's graph


def test_auto_attention_takes_sdpa_s_own_pick():
    """auto (also a plain model's) sets no SDPA kernel: on CPU SDPA's pick is its flash kernel."""
    assert _sdpa_kernels_run(_model(None), "cpu") == _sdpa_kernels_run(_model(KernelChoices()), "cpu") == {"flash"}


def test_a_forced_sdpa_kernel_compiles_into_one_graph():
    """torch.compile traces sdpa_kernel (dynamo's SDPAKernelVariable) without a graph break, for each kernel."""
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):

        def attention(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        torch.testing.assert_close(torch.compile(attention, fullgraph=True, dynamic=False)(q, k, v), attention(q, k, v))


def test_each_layer_holds_its_choice_and_dispatches_to_it(monkeypatch):
    """The Triton switches: every layer holds its model's choice. On CPU auto runs the torch expressions; with
    kernels_on standing in for CUDA (Triton installed), a model's layers run the custom ops (their CPU kernels)
    exactly where its own choice is not torch, whatever the other model chose."""
    torch_everywhere = KernelChoices(swiglu="torch", rmsnorm="torch", rope="torch", cross_entropy="torch")
    models = {
        "torch": _model(torch_everywhere),
        "auto": _model(KernelChoices()),
        "torch norms": _model(KernelChoices(rmsnorm="torch")),
        "plain": _model(None),
    }
    norms = [m for m in models["torch norms"].modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 5 and {m.backend for m in norms} == {"torch"}  # both layers' two, and the final norm
    assert {layer.mlp.backend for layer in models["torch"].layers.values()} == {"torch"}
    assert {layer.attn.rope_backend for layer in models["auto"].layers.values()} == {"auto"}
    assert _OBJECTIVES[models["torch"]].per_token_loss.backend == "torch"
    assert _OBJECTIVES[models["plain"]].per_token_loss.backend == "auto"
    assert not _ops_run(models["auto"]) & set().union(*TRITON_OPS.values())  # CPU: the torch paths
    monkeypatch.setattr(triton_check, "kernels_on", lambda backend, x: backend != "torch")
    ran = {name: _ops_run(model) & set().union(*TRITON_OPS.values()) for name, model in models.items()}
    every = set().union(*TRITON_OPS.values())
    assert ran == {"torch": set(), "auto": every, "torch norms": every - TRITON_OPS["rmsnorm"], "plain": every}


def test_choices_come_from_the_resolved_config():
    """engine.build_engine's KernelChoices: kernel_settings.kernel_choices' resolved ones; "-" keeps auto."""
    resolved = KernelChoices(
        attention="fa4", swiglu="-", rmsnorm="-", rope="triton", cross_entropy="torch", adamw="triton"
    )
    assert resolved.in_layers() == KernelChoices(attention="fa4", rope="triton", cross_entropy="torch", adamw="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_two_models_on_gpu_each_run_their_own_sdpa_kernel(compiled, compile_caches_on):
    """--attention-backend flash / efficient / cudnn: three models in one process, each its own kernel, eager and
    inside compiled layers (head dim 64)."""
    backends = ("flash", "efficient", "cudnn")
    models = [_model(KernelChoices(attention=b), "cuda", hidden_size=256) for b in backends]
    if compiled:
        for model in models:
            apply_compile(model)
    assert [_sdpa_kernels_run(m, "cuda") for m in models] == [{b} for b in backends]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper or newer GPU"
)
def test_auto_attention_runs_cudnn_on_hopper(compile_caches_on):
    """auto adds nothing around SDPA: on Hopper its pick for bf16 causal GQA attention is cuDNN's kernel, as
    before kernels were per model (benchmarks/RESULTS.md)."""
    model = _model(None, "cuda", hidden_size=256)
    apply_compile(model)
    assert _sdpa_kernels_run(model, "cuda") == {"cudnn"}
