"""The fused QKV-split + rotary custom op's autograd wiring, through its CPU kernels (the Triton kernels:
test_triton_kernels)."""

import torch

from llamatron.kernels.rope_op import qkv_rope_op
from llamatron.models.config import ModelConfig
from llamatron.models.layers import apply_rope, rope_cos_sin


def test_qkv_rope_op_matches_split_and_rope_forward_and_gradient():
    torch.manual_seed(0)
    batch, seq, heads, kv, dim = 2, 7, 4, 2, 8
    cfg = ModelConfig(
        family="llama",
        vocab_size=8,
        hidden_size=heads * dim,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=8,
        max_seq_length=16,
    )
    cos, sin = rope_cos_sin(cfg, torch.arange(seq).expand(batch, seq), torch.float32)
    qkv = torch.randn(batch, seq, (heads + 2 * kv) * dim, requires_grad=True)
    grads = [torch.randn(batch, seq, n, dim) for n in (heads, kv, kv)]
    got = qkv_rope_op(qkv, cos, sin, heads, kv)
    q, k, v = qkv.view(batch, seq, -1, dim).split([heads, kv, kv], dim=2)
    want = [apply_rope(t.transpose(1, 2), cos, sin).transpose(1, 2) for t in (q, k)] + [v]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    (g_got,) = torch.autograd.grad(got, qkv, grads)
    (g_want,) = torch.autograd.grad(want, qkv, grads)
    torch.testing.assert_close(g_got, g_want)
