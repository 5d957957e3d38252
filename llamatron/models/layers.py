"""Building blocks shared by every family: norms, rotary embeddings, attention.

Written for one device. Tensor parallelism replaces the linear layers and sets
`num_heads`/`num_kv_heads` to the local counts; the code below reshapes with
those attributes, so it runs unchanged on a shard.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from ..kernels import rmsnorm_op, rope_op, triton_check
from .attention import attend
from .attention_counts import GQACounts
from .block_counts import RMSNormCounts
from .config import ModelConfig, RopeScaling
from .layer_input import LayerInput
from .yarn import yarn_attention_factor, yarn_inv_freq


class RMSNorm(nn.Module):
    """Normalise in fp32 (as Llama's reference does), scale in the input dtype; Triton kernels on CUDA."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.backend = "auto"  # auto, triton or torch: this model's choice (models/kernels.py)

    @property
    def counts(self) -> RMSNormCounts:
        """What it saves standing alone, for the planner (models/block_counts.py)."""
        return RMSNormCounts(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_check.kernels_on(self.backend, x):
            return rmsnorm_op.rms_norm_op(x, self.weight, self.eps)[0]
        return rmsnorm_op.reference_rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add and the norm after it, in one kernel on CUDA."""
        if triton_check.kernels_on(self.backend, x):
            h, y, _ = rmsnorm_op.add_rms_norm_op(x, delta, self.weight, self.eps)
            return h, y
        h = x + delta
        return h, rmsnorm_op.reference_rms_norm(h, self.weight, self.eps)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None, seq_len: int, device: torch.device | None = None
) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with long-context scaling applied."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    if scaling is not None and scaling.kind == "dynamic" and seq_len > scaling.original_max_position:
        # NTK-aware: grow the base once the sequence is longer than the trained context.
        ratio = scaling.factor * seq_len / scaling.original_max_position - (scaling.factor - 1)
        theta = theta * ratio ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None or scaling.kind == "dynamic":
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return yarn_inv_freq(
            head_dim,
            theta,
            scaling.factor,
            scaling.original_max_position,
            scaling.beta_fast,
            scaling.beta_slow,
            scaling.truncate,
            device,
        )
    if scaling.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old = scaling.original_max_position
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"unknown rope scaling kind {scaling.kind!r}; use linear, dynamic, llama3 or yarn")


def rope_depends_on_length(cfg: ModelConfig, seq_len: int) -> bool:
    """Whether the rotary frequencies at `seq_len` tokens differ from those at fewer (dynamic NTK scaling past the
    trained context): keys cached while the sequence was shorter are then not what the whole sequence computes."""
    r = cfg.rope_scaling
    return r is not None and r.kind == "dynamic" and seq_len > r.original_max_position


_INV_FREQ: dict[tuple, torch.Tensor] = {}  # a model's frequencies, once per device: decoding asks every token


def rope_cos_sin(cfg: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (batch, seq, rope_head_dim) for the given positions (YaRN's: times its attention
    factor)."""
    dim, r = cfg.rope_head_dim, cfg.rope_scaling
    if r is not None and r.kind == "dynamic":  # the frequencies change with the length
        seq_len = int(position_ids.max()) + 1
        inv_freq = rope_inv_freq(dim, cfg.rope_theta, r, seq_len, position_ids.device)
    else:
        scaling = None if r is None else dataclasses.astuple(r)
        key = (dim, cfg.rope_theta, scaling, str(position_ids.device))
        if key not in _INV_FREQ:
            if len(_INV_FREQ) > 64:
                _INV_FREQ.clear()
            _INV_FREQ[key] = rope_inv_freq(dim, cfg.rope_theta, r, 0, position_ids.device)
        inv_freq = _INV_FREQ[key]
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if r is not None and r.kind == "yarn":
        factor = yarn_attention_factor(r.factor, r.mscale, r.mscale_all_dim)
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); the half-split convention of Hugging Face checkpoints."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Self-attention with a fused QKV projection laid out [Q heads; K heads; V heads]. A family's block chooses its
    options (`qkv_bias`: biases on the QKV projection alone; `qk_norm`: an RMSNorm over each query and key head before
    the rotary embedding: Qwen's, families/qwen/block.py); a family's own attention subclasses it where its queries
    and keys are treated otherwise after the rotary embedding (`adjust`: Llama 4's)."""

    # How tensor parallelism splits it (parallel/tensor.py): the heads over the ranks. The q/k norms' weights are
    # whole on every rank, each of which uses them on its own heads: their gradients are partial sums.
    tp_plan = {"qkv": "qkv", "o": "row", "q_norm": "replicated_partial", "k_norm": "replicated_partial"}
    core: Callable[..., torch.Tensor]  # attend, or a wrapper of it

    def __init__(self, cfg: ModelConfig, rope: bool = True, qkv_bias: bool = False, qk_norm: bool = False):
        """rope: this layer rotates its queries and keys (False: a NoPE layer, ModelConfig.layer_has_rope); qkv_bias:
        biases on the QKV projection (all linears have them with cfg.bias); qk_norm: per-head q/k RMSNorms."""
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.bias or qkv_bias)
        self.o = nn.Linear(q_size, cfg.hidden_size, bias=cfg.bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if qk_norm else None
        self.rope = rope
        self.core = attend  # replaceable: selective recompute and context parallelism wrap it
        # This model's choices (models/kernels.py): an ATTENTION_BACKENDS name; auto, triton or torch.
        self.backend = "auto"
        self.rope_backend = "auto"

    def forward(self, x: torch.Tensor, inputs: LayerInput) -> torch.Tensor:
        """inputs.cache: this layer's KV cache (a LayerKVCache); the new keys and values join the cached ones, and
        the queries see them all (as inputs.mask says). inputs.positions: (batch, seq) of the queries (for
        `adjust`)."""
        cos, sin, mask, cache = inputs.cos, inputs.sin, inputs.mask, inputs.cache
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv(x)
        batch, seq, _ = qkv.shape  # sequence parallelism: x is a sequence shard, qkv the whole sequence
        # the kernel has no norm between split and rotary
        fused = self.rope and self.q_norm is None and rope_op.supports_head_dim(d)
        if fused and triton_check.kernels_on(self.rope_backend, qkv):
            # one kernel: split, rotate, (batch, seq, heads, dim) outputs
            q, k, v = rope_op.qkv_rope_op(qkv, cos, sin, self.num_heads, self.num_kv_heads)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            q, k, v = (t.view(batch, seq, -1, d) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if self.rope:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k = self.adjust(q, k, inputs.positions)
        out = self.core(q, k, v, mask, cache, self.backend)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))

    @property
    def flops_width(self) -> int:
        """Its width in the FLOP formula (models/inventory.py): heads x head_dim, of the query·key and of the
        probability·value products alike."""
        return self.num_heads * self.head_dim

    @property
    def counts(self) -> GQACounts:
        """What the planner reads of it (models/attention_counts.py): saved activations, cache and widths."""
        return GQACounts(self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm is not None)

    def adjust(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries and keys (batch, heads, seq, head_dim) after the rotary embedding, before attention: as
        they are here; a family's attention changes them by overriding this."""
        return q, k
