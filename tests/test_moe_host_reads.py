"""No host read in a mixture-of-experts model's training step at ep 1 (issue 34: a read per layer stalls the
GPU's queue on fine-grained shapes). Routing (top-k, the sort by expert, the counts), the shared expert, the combine
and the router losses and statistics stay on the device, forward and backward, for every family's routing, and so
does the rest of the model. The one read is the experts' per-expert reference loop's (counts.tolist(): CPU, or a
GPU dtype without grouped GEMMs); the grouped GEMMs of CUDA bf16 replace it, which the GPU test checks with CUDA's
own sync detector (torch.cuda.set_sync_debug_mode("error"))."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from llamatron.models import build_model, get_preset, materialize
from llamatron.models.moe import MoE, MoEStats

FAMILIES = ["mixtral-test", "qwen3-moe-test", "qwen2-moe-test", "llama4-test"]

# Tensor methods that read a value on the host (a device-to-host copy and a wait on CUDA)
_READ_METHODS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
_aten = torch.ops.aten
# Operators whose output size depends on the data (CUDA must read it back to allocate), or that read a scalar
_READ_OPS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim.default,
    _aten.repeat_interleave.Tensor,
    _aten.bincount.default,
}


def _inside_reference_loop() -> bool:
    """Whether the caller's stack passes through Experts.project's per-expert loop (the only allowed read)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "project" and frame.f_code.co_filename.endswith("moe.py"):
            return True
        frame = frame.f_back
    return False


class _HostReads(TorchFunctionMode):
    """Records each host read: Python-level methods here, data-dependent operators through `_Ops`."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, bool]] = []  # (what, inside the reference loop)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READ_METHODS:
            self.reads.append((name, _inside_reference_loop()))
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, reads: list[tuple[str, bool]]):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _READ_OPS:
            self.reads.append((str(func), _inside_reference_loop()))
        return func(*args, **(kwargs or {}))


def _training_model(model: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """`model` built whole (seed 0), its MoE layers set up as the engine sets them for training (router losses and
    statistics on)."""
    cfg = get_preset(model)
    built = materialize(build_model(cfg), cfg, 0, device, dtype)
    weight, stats = torch.tensor(0.125, device=device), MoEStats.zeros(cfg.num_experts, torch.device(device))
    for m in built.modules():
        if isinstance(m, MoE):
            m.router_loss_weight, m.stats = weight, stats  # one step's, shared by the layers
    return built


def _step(model: nn.Module, tokens: torch.Tensor) -> None:
    logits = model(tokens)
    (logits.float() * torch.linspace(-1, 1, logits.numel(), device=tokens.device).view_as(logits)).sum().backward()


def _moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("name", FAMILIES)
def test_an_ep1_moe_step_reads_the_host_only_in_the_experts_reference_loop(name):
    """The whole model's forward and backward (attention, norms and dense layers included)."""
    model = _training_model(name)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    recorder = _HostReads()
    with recorder, _Ops(recorder.reads):
        _step(model, tokens)
    layers = _moe_layers(model)
    for moe in layers:
        assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
        assert moe.stats is not None and moe.stats.choices.sum() == tokens.numel() * moe.top_k * len(layers)
    elsewhere = [what for what, in_loop in recorder.reads if not in_loop]
    assert elsewhere == [], f"host reads outside the experts' reference loop: {elsewhere}"
    # the recorder sees reads: the loop's counts.tolist(), for gate_up and for down, in each MoE layer
    assert [what for what, _ in recorder.reads] == ["tolist"] * (2 * len(layers))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("scope", ["moe layer", "model"])
def test_an_ep1_moe_step_on_cuda_never_synchronizes(name, scope):
    """bf16 on CUDA (the grouped GEMMs): CUDA's sync detector raises on any device-to-host wait in the step of one
    MoE layer, and of the whole model (its attention and loss kernels too)."""
    model = _training_model(name, "cuda", torch.bfloat16)
    tokens = torch.randint(0, model.cfg.vocab_size, (4, 256), device="cuda")
    if scope == "moe layer":
        layer = _moe_layers(model)[0]
        x = torch.randn(4, 256, layer.router.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step() -> None:
            out = layer(x)
            (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
    else:

        def step() -> None:
            _step(model, tokens)

    step()  # warm-up: first calls may initialise libraries (cuBLAS handles, workspaces, compiled masks)
    torch.cuda.synchronize()
    model.zero_grad()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    grads = [m.experts.gate_up.grad for m in _moe_layers(model)]
    assert any(g is not None and g.float().norm() > 0 for g in grads)
