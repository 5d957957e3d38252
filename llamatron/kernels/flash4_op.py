"""Causal attention through FlashAttention 4's Hopper/Blackwell kernels (`pip install flash-attn-4`), opt-in.

Why: on an H200, SDPA's best kernel (cuDNN) runs llama-1b's causal GQA attention at ~375 TFLOP/s and takes a
quarter of the step (benchmarks/RESULTS.md). FlashAttention 4 (CuTe DSL, compiled on first use) carries
FA3's Hopper tiles; `--attention-backend fa4` selects it where it is faster.

The kernels take (batch, seq, heads, dim) tensors, the layout the QKV projection writes, so no transposed
copies are needed. Wrapped as torch custom ops so torch.compile keeps each layer one graph; autograd saves
q, k, v, the output and the log-sum-exp, as the flash kernels need.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

# Head dims whose kernels FlashAttention 4 tunes on Hopper. Others are not refused by it but can be wrong:
# on an H200 its backward gave gradients 20-50% off for head dim 16 (64 agreed with fp32 SDPA to 0.3%).
SUPPORTED_HEAD_DIMS = (64, 96, 128)


def available() -> bool:
    """flash-attn-4 is installed and its interface imports (once per process: seconds of imports); a broken
    install counts as not installed."""
    return unavailable_reason() is None


@functools.cache
def unavailable_reason() -> str | None:
    """None when FlashAttention 4's interface imports; else why not (not installed, or the import error: a
    flash_attn package whose CuTe DSL dependency is missing finds `flash_attn.cute` but cannot import it)."""
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:
        found = False
    except Exception as e:  # a flash_attn package that fails to import (e.g. a FlashAttention 2 build)
        return f"importing flash_attn failed: {type(e).__name__}: {e}"
    if not found:
        return "flash_attn.cute is not installed"
    try:
        importlib.import_module("flash_attn.cute.interface")
    except Exception as e:  # e.g. a FlashAttention 2 build, or no cutlass
        return f"importing flash_attn.cute failed: {type(e).__name__}: {e}"
    return None


def fa4_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Causal attention of (batch, seq, heads, dim) tensors; k, v may have fewer heads (GQA/MQA). With a window,
    query i sees keys i - window < j <= i (FA4's local attention: it skips the blocks outside)."""
    return fa4_attention(q, k, v, -1 if window is None else window)[0]


def _window_left(window: int) -> int | None:
    """FlashAttention's window_size_left counts the keys before the query's own: window - 1 (None: unbounded)."""
    return None if window < 0 else window - 1


@torch.library.custom_op("llamatron::fa4_attention", mutates_args=(), device_types="cuda")
def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    left = _window_left(window)
    out, lse, *_ = _flash_attn_fwd(q, k, v, causal=True, window_size_left=left, return_lse=True)
    return out, lse


@fa4_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq, heads, _ = q.shape
    out = q.new_empty((batch, seq, heads, v.shape[-1]))
    return out, q.new_empty((batch, heads, seq), dtype=torch.float32)


@torch.library.custom_op("llamatron::fa4_attention_backward", mutates_args=(), device_types="cuda")
def _fa4_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    # Contiguous gradients whatever the inputs' strides: the fake below promises that layout to torch.compile
    # (the kernel's own choice, empty_like(input), follows strides that compiled code may pass differently).
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    dq, dk, dv = _flash_attn_bwd(
        q,
        k,
        v,
        out,
        grad_out.contiguous(),
        lse,
        causal=True,
        window_size_left=_window_left(window),
        dq=grads[0],
        dk=grads[1],
        dv=grads[2],
    )[:3]
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_fa4_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, window):
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.window = window


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*_fa4_attention_backward(grad_out, q, k, v, out, lse, ctx.window), None)


fa4_attention.register_autograd(_backward, setup_context=_setup_context)
