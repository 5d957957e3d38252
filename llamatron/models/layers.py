"""Building blocks shared by every family: norms, rotary embeddings, attention.

Written for one device. Tensor parallelism replaces the linear layers and sets
`num_heads`/`num_kv_heads` to the local counts; the code below reshapes with
those attributes, so it runs unchanged on a shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import triton_check
from . import rmsnorm_op, rope_op
from .config import ModelConfig, RopeScaling
from .flash4_op import SUPPORTED_HEAD_DIMS, fa4_causal_attention


class RMSNorm(nn.Module):
    """Normalise in fp32 (as Llama's reference does), scale in the input dtype; Triton kernels on CUDA."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.backend = "auto"  # auto, triton or torch: this model's choice (models/kernels.py)

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
    raise ValueError(f"unknown rope scaling kind {scaling.kind!r}; use linear, dynamic or llama3")


def rope_cos_sin(cfg: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (batch, seq, head_dim) for the given positions."""
    seq_len = int(position_ids.max()) + 1 if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "dynamic" else 0
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, seq_len, position_ids.device)
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); the half-split convention of Hugging Face checkpoints."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def sliding_window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean (seq, seq) mask: query i sees keys j with i - window < j <= i."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    return (j <= i) & (j > i - window)


def document_mask(document_ids: torch.Tensor, sliding_window: int | None = None, flex: bool | None = None):
    """The attention mask for packed documents: query i sees key j iff j <= i, both lie in the same
    document (equal ids in a (batch, seq) tensor) and, with a window, i - window < j.

    Built once per forward and shared by every layer. On CUDA (or flex=True) a flex-attention
    BlockMask, whose kernel skips the blocks between documents; elsewhere a dense boolean
    (batch, 1, seq, seq) mask for scaled_dot_product_attention.
    """
    flex = document_ids.is_cuda if flex is None else flex
    seq_len = document_ids.shape[1]
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document(b, h, q, kv):
            keep = (q >= kv) & (document_ids[b, q] == document_ids[b, kv])
            return keep & (q - kv < sliding_window) if sliding_window is not None else keep

        # _compile builds the block structure without materialising a (seq, seq) mask.
        return create_block_mask(
            same_document,
            document_ids.shape[0],
            None,
            seq_len,
            seq_len,
            device=document_ids.device,
            _compile=document_ids.is_cuda,
        )
    window = sliding_window if sliding_window is not None else seq_len  # a window of seq_len: plain causal
    causal = sliding_window_mask(seq_len, window, document_ids.device)
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


# --attention-backend: auto (SDPA picks per call), fa4 (FlashAttention 4 for plain causal attention, SDPA's pick
# for the masked kinds) or one forced SDPA kernel.
_SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
ATTENTION_BACKENDS = ("auto", "fa4", *_SDPA_BACKENDS)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, **kwargs) -> torch.Tensor:
    """scaled_dot_product_attention, restricted to a forced kernel for this call only. torch.compile traces
    sdpa_kernel into the layer's graph (no graph break), so a compiled graph, and its cache key, hold the kernel
    it runs. auto takes no context manager: SDPA's own pick, as fast as a bare call."""
    if backend not in _SDPA_BACKENDS:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(_SDPA_BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


_compiled_flex_attention = None


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, gqa: bool) -> torch.Tensor:
    """flex_attention compiled once on CUDA (eager flex attention materialises the full score matrix)."""
    global _compiled_flex_attention
    from torch.nn.attention.flex_attention import flex_attention as flex

    if not q.is_cuda or torch.compiler.is_compiling():
        # CPU: the eager reference implementation (tests, tiny shapes); inside a compiled layer the
        # layer's own compilation turns it into a fused kernel.
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex, dynamic=False)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sliding_window: int | None = None,
    doc_mask=None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention over (batch, heads, seq, head_dim); k/v may have fewer heads (GQA/MQA).

    doc_mask (from `document_mask`, the sliding window already in it) keeps each token inside its document.
    backend: one of ATTENTION_BACKENDS (the layer's choice).
    """
    gqa = q.shape[1] != k.shape[1]
    if gqa and backend == "efficient":  # the memory-efficient kernel has no grouped-query (GQA) support
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        gqa = False
    seq_len = q.shape[2]
    if isinstance(doc_mask, torch.Tensor):
        return _sdpa(q, k, v, backend, attn_mask=doc_mask, enable_gqa=gqa)
    if doc_mask is not None:
        return flex_attention(q, k, v, doc_mask, gqa)
    if sliding_window is not None and seq_len > sliding_window:
        mask = sliding_window_mask(seq_len, sliding_window, q.device)
        return _sdpa(q, k, v, backend, attn_mask=mask, enable_gqa=gqa)
    half = q.dtype in (torch.bfloat16, torch.float16)
    if backend == "fa4" and q.is_cuda and half and q.shape[-1] in SUPPORTED_HEAD_DIMS:
        # FA4 works on (batch, seq, heads, dim): the transposes below are views of the projection's layout.
        return fa4_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return _sdpa(q, k, v, backend, is_causal=True, enable_gqa=gqa)


class Attention(nn.Module):
    """Self-attention with a fused QKV projection laid out [Q heads; K heads; V heads]."""

    core: Callable[..., torch.Tensor]  # attention_core; selective recompute wraps it

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.sliding_window = cfg.sliding_window
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.bias)
        self.o = nn.Linear(q_size, cfg.hidden_size, bias=cfg.bias)
        self.core = attention_core  # replaceable: selective recompute wraps it
        # This model's choices (models/kernels.py): an ATTENTION_BACKENDS name; auto, triton or torch.
        self.backend = "auto"
        self.rope_backend = "auto"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc_mask=None) -> torch.Tensor:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv(x)
        batch, seq, _ = qkv.shape  # sequence parallelism: x is a sequence shard, qkv the whole sequence
        if triton_check.kernels_on(self.rope_backend, qkv) and rope_op.supports_head_dim(d):
            # one kernel: split, rotate, (batch, seq, heads, dim) outputs
            q, k, v = rope_op.qkv_rope_op(qkv, cos, sin, self.num_heads, self.num_kv_heads)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(batch, seq, -1, d).transpose(1, 2)
            k = k.view(batch, seq, -1, d).transpose(1, 2)
            v = v.view(batch, seq, -1, d).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v, self.sliding_window, doc_mask, self.backend)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))
