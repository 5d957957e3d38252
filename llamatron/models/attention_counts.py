"""What an attention module declares about itself for the planner and the simulator (models/inventory.py reads it
into each Layer; planning/ has no formula of attention options): its saved activations per token, by kind, the
bytes context parallelism gathers, the widths the FLOP and elementwise counts take, and its decode cache per token.

An attention module's `counts` is a value with this interface (the shared attention's: GQACounts below; a family's
own attention declares its own, e.g. families/deepseek_v3/mla.py's MLACounts). Widths are elements per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..kernels import rope_op


@dataclass(frozen=True)
class LayerKernels:
    """The code a decoder layer runs: compiled or eager, and which Triton ops (each the default on CUDA)."""

    compiled: bool = False
    norms: bool = False  # kernels/rmsnorm_op.py
    rope: bool = False  # kernels/rope_op.py
    swiglu: bool = False  # kernels/swiglu_op.py


EAGER_TORCH = LayerKernels()  # what runs on CPU


class AttentionCounts(Protocol):
    """An attention layer's counts (planning/activations.py's docstring says what each saved kind is)."""

    @property
    def rope_width(self) -> int:
        """The rotary tables' width (cos and sin, each saved once per chunk)."""
        ...

    @property
    def kernel_head_dim(self) -> int:
        """The head width the attention kernel runs (its calibrated efficiency depends on it)."""
        ...

    @property
    def kernel_input_width(self) -> int:
        """Elements per token of the attention kernel's inputs (q, k, v) over all heads: the elementwise passes."""
        ...

    @property
    def decode_cache_width(self) -> int:
        """Elements one layer's decode cache holds per token (all heads, one device)."""
        ...

    @property
    def fused_rope(self) -> bool:
        """Whether the Triton QKV-split + rotary kernel (kernels/rope_op.py) runs it where chosen."""
        ...

    @property
    def recomputed(self) -> tuple[str, ...]:
        """The kinds of `saved` that selective recompute frees (it re-runs the attention kernel, whose inputs it
        keeps)."""
        ...

    def gathered_kv_width(self, tp: int) -> float:
        """Elements per token of the K and V one tensor-parallel rank's kernel attends to: what context
        parallelism all-gathers (times cp per local token)."""
        ...

    def saved(self, act_bytes: int, tp: int, kernels: LayerKernels, cp: int) -> dict[str, float]:
        """Bytes per (local) token it saves for backward on one tp rank, by kind; cp > 1: its kernel holds the
        K/V gathered over cp ranks (without recompute). Kinds: qkv, qk_norm, rope, gathered_kv, softmax_stats,
        attn_output (a family's attention may add its own, e.g. latent_norms)."""
        ...


@dataclass(frozen=True)
class GQACounts:
    """The shared attention's (models/layers.py Attention): a fused QKV projection of num_heads query heads and
    num_kv_heads key/value heads of head_dim, an optional q/k RMSNorm per head, the rotary embedding, one kernel."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool

    @property
    def rope_width(self) -> int:
        return self.head_dim

    @property
    def kernel_head_dim(self) -> int:
        return self.head_dim

    @property
    def kernel_input_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def decode_cache_width(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim  # keys and values (models/kv_cache.py)

    @property
    def fused_rope(self) -> bool:
        return rope_op.supports_head_dim(self.head_dim) and not self.qk_norm  # no norm between split and rotary

    @property
    def recomputed(self) -> tuple[str, ...]:
        return ("softmax_stats",)  # the kernel's output is the output projection's input (a view): kept

    def _local_heads(self, tp: int) -> tuple[int, int]:
        # a KV head is replicated over the ranks when tp > num_kv_heads (parallel/tensor.py local_kv_heads)
        return self.num_heads // tp, max(self.num_kv_heads // tp, 1)

    def gathered_kv_width(self, tp: int) -> float:
        return 2.0 * self._local_heads(tp)[1] * self.head_dim

    def saved(self, act_bytes: int, tp: int, kernels: LayerKernels, cp: int) -> dict[str, float]:
        a, d = act_bytes, self.head_dim
        q, kv = self._local_heads(tp)
        qkv, rope = a * (q + 2 * kv) * d, 0 if kernels.rope else a * (q + kv) * d
        qk_norm = 0.0
        if self.qk_norm:  # per query/key head: its rsqrt; eager torch also the normalised heads (and their fp32 copy)
            qk_norm = 4.0 * (q + kv)
            if not (kernels.compiled or kernels.norms):
                qk_norm += (a + (0 if a == 4 else 4)) * (q + kv) * d
        if cp > 1:  # the kernel holds the gathered K/V, not this rank's: of the local tensors only q stays
            qkv, rope = (a * q * d, 0) if kernels.rope else (0, a * q * d)
        return {
            "qkv": qkv,
            "qk_norm": qk_norm,
            "rope": rope,
            "gathered_kv": cp * a * self.gathered_kv_width(tp) if cp > 1 else 0.0,
            "softmax_stats": 4 * q,
            "attn_output": (2 if kernels.compiled else 1) * a * q * d,
        }


__all__ = ["EAGER_TORCH", "AttentionCounts", "GQACounts", "LayerKernels"]
