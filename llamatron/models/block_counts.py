"""What a decoder layer (block) and a norm declare about themselves for the planner, as their attention does
(models/attention_counts.py): the bytes the block saves for backward per token outside its attention (its norms'
inputs and outputs, its MLP) and which Triton kernels can run its layers; a norm's saved bytes where it stands
alone (the final norm). models/inventory.py reads them into each Layer; planning/ has no formula of block options.

A block's `counts` is a value with the BlockCounts interface (the shared pre-norm DecoderBlock's: PreNormCounts
below; a family's own block declares its own, e.g. families/falcon/counts.py). planning/activations.py's docstring
says what each saved kind is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .attention_counts import LayerKernels


class BlockCounts(Protocol):
    """A decoder layer's counts outside its attention."""

    @property
    def rmsnorm_kernel(self) -> bool:
        """Whether its residual norms are RMSNorms, which the Triton RMSNorm (kernels/rmsnorm_op.py) runs."""
        ...

    @property
    def swiglu_kernel(self) -> bool:
        """Whether its MLP (its experts') is SwiGLU, which the Triton SwiGLU (kernels/swiglu_op.py) runs."""
        ...

    def saved(
        self, act_bytes: int, ffn: float, tp: int, sequence_parallel: bool, kernels: LayerKernels
    ) -> dict[str, float]:
        """Bytes per token it saves for backward on one tp rank outside its attention, by kind: norm_inputs,
        norm_outputs, mlp. ffn: the MLP width one token runs through (a mixture: its experts' taken)."""
        ...


class NormCounts(Protocol):
    """A norm's counts where it stands alone (the final norm, whose output the head saves)."""

    def saved(self, act_bytes: int, tp: int, sequence_parallel: bool, fused_norms: bool) -> float:
        """Bytes per token it and the head reading its output save (eager); fused_norms: the Triton RMSNorm."""
        ...


@dataclass(frozen=True)
class PreNormCounts:
    """The shared pre-norm layer's (models/blocks.py DecoderBlock): two RMSNorms, SwiGLU (or SwiGLU experts)."""

    hidden_size: int
    norms: int = 2

    @property
    def rmsnorm_kernel(self) -> bool:
        return True

    @property
    def swiglu_kernel(self) -> bool:
        return True

    def saved(
        self, act_bytes: int, ffn: float, tp: int, sequence_parallel: bool, kernels: LayerKernels
    ) -> dict[str, float]:
        a, h, n = act_bytes, self.hidden_size, self.norms
        if kernels.compiled:  # the rsqrt per norm and one residual; the rest is re-derived in backward
            norm_inputs = n * 4 + a * h
        elif kernels.norms:  # the Triton RMSNorm: its input and rsqrt
            norm_inputs = n * (a * h + 4)
        else:  # eager torch: the fp32 copy of its input, the normalised input and rsqrt
            norm_inputs = n * (4 * h + a * h + 4)
        # SwiGLU: gate|up, silu(gate), the product; the Triton SwiGLU (or compiled) re-derives silu(gate)
        mlp = (3 if kernels.compiled or kernels.swiglu else 4) * a * ffn / tp
        return {
            "norm_inputs": norm_inputs / (tp if sequence_parallel else 1),
            "norm_outputs": n * a * h,  # the QKV and MLP projections' inputs (whole under sp: gathered)
            "mlp": mlp,
        }


@dataclass(frozen=True)
class RMSNormCounts:
    """models/layers.py RMSNorm's: eager, the fp32 copy of its input, the normalised input and rsqrt; the Triton
    RMSNorm its input and rsqrt; and the output the head saves."""

    hidden_size: int

    def saved(self, act_bytes: int, tp: int, sequence_parallel: bool, fused_norms: bool) -> float:
        a, h = act_bytes, self.hidden_size
        inputs = (a * h + 4) if fused_norms else (4 * h + a * h + 4)
        return inputs / (tp if sequence_parallel else 1) + a * h


__all__ = ["BlockCounts", "NormCounts", "PreNormCounts", "RMSNormCounts"]
