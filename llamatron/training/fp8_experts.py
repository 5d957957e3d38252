"""FP8 for a mixture of experts' grouped GEMMs (--fp8 with --fp8-experts, its default): torchao's MoE FP8 recipe.

What runs FP8 (e4m3, dynamic scales): each expert matmul (gate_up, down), forward and both backward GEMMs, as
torchao.prototype.moe_training's `fp8_rowwise` recipe scales them:
- forward x @ W_e^T: x per row (over its features), W_e per output feature (over its inputs);
- input gradient g @ W_e: g per row, W_e per input feature (over its outputs);
- weight gradient g_e^T @ x_e: g and x per column, over each expert's own rows.
Every scale is fp8_max / amax rounded down to a power of two. It is rowwise whichever recipe --fp8 gives the dense
linears: torchao has no tensorwise grouped GEMM.

On the GPU it runs what torchao's differentiable `_to_fp8_rowwise_then_scaled_grouped_mm` runs (the function
torchao's MoE training tensor subclass sends torch._grouped_mm to): torchao's Triton quantisation kernels and
torch._scaled_grouped_mm (compute capability 9.0 or 10.0), written out here for one difference: the two gradient
GEMMs accumulate in full precision (`use_fast_accum=False`, as torchao.float8's rowwise recipe for linears), the
forward fast. Not the subclass: it replaces the weights' data with a wrapper, which llamatron's flat gradient
buffers, distributed optimizer and checkpoints would then hold; called directly, the parameters stay plain
bf16/fp32 tensors (fp8.py calls torchao's FP8 matmul for its tensor-parallel layers for the same reason).

Groups of 16: FP8 grouped GEMMs take expert groups of a multiple of 16 rows, and torchao 0.18's own padding is not
implemented (it asserts it off). So each expert's rows are copied into a zero-filled buffer of a size fixed by the
shapes alone (rows + 16 per expert, rounded up to 16: no host read, so it compiles), every group starting at a
multiple of 16, at least 16 rows long, and the last one running to the buffer's end; the output is read back at
the rows' places. Zero rows change no scale and add nothing to a weight gradient.

Emulation (--fp8-emulate; the CPU tests): the same scales and e4m3 rounding, dequantised, the GEMMs in fp32 one
expert at a time, the output rounded to the input's dtype (torchao's is bf16).

Expert parallelism runs its own backward for gate_up (parallel/expert.py): `input_grad` and `weight_grad` are the
two backward GEMMs on their own, quantised as above, so ep computes what one process does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

FP8_GROUP_ROWS = 16  # torch._scaled_grouped_mm's alignment of an expert's rows
FP8 = torch.float8_e4m3fn  # torchao's fp8_rowwise recipe: e4m3 for inputs, weights and gradients alike
_FP8_MAX = torch.finfo(FP8).max
_AMAX_FLOOR = 1e-12  # torchao's: an all-zero row gets a finite scale


@dataclass
class PaddedGroups:
    """Where an expert-sorted block of rows goes in a buffer whose expert groups are multiples of 16 rows."""

    index: torch.Tensor  # (rows,) each row's place in the buffer
    offsets: torch.Tensor  # (experts,) int32: the end of each expert's group; the last is the buffer's size
    size: int  # the buffer's rows: fixed by the shapes, not by the counts


def padded_groups(counts: torch.Tensor, rows: int, multiple: int = FP8_GROUP_ROWS) -> PaddedGroups:
    """`counts[e]` rows for expert e, in order, padded to groups of `multiple`, on the device (no host read)."""
    counts = counts.long()
    experts = counts.numel()
    size = -(-(rows + experts * multiple) // multiple) * multiple
    # an expert without rows gets a group of zeros too: no GEMM meets an empty group (whose output a kernel may
    # leave unwritten)
    padded = ((counts + multiple - 1) // multiple).clamp(min=1) * multiple
    ends = torch.cumsum(padded, 0)
    offsets = torch.cat([ends[:-1], ends.new_full((1,), size)]).to(torch.int32)
    expert = torch.repeat_interleave(torch.arange(experts, device=counts.device), counts, output_size=rows)
    shift = (ends - padded) - (torch.cumsum(counts, 0) - counts)  # each group's start: padded minus packed
    return PaddedGroups(torch.arange(rows, device=counts.device) + shift[expert], offsets, size)


def pad(x: torch.Tensor, groups: PaddedGroups) -> torch.Tensor:
    return x.new_zeros((groups.size, x.shape[1])).index_copy(0, groups.index, x)


def unpad(x: torch.Tensor, groups: PaddedGroups) -> torch.Tensor:
    return _Unpad.apply(x, groups.index)


class _Unpad(torch.autograd.Function):
    """x.index_select(0, index) whose backward writes each row once into zeros (index_copy): the indices are
    distinct, so autograd's index_add (atomic adds) is not needed; it was 72 ms of a fine-grained FP8 step (session
    46's profile)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.new_zeros((ctx.rows, *grad.shape[1:])).index_copy(0, index, grad), None


