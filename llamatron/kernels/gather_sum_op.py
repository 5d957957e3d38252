"""out[t] = sum over j < k of w[t, j] * rows[index[t * k + j]]: k rows gathered per token, weighted, summed.

A mixture of experts' combine (each token's k expert outputs, read where they were sorted to) and its
permutation's backward (each token's k gradient rows, unweighted) are this op. Why a kernel: torch.compile's
kernels for both ran at ~0.8 TB/s by our byte count on an H200, 46 of a 515 ms fine-grained MoE step
(benchmarks/RESULTS.md, run 23); a gather of whole rows is bandwidth-bound, and the kernel here reads each row
once, in blocks, accumulating in fp32 with one rounding at the end (as the compiled expression does).

`gather_sum(rows, index, weights, k)` runs it as a torch custom op on CUDA with Triton (torch.compile sees one
opaque call); elsewhere it is the plain expression.
"""

from __future__ import annotations

import functools

import torch

from . import triton_check


def gather_sum(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, k: int) -> torch.Tensor:
    """(index.numel() // k, hidden): each token's k rows of `rows` (hidden wide) at `index`, times `weights`
    (tokens, k) when given, summed."""
    if triton_check.kernels_on("auto", rows):
        return gather_sum_op(rows, index, weights, k)
    gathered = rows[index].view(-1, k, rows.shape[-1])
    return (gathered if weights is None else gathered * weights.unsqueeze(-1)).sum(1)


@torch.library.custom_op("llamatron::gather_sum", mutates_args=())
def gather_sum_op(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, k: int) -> torch.Tensor:
    rows, index = rows.contiguous(), index.contiguous()
    tokens, hidden = index.numel() // k, rows.shape[-1]
    out = rows.new_empty((tokens, hidden))
    if tokens and hidden:
        _kernels().run(rows, index, None if weights is None else weights.contiguous(), out, k)
    return out


@gather_sum_op.register_fake
def _(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, k: int) -> torch.Tensor:
    return rows.new_empty((index.numel() // k, rows.shape[-1]))


@gather_sum_op.register_kernel("cpu")
def _(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, k: int) -> torch.Tensor:
    # The kernel's arithmetic written out (products and sum in fp32, or fp64 for fp64 rows; one rounding): for tests
    wide = torch.promote_types(rows.dtype, torch.float32)
    gathered = rows.to(wide)[index].view(-1, k, rows.shape[-1])
    if weights is not None:
        gathered = gathered * weights.to(wide).unsqueeze(-1)
    return gathered.sum(1).to(rows.dtype)


# ---- Triton kernel (imported on first CUDA use: CPU installs need no Triton) --------------------

_BLOCK = 1024


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_sum_kernel(
        rows_ptr, index_ptr, weights_ptr, out_ptr, hidden, K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr
    ):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            source = tl.load(index_ptr + token * K + j).to(tl.int64)
            row = tl.load(rows_ptr + source * hidden + cols, mask=mask).to(tl.float32)
            if WEIGHTED:
                row = row * tl.load(weights_ptr + token * K + j).to(tl.float32)
            acc += row
        tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    class Kernels:
        @staticmethod
        def run(rows, index, weights, out, k):
            tokens, hidden = out.shape
            grid = (tokens, triton.cdiv(hidden, _BLOCK))
            weighted = weights is not None
            gather_sum_kernel[grid](
                rows, index, weights if weighted else rows, out, hidden, K=k, WEIGHTED=weighted, BLOCK=_BLOCK
            )

    return Kernels
