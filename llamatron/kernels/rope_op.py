"""The QKV split and the rotary embedding of q and k as one Triton kernel each way, the default on CUDA.

Why: torch.compile's kernel for rotary + head transpose moved ~6.4 GB per llama-1b step at ~1.6 TB/s on an
H200, 4.1 ms of the step (benchmarks/RESULTS.md, runs 3-4). Here one program per token reads its QKV row
once and writes q and k rotated and v copied, each as a contiguous (batch, seq, heads, dim) tensor: the
layout FlashAttention 4 takes as is and SDPA takes as transposed views. The backward reads the three
gradients of a token and writes its QKV-row gradient in one pass, so no separate concatenation runs. Autograd
keeps q, k and v (the attention's inputs) but no longer the QKV projection's output: 2.5 GiB less at llama-1b's
micro-batch 8, and 1.6-3.7 ms less per step (benchmarks/RESULTS.md, run 5). `--rope-backend torch` runs the
plain expression instead.

Rotation convention: the half-split one of Hugging Face checkpoints (`layers.apply_rope`): with x = [x1, x2]
split along the head dimension, out = [x1·cos1 − x2·sin1, x2·cos2 + x1·sin2].
"""

from __future__ import annotations

import functools

import torch


def supports_head_dim(head_dim: int) -> bool:
    """A power of two: the kernels index half a head with one block."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


@torch.library.custom_op("llamatron::qkv_rope", mutates_args=())
def qkv_rope_op(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (batch, seq, (heads + 2·kv_heads)·dim) -> q, k rotated and v, each (batch, seq, n, dim) contiguous;
    cos, sin: (batch, seq, dim)."""
    batch, seq, width = qkv.shape
    dim = width // (heads + 2 * kv_heads)
    q = qkv.new_empty(batch, seq, heads, dim)
    k, v = qkv.new_empty(batch, seq, kv_heads, dim), qkv.new_empty(batch, seq, kv_heads, dim)
    if q.numel():
        forward = _forward_kernel()
        forward[(batch * seq,)](
            qkv,
            cos,
            sin,
            q,
            k,
            v,
            seq,
            *qkv.stride()[:2],
            *cos.stride()[:2],
            *sin.stride()[:2],
            HEADS=heads,
            KV_HEADS=kv_heads,
            HALF=dim // 2,
            PAIRS=_pow2(heads + kv_heads),
            KV_POW2=_pow2(kv_heads),
        )
    return q, k, v


@qkv_rope_op.register_fake
def _(qkv, cos, sin, heads, kv_heads):
    batch, seq, width = qkv.shape
    dim = width // (heads + 2 * kv_heads)
    return (
        qkv.new_empty(batch, seq, heads, dim),
        qkv.new_empty(batch, seq, kv_heads, dim),
        qkv.new_empty(batch, seq, kv_heads, dim),
    )


@torch.library.custom_op("llamatron::qkv_rope_backward", mutates_args=())
def qkv_rope_backward_op(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Gradient of the QKV row from the gradients of q, k (rotated back) and v; any strides, last dim 1."""
    dq, dk, dv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv))
    batch, seq, heads, dim = dq.shape
    kv_heads = dk.shape[2]
    dqkv = dq.new_empty(batch, seq, (heads + 2 * kv_heads) * dim)
    if dqkv.numel():
        backward = _backward_kernel()
        backward[(batch * seq,)](
            dq,
            dk,
            dv,
            cos,
            sin,
            dqkv,
            seq,
            *dq.stride()[:3],
            *dk.stride()[:3],
            *dv.stride()[:3],
            *cos.stride()[:2],
            *sin.stride()[:2],
            HEADS=heads,
            KV_HEADS=kv_heads,
            HALF=dim // 2,
            PAIRS=_pow2(heads + kv_heads),
            KV_POW2=_pow2(kv_heads),
        )
    return dqkv


@qkv_rope_backward_op.register_fake
def _(dq, dk, dv, cos, sin):
    batch, seq, heads, dim = dq.shape
    return dq.new_empty(batch, seq, (heads + 2 * dk.shape[2]) * dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    c1, c2 = cos.float()[:, :, None].chunk(2, dim=-1)
    s1, s2 = sin.float()[:, :, None].chunk(2, dim=-1)
    return torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], dim=-1).to(x.dtype)


@qkv_rope_op.register_kernel("cpu")
def _(qkv, cos, sin, heads, kv_heads):
    batch, seq, width = qkv.shape
    dim = width // (heads + 2 * kv_heads)
    q, k, v = qkv.view(batch, seq, -1, dim).split([heads, kv_heads, kv_heads], dim=2)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v.contiguous()


def _rotate_back(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The transpose of `_rotate` (the derivative the Triton kernel computes, written out)."""
    g1, g2 = g.float().chunk(2, dim=-1)
    c1, c2 = cos.float()[:, :, None].chunk(2, dim=-1)
    s1, s2 = sin.float()[:, :, None].chunk(2, dim=-1)
    return torch.cat([g1 * c1 + g2 * s2, g2 * c2 - g1 * s1], dim=-1).to(g.dtype)


@qkv_rope_backward_op.register_kernel("cpu")
def _(dq, dk, dv, cos, sin):
    return torch.cat([_rotate_back(dq, cos, sin), _rotate_back(dk, cos, sin), dv], dim=2).flatten(2)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])