# ---- the emulation: torchao's quantisation written out, the GEMMs in fp32 ----


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp8_max / amax (in float64, as torchao's kernels), rounded down to a power of two, as float32."""
    scale = (_FP8_MAX / amax.double().clamp(min=_AMAX_FLOOR)).float()
    return torch.exp2(torch.floor(torch.log2(scale)))


def quantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t scaled and rounded to e4m3, saturating, then back to fp32 and unscaled (exact: scales are powers of 2)."""
    return (t.float() * scale).clamp(-_FP8_MAX, _FP8_MAX).to(FP8).float() / scale


def _scaled_over(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t through FP8 with a scale for each slice along `dim` (the amax taken over dim)."""
    return quantize(t, fp8_scale(t.detach().abs().amax(dim, keepdim=True).float()))


def _scaled_per_group_column(t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """t (rows, features) through FP8 with a scale per (expert group, column): the amax over the group's rows."""
    group = torch.searchsorted(offsets, torch.arange(t.shape[0], device=t.device, dtype=offsets.dtype), right=True)
    magnitude = t.detach().abs().float()
    amax = magnitude.new_zeros((offsets.numel(), t.shape[1]))
    amax = amax.scatter_reduce(0, group.long().unsqueeze(1).expand_as(magnitude), magnitude, "amax")
    return quantize(t, fp8_scale(amax)[group])


def _bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends))


