"""Attention of one decoding step over a static KV cache: each row's new key and value written into its slot and
its query attending to the slots it sees, in one Triton kernel on CUDA.

Why a kernel: at batch 1 a decoding step is bound by its kernels' count and latency, not by bytes. Written with
torch ops, each layer's step attention is six kernels (two cache scatters, the bias broadcast, a batched matmul,
a softmax, another matmul): 15 us of llama-1b's 1.15 ms a token on an H200, plus a launch gap each inside the CUDA
graph (benchmarks/RESULTS.md, run 18). Here it is one kernel per layer: a program per (row, KV head) stores the
new key and value, then runs an online softmax over the keys [lo, position) in blocks (tensor-core dots for the
query heads sharing that KV head) and adds the new key from registers, in fp32.

Which keys a row sees is a contiguous range, [lo, position]: the rule of models/attention.py (`_keep`: causal,
within the sliding window, within the chunk) for one query. Off CUDA, or for head sizes the kernel does not take,
the step is the torch ops (`decode_attention`, the reference the kernel is tested against).
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from . import triton_check


class DecodeRows(Protocol):
    """The keys each row's query sees (models/attention.py's DecodeRows): the slots [lo, positions[b]], lo from
    the window and the chunk, or as an additive bias (batch, 1, keys) of 0 and -inf."""

    positions: torch.Tensor
    window: int | None
    chunk: int | None

    def bias(self) -> torch.Tensor: ...


class LayerKVCache(Protocol):
    """A layer's static KV cache (models/kv_cache.py's LayerKVCache)."""

    def buffers_like(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


_MAX_HEAD_DIM = 256
_BLOCK_KEYS = 64


def decode_step_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, rows: DecodeRows
) -> torch.Tensor:
    """q (batch, heads, 1, dim); k/v (batch, kv heads, 1, dim), the new token's; written into `cache` at each row's
    position, then every row's query over the keys it sees. Returns (batch, heads, 1, dim)."""
    keys, values = cache.buffers_like(k, v)
    if triton_check.kernels_on("auto", q) and q.shape[-1] <= _MAX_HEAD_DIM:
        return decode_attention_op(q, k, v, keys, values, rows.positions, rows.window or 0, rows.chunk or 0)
    keys, values = cache.append(k, v)
    return decode_attention(q, keys, values, rows.bias())


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """q (batch, heads, 1, dim) over a static cache's k (batch, kv heads, keys, dim) and v (batch, kv heads, keys,
    dv: the values may be of another width, as multi-head latent attention's) under `bias` (DecodeRows).

    The query heads sharing a KV head are one batched matmul against it (no copy of the cache per query head,
    which SDPA's kernels that take a mask would make for GQA), the scale and bias ride in its epilogue."""
    batch, heads, _, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    q = q.reshape(batch * kv_heads, heads // kv_heads, dim)
    bias = bias.expand(batch, kv_heads, keys).reshape(-1, 1, keys)  # each KV head's group of queries sees the row's
    scores = torch.baddbmm(bias, q, k.reshape(-1, keys, dim).transpose(1, 2), alpha=dim**-0.5)
    out = torch.bmm(torch.softmax(scores, dim=-1), v.reshape(-1, keys, v.shape[-1]))
    return out.view(batch, heads, 1, -1)


@torch.library.custom_op("llamatron::decode_attention", mutates_args=("keys", "values"))
def decode_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    window: int,
    chunk: int,
) -> torch.Tensor:
    """The kernel as one opaque op (torch.compile keeps it whole); window, chunk: 0 for none."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _kernels().attend(q, k, v, keys, values, positions, window, chunk, out)
    return out


@decode_attention_op.register_fake
def _(q, k, v, keys, values, positions, window, chunk):
    return torch.empty_like(q)


# ---- Triton kernel (imported on first CUDA use: CPU installs need no Triton) --------------------


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(
        q_ptr, k_new_ptr, v_new_ptr, keys_ptr, values_ptr, pos_ptr, out_ptr,
        sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, so_b, so_h,
        kv_heads, scale, window, chunk,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0) // kv_heads
        head = tl.program_id(0) % kv_heads
        pos = tl.load(pos_ptr + row)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        in_dim = d < DIM
        q_rows = row * sq_b + (head * GROUP + g)[:, None] * sq_h + d[None, :]
        q_mask = (g[:, None] < GROUP) & in_dim[None, :]
        q = tl.load(q_ptr + q_rows, mask=q_mask, other=0.0)
        k_new = tl.load(k_new_ptr + row * skn_b + head * skn_h + d, mask=in_dim, other=0.0)
        v_new = tl.load(v_new_ptr + row * svn_b + head * svn_h + d, mask=in_dim, other=0.0)
        k_base = keys_ptr + row * sk_b + head * sk_h
        v_base = values_ptr + row * sv_b + head * sv_h
        tl.store(k_base + pos * sk_l + d, k_new, mask=in_dim)
        tl.store(v_base + pos * sv_l + d, v_new, mask=in_dim)
        # the new key first, from registers: the running max, sum and output start from it
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        total = tl.full((GROUP_PAD,), 1.0, tl.float32)
        acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32) + v_new.to(tl.float32)[None, :]
        lo = pos * 0
        if window > 0:
            lo = tl.maximum(lo, pos - window + 1)
        if chunk > 0:
            lo = tl.maximum(lo, (pos // chunk) * chunk)
        for start in range(lo, pos, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            seen = idx < pos
            tile_mask = seen[:, None] & in_dim[None, :]
            k = tl.load(k_base + idx[:, None] * sk_l + d[None, :], mask=tile_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(seen[None, :], scores, float("-inf"))
            m_next = tl.maximum(m, tl.max(scores, axis=1))
            rescale = tl.exp(m - m_next)
            p = tl.exp(scores - m_next[:, None])
            total = total * rescale + tl.sum(p, axis=1)
            v = tl.load(v_base + idx[:, None] * sv_l + d[None, :], mask=tile_mask, other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_next
        out = acc / total[:, None]
        o_rows = row * so_b + (head * GROUP + g)[:, None] * so_h + d[None, :]
        tl.store(out_ptr + o_rows, out.to(out_ptr.dtype.element_ty), mask=q_mask)

    class Kernels:
        @staticmethod
        def attend(q, k_new, v_new, keys, values, positions, window, chunk, out):
            batch, heads, _, dim = q.shape
            kv_heads = keys.shape[1]
            group = heads // kv_heads
            # tensor-core dots need 16 rows; fp32 (tests, CPU interpreter) computes them exactly
            precision = "ieee" if q.dtype == torch.float32 else None
            decode_attention_kernel[(batch * kv_heads,)](
                q, k_new, v_new, keys, values, positions, out,
                q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
                keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
                out.stride(0), out.stride(1),
                kv_heads, dim**-0.5, window, chunk,
                GROUP=group, GROUP_PAD=max(16, _pow2(group)), DIM=dim, DIM_PAD=max(16, _pow2(dim)),
                BLOCK=_BLOCK_KEYS, PRECISION=precision, num_warps=4,
            )  # fmt: skip

    return Kernels
