"""Qwen2.5, Qwen3 (dense) and Qwen3-MoE with their published shapes (the base models' config.json), and tiny ones for
tests."""

from __future__ import annotations

from collections.abc import Callable

from .config import QwenConfig


def _qwen(h: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, seq: int, tie: bool, **kw) -> QwenConfig:
    return QwenConfig(
        family="qwen",
        vocab_size=vocab,
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        max_seq_length=seq,
        rope_theta=kw.pop("theta", 1e6),
        norm_eps=1e-6,
        tie_embeddings=tie,
        **kw,
    )


def _qwen25(h: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, seq: int, tie: bool) -> QwenConfig:
    """Qwen2.5: biases on q, k and v only."""
    return _qwen(h, layers, heads, kv, ffn, vocab, seq, tie, qkv_bias=True)


def _qwen3(h: int, layers: int, heads: int, ffn: int, tie: bool, kv: int = 8, **kw) -> QwenConfig:
    """Qwen3: an RMSNorm over each query and key head, head_dim 128 whatever hidden_size / heads is."""
    kw = {"vocab": 151936, "seq": 40960, "head_dim": 128, **kw}
    return _qwen(h, layers, heads, kv, ffn, kw.pop("vocab"), kw.pop("seq"), tie, qk_norm=True, **kw)


_MOE = {"num_experts": 128, "experts_per_token": 8, "router_aux_loss_coef": 0.001}
_QWEN2_MOE_TEST = {
    "num_experts": 8,
    "experts_per_token": 2,
    "router_aux_loss_coef": 0.001,
    "moe_renormalize": False,
    "shared_expert_ffn": 48,
    "shared_expert_gate": True,
}
_MOE_TEST = {"num_experts": 8, "experts_per_token": 2, "router_aux_loss_coef": 0.001}

PRESETS: dict[str, Callable[[], QwenConfig]] = {
    "qwen2.5-0.5b": lambda: _qwen25(896, 24, 14, 2, 4864, 151936, 32768, True),
    "qwen2.5-1.5b": lambda: _qwen25(1536, 28, 12, 2, 8960, 151936, 131072, True),
    "qwen2.5-3b": lambda: _qwen25(2048, 36, 16, 2, 11008, 151936, 32768, True),
    "qwen2.5-7b": lambda: _qwen25(3584, 28, 28, 4, 18944, 152064, 131072, False),
    "qwen2.5-14b": lambda: _qwen25(5120, 48, 40, 8, 13824, 152064, 131072, False),
    "qwen2.5-32b": lambda: _qwen25(5120, 64, 40, 8, 27648, 152064, 131072, False),
    "qwen2.5-72b": lambda: _qwen25(8192, 80, 64, 8, 29568, 152064, 131072, False),
    "qwen3-0.6b": lambda: _qwen3(1024, 28, 16, 3072, True),
    "qwen3-1.7b": lambda: _qwen3(2048, 28, 16, 6144, True),
    "qwen3-4b": lambda: _qwen3(2560, 36, 32, 9728, True),
    "qwen3-8b": lambda: _qwen3(4096, 36, 32, 12288, False),
    "qwen3-14b": lambda: _qwen3(5120, 40, 40, 17408, False),
    "qwen3-32b": lambda: _qwen3(5120, 64, 64, 25600, False),
    # Qwen3-MoE: every layer's MLP is 128 experts (the ffn is an expert's), top 8, renormalised
    "qwen3-30b-a3b": lambda: _qwen3(2048, 48, 32, 768, False, kv=4, **_MOE),
    "qwen3-235b-a22b": lambda: _qwen3(4096, 94, 64, 1536, False, kv=4, **_MOE),
    # Tiny shapes for tests: Qwen2.5's tied embeddings and q/k/v biases; Qwen3's q/k norms and a head_dim that is
    # not hidden_size / heads (64 / 4 = 16, heads of 32)
    "qwen2-test": lambda: _qwen(64, 2, 4, 2, 160, 256, 128, True, qkv_bias=True),
    "qwen3-test": lambda: _qwen(64, 2, 4, 2, 160, 256, 128, False, qk_norm=True, head_dim=32),
    "qwen3-test4": lambda: _qwen(64, 4, 4, 2, 160, 256, 128, False, qk_norm=True, head_dim=32),  # pipeline tests
    # Qwen2-MoE's shape: Qwen2's attention, 8 experts of 32, top 2 unrenormalised, a gated shared expert of 48
    "qwen2-moe-test": lambda: _qwen(64, 4, 4, 2, 32, 256, 128, True, qkv_bias=True, **_QWEN2_MOE_TEST),
    "qwen3-moe-test": lambda: _qwen(64, 2, 4, 2, 32, 256, 128, False, qk_norm=True, head_dim=32, **_MOE_TEST),
}