def _backward(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    return qkv_rope_backward_op(dq, dk, dv, cos, sin), None, None, None, None


qkv_rope_op.register_autograd(_backward, setup_context=_setup_context)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _forward_kernel():
    """Built on first CUDA use: CPU installs need no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def qkv_rope_forward_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        seq,
        qkv_sb,
        qkv_ss,
        cos_sb,
        cos_ss,
        sin_sb,
        sin_ss,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        PAIRS: tl.constexpr,
        KV_POW2: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        b, s = token // seq, token % seq
        dim = 2 * HALF
        half = tl.arange(0, HALF)
        c1 = tl.load(cos_ptr + b * cos_sb + s * cos_ss + half).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + b * cos_sb + s * cos_ss + HALF + half).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + b * sin_sb + s * sin_ss + half).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + b * sin_sb + s * sin_ss + HALF + half).to(tl.float32)[None, :]
        row = qkv_ptr + b * qkv_sb + s * qkv_ss
        # q and k heads together: rows 0..HEADS-1 are q heads, HEADS..HEADS+KV_HEADS-1 the k heads
        head = tl.arange(0, PAIRS)[:, None]
        live = head < HEADS + KV_HEADS
        x1 = tl.load(row + head * dim + half[None, :], mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(row + head * dim + HALF + half[None, :], mask=live, other=0.0).to(tl.float32)
        out1 = (x1 * c1 - x2 * s1).to(q_ptr.dtype.element_ty)
        out2 = (x2 * c2 + x1 * s2).to(q_ptr.dtype.element_ty)
        is_q = head < HEADS
        q_at = q_ptr + token * HEADS * dim + head * dim + half[None, :]
        tl.store(q_at, out1, mask=is_q)
        tl.store(q_at + HALF, out2, mask=is_q)
        is_k = live & (head >= HEADS)
        k_at = k_ptr + token * KV_HEADS * dim + (head - HEADS) * dim + half[None, :]
        tl.store(k_at, out1, mask=is_k)
        tl.store(k_at + HALF, out2, mask=is_k)
        kv_head = tl.arange(0, KV_POW2)[:, None]
        kv_live = kv_head < KV_HEADS
        cols = tl.arange(0, 2 * HALF)[None, :]
        v = tl.load(row + (HEADS + KV_HEADS) * dim + kv_head * dim + cols, mask=kv_live)
        tl.store(v_ptr + token * KV_HEADS * dim + kv_head * dim + cols, v, mask=kv_live)

    return qkv_rope_forward_kernel


@functools.cache
def _backward_kernel():
    """Built on first CUDA use: CPU installs need no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def qkv_rope_backward_kernel(
        dq_ptr,
        dk_ptr,
        dv_ptr,
        cos_ptr,
        sin_ptr,
        dqkv_ptr,
        seq,
        dq_sb,
        dq_ss,
        dq_sh,
        dk_sb,
        dk_ss,
        dk_sh,
        dv_sb,
        dv_ss,
        dv_sh,
        cos_sb,
        cos_ss,
        sin_sb,
        sin_ss,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        PAIRS: tl.constexpr,
        KV_POW2: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        b, s = token // seq, token % seq
        dim = 2 * HALF
        half = tl.arange(0, HALF)
        c1 = tl.load(cos_ptr + b * cos_sb + s * cos_ss + half).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + b * cos_sb + s * cos_ss + HALF + half).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + b * sin_sb + s * sin_ss + half).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + b * sin_sb + s * sin_ss + HALF + half).to(tl.float32)[None, :]
        head = tl.arange(0, PAIRS)[:, None]
        is_q = head < HEADS
        is_k = (head >= HEADS) & (head < HEADS + KV_HEADS)
        q_at = dq_ptr + b * dq_sb + s * dq_ss + head * dq_sh + half[None, :]
        k_at = dk_ptr + b * dk_sb + s * dk_ss + (head - HEADS) * dk_sh + half[None, :]
        g1 = tl.load(q_at, mask=is_q, other=0.0) + tl.load(k_at, mask=is_k, other=0.0)
        g2 = tl.load(q_at + HALF, mask=is_q, other=0.0) + tl.load(k_at + HALF, mask=is_k, other=0.0)
        g1, g2 = g1.to(tl.float32), g2.to(tl.float32)
        out_ty = dqkv_ptr.dtype.element_ty
        row = dqkv_ptr + token * (HEADS + 2 * KV_HEADS) * dim
        live = is_q | is_k
        tl.store(row + head * dim + half[None, :], (g1 * c1 + g2 * s2).to(out_ty), mask=live)
        tl.store(row + head * dim + HALF + half[None, :], (g2 * c2 - g1 * s1).to(out_ty), mask=live)
        kv_head = tl.arange(0, KV_POW2)[:, None]
        kv_live = kv_head < KV_HEADS
        cols = tl.arange(0, 2 * HALF)[None, :]
        dv = tl.load(dv_ptr + b * dv_sb + s * dv_ss + kv_head * dv_sh + cols, mask=kv_live)
        tl.store(row + (HEADS + KV_HEADS) * dim + kv_head * dim + cols, dv, mask=kv_live)

    return qkv_rope_backward_kernel
