"""No host read in a mixture-of-experts layer's training step at ep 1 (issue 34: a read per layer stalls the GPU's
queue on fine-grained shapes). Routing (top-k, the sort by expert, the counts), the shared expert, the combine and
the router losses and statistics stay on the device, forward and backward, for every family's routing. The one
read is the experts' per-expert reference loop's (counts.tolist(): CPU, or a GPU dtype without grouped GEMMs); the
grouped GEMMs of CUDA bf16 replace it, which the GPU test checks with CUDA's own sync detector."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from llamatron.models import get_preset
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


def _training_layer(model: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> MoE:
    """One MoE layer of `model` set up as the engine sets it for training (router losses and statistics on)."""
    cfg = get_preset(model)
    torch.manual_seed(0)
    moe = MoE(cfg).to(device, dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe.router_loss_weight = torch.tensor(0.125, device=device)
    moe.stats = MoEStats.zeros(cfg.num_experts, torch.device(device))
    return moe


def _step(moe: MoE, x: torch.Tensor) -> None:
    out = moe(x)
    (out.float() * torch.linspace(-1, 1, out.numel(), device=x.device).view_as(out)).sum().backward()


@pytest.mark.parametrize("model", FAMILIES)
def test_an_ep1_moe_step_reads_the_host_only_in_the_experts_reference_loop(model):
    moe = _training_layer(model)
    x = torch.randn(2, 16, moe.router.in_features, requires_grad=True)
    recorder = _HostReads()
    with recorder, _Ops(recorder.reads):
        _step(moe, x)
    assert x.grad is not None and moe.router.weight.grad is not None
    assert moe.stats is not None and moe.stats.choices.sum() == x.shape[0] * x.shape[1] * moe.top_k
    elsewhere = [what for what, in_loop in recorder.reads if not in_loop]
    assert elsewhere == [], f"host reads outside the experts' reference loop: {elsewhere}"
    # the recorder sees reads: the loop's counts.tolist(), once for gate_up and once for down
    assert [what for what, _ in recorder.reads] == ["tolist", "tolist"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", FAMILIES)
def test_an_ep1_moe_step_on_cuda_never_synchronizes(model):
    """bf16 on CUDA (the grouped GEMMs): CUDA's sync detector raises on any device-to-host wait in the step."""
    moe = _training_layer(model, "cuda", torch.bfloat16)
    x = torch.randn(4, 256, moe.router.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _step(moe, x)  # warm-up: first calls may initialise libraries (cuBLAS handles, workspaces)
    torch.cuda.synchronize()
    moe.zero_grad()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(moe, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert moe.experts.gate_up.grad is not None and moe.experts.gate_up.grad.float().norm() > 0
