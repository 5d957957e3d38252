"""RMSNorm, optionally after the residual add that precedes it, as one Triton kernel each way on CUDA.

Why: torch.compile splits the norm's backward into a row kernel and a weight-gradient reduction over all
rows (3.97 + 2.57 + 0.42 ms of a llama-1b step on an H200, benchmarks/RESULTS.md run 4), and the model's
final norm runs outside the compiled layers as seven eager kernels. Here the backward kernel accumulates
the weight gradient of its rows while it writes the input gradient, so each row is read once.

Same arithmetic as `layers.RMSNorm`: normalise in fp32, round to the input dtype, then scale by the
weight; with a residual, x + delta is rounded to the input dtype before it is normalised (as the
unfused `x + delta` is). Torch custom ops, so a compiled layer stays one graph; autograd saves the
normalised input (x + delta) and one fp32 reciprocal RMS per row. Off CUDA, or with backend "torch",
the plain expression runs.
"""

from __future__ import annotations

import functools

import torch


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


# ---- custom ops -----------------------------------------------------------------------------------


@torch.library.custom_op("llamatron::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * normalised x, 1/rms per row)."""
    x = x.contiguous()
    y, rstd = torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)
    _forward(x, None, weight, None, y, rstd, eps)
    return y, rstd


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("llamatron::add_rms_norm", mutates_args=())
def add_rms_norm_op(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + delta, weight * normalised (x + delta), 1/rms per row)."""
    x, delta = x.contiguous(), delta.contiguous()
    h, y, rstd = torch.empty_like(x), torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)
    _forward(x, delta, weight, h, y, rstd, eps)
    return h, y, rstd


@add_rms_norm_op.register_fake
def _(x, delta, weight, eps):
    like = torch.empty_like(x, memory_format=torch.contiguous_format)
    return like, torch.empty_like(like), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("llamatron::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    grad_y: torch.Tensor, grad_h: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of the normalised input, plus grad_h when given; weight gradient)."""
    grad_y, h = grad_y.contiguous(), h.contiguous()
    grad_h = None if grad_h is None else grad_h.contiguous()
    dx = torch.empty_like(h)
    dw = _backward(grad_y, grad_h, h, weight, rstd, dx)
    return dx, dw


@rms_norm_backward_op.register_fake
def _(grad_y, grad_h, h, weight, rstd):
    return torch.empty_like(h, memory_format=torch.contiguous_format), torch.empty_like(weight)


@rms_norm_op.register_kernel("cpu")
def _(x, weight, eps):
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
    return weight * (x32 * rstd[..., None]).to(x.dtype), rstd


@add_rms_norm_op.register_kernel("cpu")
def _(x, delta, weight, eps):
    h = x + delta
    y, rstd = rms_norm_op(h, weight, eps)
    return h, y, rstd


@rms_norm_backward_op.register_kernel("cpu")
def _(grad_y, grad_h, h, weight, rstd):
    # The derivative the Triton kernel computes, written out (tests check it against autograd of the plain form).
    normed = h.float() * rstd[..., None]
    dw = (grad_y.float() * normed.to(h.dtype).float()).flatten(0, -2).sum(0)
    dn = (grad_y * weight).float()
    dx = rstd[..., None] * (dn - normed * (dn * normed).mean(-1, keepdim=True))
    if grad_h is not None:
        dx = dx + grad_h.float()
    return dx.to(h.dtype), dw.to(weight.dtype)


def _save_norm_input(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_backward(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(grad_y, None, x, weight, rstd)
    return dx, dw, None


def _save_sum(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[0], inputs[2], output[2])


def _add_rms_norm_backward(ctx, grad_h, grad_y, _grad_rstd):
    h, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(grad_y, grad_h, h, weight, rstd)
    return dx, dx, dw, None


rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_save_norm_input)
add_rms_norm_op.register_autograd(_add_rms_norm_backward, setup_context=_save_sum)


# ---- Triton kernels (built on first CUDA use: CPU installs need no Triton) -------------------------

_BACKWARD_PROGRAMS = 512  # each accumulates the weight gradient of its rows; the partial sums are added after


def _forward(x, delta, weight, h, y, rstd, eps: float) -> None:
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if rows == 0:
        return
    fwd, _ = _kernels()
    block = _block(cols)
    fwd[(rows,)](
        x,
        delta if delta is not None else x,
        weight,
        h if h is not None else y,
        y,
        rstd,
        cols,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK=block,
        num_warps=_warps(block),
    )


def _backward(grad_y, grad_h, h, weight, rstd, dx) -> torch.Tensor:
    cols = h.shape[-1]
    rows = h.numel() // cols if cols else 0
    if rows == 0:
        return torch.zeros_like(weight)
    _, bwd = _kernels()
    programs = min(rows, _BACKWARD_PROGRAMS)
    rows_per_program = -(-rows // programs)
    partial = torch.empty(programs, cols, device=h.device, dtype=torch.float32)
    block = _block(cols)
    bwd[(programs,)](
        grad_y,
        grad_h if grad_h is not None else grad_y,
        h,
        weight,
        rstd,
        dx,
        partial,
        rows,
        cols,
        rows_per_program,
        HAS_GRAD_H=grad_h is not None,
        BLOCK=block,
        num_warps=_warps(block),
    )
    return partial.sum(0).to(weight.dtype)


def _block(cols: int) -> int:
    return 1 << max(cols - 1, 1).bit_length()


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_forward_kernel(
        x_ptr, delta_ptr, w_ptr, h_ptr, y_ptr, rstd_ptr, cols, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * cols + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            x = x.to(tl.float32) + tl.load(delta_ptr + row * cols + offs, mask=mask, other=0.0).to(tl.float32)
            x = x.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * cols + offs, x, mask=mask)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / cols + eps)
        tl.store(rstd_ptr + row, rstd)
        normed = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * cols + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rms_norm_backward_kernel(
        dy_ptr,
        dh_ptr,
        h_ptr,
        w_ptr,
        rstd_ptr,
        dx_ptr,
        dw_ptr,
        rows,
        cols,
        rows_per_program,
        HAS_GRAD_H: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        program = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        first = program.to(tl.int64) * rows_per_program
        for i in range(0, rows_per_program):
            row = first + i
            # past the last row: h and dy read as 0, so nothing is added or written (a block-wide compare:
            # Triton's interpreter rejects a scalar one in a mask)
            m = mask & ((tl.zeros([BLOCK], dtype=tl.int64) + row) < rows)
            h = tl.load(h_ptr + row * cols + offs, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * cols + offs, mask=m, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + tl.minimum(row, rows - 1))
            normed = h * rstd
            dw += dy * normed.to(dx_ptr.dtype.element_ty).to(tl.float32)
            dn = (dy * w).to(dx_ptr.dtype.element_ty).to(tl.float32)  # the unfused product is rounded too
            dx = rstd * (dn - normed * (tl.sum(dn * normed, axis=0) / cols))
            if HAS_GRAD_H:
                dx += tl.load(dh_ptr + row * cols + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * cols + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
        tl.store(dw_ptr + program * cols + offs, dw, mask=mask)

    return rms_norm_forward_kernel, rms_norm_backward_kernel
