"""silu(gate) * up of a fused [gate; up] projection, with a Triton kernel for each direction on CUDA.

Why: torch.compile's backward of this product (one kernel writing the two halves of the input gradient
from separate index ranges) ran at ~2 TB/s by our byte count on an H200, 14.1 of 366 ms per llama-1b step.
The kernel here reads gate, up and the output gradient once per program and writes both halves from it:
7.2 ms (benchmarks/RESULTS.md, run 3).

`swiglu(gate_up)` is a torch custom op: torch.compile treats it as one opaque call (no graph break), and
autograd saves only `gate_up`, as the compiled version does. Off CUDA, or with backend "torch", it is the
plain expression.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import triton_check


def swiglu(gate_up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up, where gate_up = [gate | up] along the last dimension; `backend`: the layer's choice."""
    if triton_check.kernels_on(backend, gate_up):
        return swiglu_op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # (swiglu_op's CPU kernel is for tests)
    return F.silu(gate) * up


# ---- the custom op (CUDA) -------------------------------------------------------------------------


@torch.library.custom_op("llamatron::swiglu", mutates_args=())
def swiglu_op(gate_up: torch.Tensor) -> torch.Tensor:
    x = gate_up.contiguous()
    ffn = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], ffn))
    rows = x.numel() // x.shape[-1]
    if rows:
        _kernels().forward(x, out, rows, ffn)
    return out


@swiglu_op.register_fake
def _(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("llamatron::swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad_out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    x, dy = gate_up.contiguous(), grad_out.contiguous()
    ffn = x.shape[-1] // 2
    dx = torch.empty_like(x)
    rows = x.numel() // x.shape[-1]
    if rows:
        _kernels().backward(x, dy, dx, rows, ffn)
    return dx


@_swiglu_backward_op.register_fake
def _(grad_out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate_up)


@swiglu_op.register_kernel("cpu")
def _(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@_swiglu_backward_op.register_kernel("cpu")
def _(grad_out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    # The derivative the Triton kernel computes, written out (tests check it against autograd of the plain form).
    gate, up = gate_up.float().chunk(2, dim=-1)
    dy, sig = grad_out.float(), torch.sigmoid(gate)
    dgate = dy * up * sig * (1 + gate * (1 - sig))
    return torch.cat([dgate, dy * gate * sig], dim=-1).to(gate_up.dtype)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad_out):
    (gate_up,) = ctx.saved_tensors
    return _swiglu_backward_op(grad_out, gate_up)


swiglu_op.register_autograd(_backward, setup_context=_setup_context)


# ---- Triton kernels (imported on first CUDA use: CPU installs need no Triton) --------------------

_BLOCK = 1024


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_forward_kernel(x_ptr, out_ptr, ffn, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < ffn
        gate = tl.load(x_ptr + row * 2 * ffn + cols, mask=mask).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * ffn + ffn + cols, mask=mask).to(tl.float32)
        silu = gate * tl.sigmoid(gate)
        tl.store(out_ptr + row * ffn + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_backward_kernel(x_ptr, dy_ptr, dx_ptr, ffn, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < ffn
        gate = tl.load(x_ptr + row * 2 * ffn + cols, mask=mask).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * ffn + ffn + cols, mask=mask).to(tl.float32)
        dy = tl.load(dy_ptr + row * ffn + cols, mask=mask).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        dgate = dy * up * sig * (1.0 + gate * (1.0 - sig))
        out_ty = dx_ptr.dtype.element_ty
        tl.store(dx_ptr + row * 2 * ffn + cols, dgate.to(out_ty), mask=mask)
        tl.store(dx_ptr + row * 2 * ffn + ffn + cols, (dy * silu).to(out_ty), mask=mask)

    class Kernels:
        @staticmethod
        def forward(x, out, rows, ffn):
            swiglu_forward_kernel[(rows, triton.cdiv(ffn, _BLOCK))](x, out, ffn, BLOCK=_BLOCK, num_warps=4)

        @staticmethod
        def backward(x, dy, dx, rows, ffn):
            swiglu_backward_kernel[(rows, triton.cdiv(ffn, _BLOCK))](x, dy, dx, ffn, BLOCK=_BLOCK, num_warps=4)

    return Kernels
