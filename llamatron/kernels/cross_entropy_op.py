"""Per-token cross-entropy of (..., vocab) logits, with a Triton kernel for each direction on CUDA.

Why: torch.compile's loss (fp32 upcast, log-softmax, NLL) took 1.81 ms forward and 1.56 ms backward of a
llama-1b step on an H200 (benchmarks/RESULTS.md, run 5 profile): its forward moved the 2.1 GB of bf16 logits
at ~1.2 TB/s. The forward kernel here reads each row once (a running max and sum of exponentials, and the
label's logit) and keeps the fp32 log-sum-exp; the backward reads the row again and writes the gradient
(softmax - one-hot) * incoming gradient in the logits' dtype. No fp32 copy of the logits exists.

`cross_entropy_op(logits, labels)` is a torch custom op (one opaque call under torch.compile). A label of
IGNORE_INDEX gives loss 0 and a zero gradient row; a label outside [0, vocab) gives NaN (torch asserts on the
device), which the step's non-finite check then skips. Off CUDA, or with backend "torch", the loss is
torch's own cross-entropy (fp32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import triton_check

IGNORE_INDEX = -100


def cross_entropy_per_token(logits: torch.Tensor, labels: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """fp32 loss per token, 0 where labels == IGNORE_INDEX; `backend`: auto, triton or torch."""
    if triton_check.kernels_on(backend, logits):
        return cross_entropy_op(logits, labels)[0]
    return reference_cross_entropy(logits, labels)


@dataclass(frozen=True)
class CrossEntropy:
    """The per-token loss of one device, holding the run's choice of kernels (the language-model objective's, where
    tensor parallelism does not split the vocabulary)."""

    backend: str = "auto"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_per_token(logits, labels, self.backend)


def reference_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return loss.view(labels.shape)


# ---- the custom ops ---------------------------------------------------------------------------------


def _check_shapes(logits: torch.Tensor, labels: torch.Tensor) -> None:
    torch._check(
        labels.shape == logits.shape[:-1],
        lambda: f"cross-entropy: labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}",
    )


@torch.library.custom_op("llamatron::cross_entropy", mutates_args=())
def cross_entropy_op(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per token, fp32, shaped like labels; log-sum-exp per row, fp32, not differentiable)."""
    _check_shapes(logits, labels)
    x, y = logits.reshape(-1, logits.shape[-1]).contiguous(), labels.reshape(-1).contiguous()
    loss = torch.empty(labels.shape, dtype=torch.float32, device=x.device)
    lse = torch.empty(y.shape, dtype=torch.float32, device=x.device)
    if y.numel():
        _kernels().forward(x, y, loss.view(-1), lse)
    return loss, lse


@cross_entropy_op.register_fake
def _(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_shapes(logits, labels)
    loss = logits.new_empty(labels.shape, dtype=torch.float32)
    return loss, logits.new_empty((labels.numel(),), dtype=torch.float32)


@torch.library.custom_op("llamatron::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward_op(
    grad_loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    _check_shapes(logits, labels)
    x, y = logits.reshape(-1, logits.shape[-1]).contiguous(), labels.reshape(-1).contiguous()
    dx = torch.empty_like(x)
    if y.numel():
        _kernels().backward(x, y, lse, grad_loss.reshape(-1).float().contiguous(), dx)
    return dx.view(logits.shape)


@_cross_entropy_backward_op.register_fake
def _(grad_loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape)  # contiguous, as the kernel writes it, whatever the input's strides


@cross_entropy_op.register_kernel("cpu")
def _(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # What the Triton kernel computes, written out (tests check it and its gradient against torch's loss).
    _check_shapes(logits, labels)
    x, y = logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
    lse = torch.logsumexp(x, dim=-1)
    in_range = (y >= 0) & (y < x.shape[-1])
    target = x.gather(1, torch.where(in_range, y, 0)[:, None])[:, 0]
    loss = torch.where(in_range, lse - target, float("nan"))
    return torch.where(y == IGNORE_INDEX, 0.0, loss).view(labels.shape), lse


@_cross_entropy_backward_op.register_kernel("cpu")
def _(grad_loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    x, y = logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
    in_range = (y >= 0) & (y < x.shape[-1])
    g = torch.where(y == IGNORE_INDEX, 0.0, grad_loss.reshape(-1).float())
    g = torch.where(in_range | (y == IGNORE_INDEX), g, float("nan"))
    dx = torch.exp(x - lse[:, None])
    dx[in_range, y[in_range]] -= 1.0
    return (dx * g[:, None]).to(logits.dtype).view(logits.shape)


def _setup_context(ctx, inputs, output) -> None:
    logits, labels = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.mark_non_differentiable(output[1])  # the backward has no term for a gradient of the log-sum-exp


def _backward(ctx, grad_loss, _grad_lse):
    logits, labels, lse = ctx.saved_tensors
    return _cross_entropy_backward_op(grad_loss, logits, labels, lse), None


cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


# ---- Triton kernels (imported on first CUDA use: CPU installs need no Triton) --------------------

_FORWARD_BLOCK = 4096  # a row is read in chunks of this many logits
_BACKWARD_BLOCK = 4096


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def cross_entropy_forward_kernel(x_ptr, labels_ptr, loss_ptr, lse_ptr, vocab, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * vocab
        running_max = tl.full([], float("-inf"), tl.float32)
        running_sum = tl.full([], 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            # while every logit so far is -inf (a masked vocabulary), exp(-inf - -inf) would be NaN
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        label = tl.load(labels_ptr + row)
        in_range = (label >= 0) & (label < vocab)
        target = tl.load(base + tl.where(in_range, label, 0)).to(tl.float32)
        loss = tl.where(in_range, lse - target, float("nan"))
        tl.store(loss_ptr + row, tl.where(label == ignore_index, 0.0, loss))
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def cross_entropy_backward_kernel(
        x_ptr, labels_ptr, lse_ptr, grad_ptr, dx_ptr, vocab, ignore_index, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < vocab
        label = tl.load(labels_ptr + row)
        g = tl.where(label == ignore_index, 0.0, tl.load(grad_ptr + row))
        # a label outside the vocabulary poisons the gradient too, so the step's non-finite check skips it
        g = tl.where((label != ignore_index) & ((label < 0) | (label >= vocab)), float("nan"), g)
        x = tl.load(x_ptr + row * vocab + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - tl.load(lse_ptr + row))
        dx = (p - tl.where(cols == label, 1.0, 0.0)) * g
        tl.store(dx_ptr + row * vocab + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)

    class Kernels:
        @staticmethod
        def forward(x, labels, loss, lse):
            rows, vocab = x.shape
            cross_entropy_forward_kernel[(rows,)](
                x, labels, loss, lse, vocab, IGNORE_INDEX, BLOCK=_FORWARD_BLOCK, num_warps=8
            )

        @staticmethod
        def backward(x, labels, lse, grad, dx):
            rows, vocab = x.shape
            grid = (rows, triton.cdiv(vocab, _BACKWARD_BLOCK))
            cross_entropy_backward_kernel[grid](
                x, labels, lse, grad, dx, vocab, IGNORE_INDEX, BLOCK=_BACKWARD_BLOCK, num_warps=8
            )

    return Kernels
