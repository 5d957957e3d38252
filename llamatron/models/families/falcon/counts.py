"""What Falcon's layers declare for the planner (models/block_counts.py): its parallel-residual block's saved
bytes outside the attention, and its LayerNorm's standing alone (the final norm)."""

from __future__ import annotations

from dataclasses import dataclass

from ...attention_counts import LayerKernels


@dataclass(frozen=True)
class ParallelBlockCounts:
    """FalconBlock's: `norms` LayerNorms (one shared, or one per branch) feeding attention and a GELU MLP in
    parallel from the layer's input."""

    hidden_size: int
    norms: int

    @property
    def rmsnorm_kernel(self) -> bool:
        return False  # LayerNorm

    @property
    def swiglu_kernel(self) -> bool:
        return False  # GELU

    def saved(
        self, act_bytes: int, ffn: float, tp: int, sequence_parallel: bool, kernels: LayerKernels
    ) -> dict[str, float]:
        a, h, compiled = act_bytes, self.hidden_size, kernels.compiled
        # the layer input and each LayerNorm's mean and rstd (compiled: one LayerNorm's)
        norm_inputs = a * h + 8 * (1 if compiled else self.norms)
        # the projections' inputs: one per LayerNorm (eager), one compiled; under sp each projection its own gather
        norm_outputs = a * h * (2 if sequence_parallel else 1 if compiled else self.norms)
        return {
            "norm_inputs": norm_inputs / (tp if sequence_parallel else 1),
            "norm_outputs": norm_outputs,
            "mlp": 2 * a * ffn / tp,  # the GELU's input and output
        }


@dataclass(frozen=True)
class LayerNormCounts:
    """A LayerNorm standing alone: its input and mean/rstd, and the output the head saves."""

    hidden_size: int

    def saved(self, act_bytes: int, tp: int, sequence_parallel: bool, fused_norms: bool) -> float:
        a, h = act_bytes, self.hidden_size
        return (a * h + 8) / (tp if sequence_parallel else 1) + a * h


__all__ = ["LayerNormCounts", "ParallelBlockCounts"]