def emulated_forward(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (rows, in) sorted into groups, weight (experts, out, in): each group's x @ W_e^T, in FP8's numerics."""
    xq, wq = _scaled_over(x, -1), _scaled_over(weight, -1)  # W_e: a scale per output feature, over its inputs
    out = xq.new_zeros((x.shape[0], weight.shape[1]))
    for e, (start, end) in enumerate(_bounds(offsets)):
        out[start:end] = xq[start:end] @ wq[e].t()
    return out.to(x.dtype)


def emulated_input_grad(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grad (rows, out): each group's grad @ W_e (rows, in)."""
    gq, wq = _scaled_over(grad, -1), _scaled_over(weight, -2)  # W_e: a scale per input feature, over its outputs
    out = gq.new_zeros((grad.shape[0], weight.shape[2]))
    for e, (start, end) in enumerate(_bounds(offsets)):
        out[start:end] = gq[start:end] @ wq[e]
    return out.to(grad.dtype)


def emulated_weight_grad(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(experts, out, in): each group's grad^T @ x."""
    gq, xq = _scaled_per_group_column(grad, offsets), _scaled_per_group_column(x, offsets)
    out = gq.new_zeros((offsets.numel(), grad.shape[1], x.shape[1]))
    for e, (start, end) in enumerate(_bounds(offsets)):
        out[e] = gq[start:end].t() @ xq[start:end]
    return out.to(grad.dtype)


# ---- on FP8 tensor cores: torchao's quantisation kernels, torch._scaled_grouped_mm ----

# torchao.prototype.moe_training.kernels, looked up by FP8GroupedMM (eagerly, before torch.compile traces a call)
_kernels: Any = None


def _load_kernels() -> None:
    global _kernels
    if _kernels is None:
        from torchao.prototype.moe_training import kernels

        _kernels = kernels


def _scaled_grouped_mm(a8, b8, a_scale, b_scale, offsets, fast_accumulation: bool) -> torch.Tensor:
    # the scales are fp8_max / amax: the GEMM takes their reciprocals
    return torch._scaled_grouped_mm(
        a8,
        b8,
        a_scale.reciprocal(),
        b_scale.reciprocal(),
        offsets,
        out_dtype=torch.bfloat16,
        use_fast_accum=fast_accumulation,
    )


def _fp8_forward(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each group's x @ W_e^T: x per row, W_e per output feature; fast accumulation (as torchao.float8's forward)."""
    x8, x_scale = _kernels.triton_fp8_rowwise_2d_scale_and_cast(x, output_dtype=FP8, round_scales_to_power_of_2=True)
    # weight.transpose: (experts, in, out), column-major per expert, the layout the right operand takes
    w8, w_scale = _kernels.triton_fp8_colwise_3d_scale_and_cast(
        weight.transpose(-2, -1), output_dtype=FP8, round_scales_to_power_of_2=True
    )
    return _scaled_grouped_mm(x8, w8, x_scale.squeeze(-1), w_scale.squeeze(1), offsets, fast_accumulation=True)


def _fp8_input_grad(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each group's grad @ W_e: grad per row, W_e per input feature; full-precision accumulation."""
    g8, g_scale = _kernels.triton_fp8_rowwise_2d_scale_and_cast(grad, output_dtype=FP8, round_scales_to_power_of_2=True)
    w8, w_scale = _kernels.triton_fp8_rowwise_3d_transpose_rhs(
        weight.transpose(-2, -1), output_dtype=FP8, round_scales_to_power_of_2=True
    )
    return _scaled_grouped_mm(g8, w8, g_scale.squeeze(-1), w_scale.squeeze(1), offsets, fast_accumulation=False)


def _fp8_weight_grad(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(experts, out, in): each group's grad^T @ x, both scaled per column over the group's rows; full-precision
    accumulation (the sum runs over all of an expert's rows: thousands)."""
    g8, g_scale, x8, x_scale = _kernels.triton_fp8_per_group_colwise_scales_dual(
        grad, x, offsets, FP8, round_scales_to_power_of_2=True
    )
    return _scaled_grouped_mm(g8.t(), x8, g_scale.t(), x_scale, offsets, fast_accumulation=False)


class _FP8GroupedMMFunction(torch.autograd.Function):
    """Each group's x @ W_e^T in FP8, on tensor cores or emulated. On tensor cores it is torchao's rowwise MoE recipe
    with its quantisation kernels, written out so that the two gradient GEMMs accumulate in full precision, as
    torchao.float8's rowwise recipe does for linears (its MoE function, `_to_fp8_rowwise_then_scaled_grouped_mm`,
    uses fast accumulation in all three; 2,000 steps with it ended 1.9% above bf16's validation loss, RESULTS.md
    run 22; with full-precision gradient GEMMs, 0.24%, run 23)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, emulate: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets)
        ctx.emulate = emulate
        return (emulated_forward if emulate else _fp8_forward)(x, weight, offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, offsets = ctx.saved_tensors
        if ctx.emulate:
            return emulated_input_grad(grad, weight, offsets), emulated_weight_grad(grad, x, offsets), None, None
        grad = grad.contiguous()
        grad_weight = _fp8_weight_grad(grad, x, offsets).to(weight.dtype)
        return _fp8_input_grad(grad, weight, offsets), grad_weight, None, None


class FP8GroupedMM:
    """An Experts' grouped matmul in FP8 (models/moe.py's `Experts.grouped_mm`): rows sorted by expert, `counts`
    per expert, times each expert's weight (experts, out, in) transposed."""

    def __init__(self, emulate: bool):
        self.emulate = emulate
        if not emulate:
            _load_kernels()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        groups = padded_groups(counts, x.shape[0])
        return unpad(self._padded(pad(x, groups), weight, groups.offsets), groups)

    def chain(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        first: torch.Tensor,
        second: torch.Tensor,
        between: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """An expert's two matmuls with `between` (SwiGLU) on the padded rows: the groups padded once, not twice
        (the intermediate is the widest tensor). Padding rows stay zero through SwiGLU (silu(0) · 0)."""
        groups = padded_groups(counts, x.shape[0])
        hidden = between(self._padded(pad(x, groups), first, groups.offsets))
        return unpad(self._padded(hidden, second, groups.offsets), groups)

    def _padded(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return _FP8GroupedMMFunction.apply(x, weight, offsets, self.emulate)

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The gradient of __call__'s x, given its output's: each expert's rows of grad @ W_e."""
        groups = padded_groups(counts, grad.shape[0])
        padded = pad(grad, groups)
        if self.emulate:
            return unpad(emulated_input_grad(padded, weight, groups.offsets), groups)
        return unpad(_fp8_input_grad(padded, weight, groups.offsets), groups)

    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The gradient of __call__'s weight: (experts, out, in), each expert's grad^T @ x over its rows."""
        groups = padded_groups(counts, x.shape[0])
        grad, x = pad(grad, groups), pad(x, groups)
        if self.emulate:
            return emulated_weight_grad(grad, x, groups.offsets)
        return _fp8_weight_grad(grad, x, groups.offsets)

    def __repr__(self) -> str:
        return f"FP8GroupedMM(emulate={self.emulate})"
