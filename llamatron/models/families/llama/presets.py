"""Llama 1/2/3, Code Llama, Mistral and Mixtral with their published shapes, and tiny ones for tests and the demo."""

from __future__ import annotations

from collections.abc import Callable

from ...config import ModelConfig, RopeScaling


def _llama(
    h: int,
    layers: int,
    heads: int,
    ffn: int,
    kv: int | None = None,
    vocab: int = 32000,
    seq: int = 2048,
    theta: float = 10000.0,
    eps: float = 1e-6,
    **kw,
) -> ModelConfig:
    return ModelConfig(
        family="llama",
        vocab_size=vocab,
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv if kv is not None else heads,
        ffn_hidden_size=ffn,
        max_seq_length=seq,
        rope_theta=theta,
        norm_eps=eps,
        **kw,
    )


def _llama3_scaling(factor: float = 8.0) -> RopeScaling:
    return RopeScaling(
        kind="llama3", factor=factor, original_max_position=8192, low_freq_factor=1.0, high_freq_factor=4.0
    )


def _llama31(h: int, layers: int, heads: int, ffn: int, factor: float = 8.0, **kw) -> ModelConfig:
    """Llama 3.1 / 3.2 / 3.3 (their config.json): 128k vocab and context, 8 KV heads, theta 5e5, llama3 rope scaling."""
    scaling = _llama3_scaling(factor)
    return _llama(
        h, layers, heads, ffn, kv=8, vocab=128256, seq=131072, theta=500000.0, eps=1e-5, rope_scaling=scaling, **kw
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    # Llama 1 (2023-02): multi-head, 2k context
    "llama-7b": lambda: _llama(4096, 32, 32, 11008),
    "llama-13b": lambda: _llama(5120, 40, 40, 13824),
    "llama-30b": lambda: _llama(6656, 60, 52, 17920),
    "llama-65b": lambda: _llama(8192, 80, 64, 22016),
    # Llama 2: 4k context, GQA for 70B
    "llama2-7b": lambda: _llama(4096, 32, 32, 11008, seq=4096, eps=1e-5),
    "llama2-13b": lambda: _llama(5120, 40, 40, 13824, seq=4096, eps=1e-5),
    "llama2-70b": lambda: _llama(8192, 80, 64, 28672, kv=8, seq=4096, eps=1e-5),
    # Code Llama: rope theta 1e6, 16k context, vocab 32016 for 7B/13B
    "codellama-7b": lambda: _llama(4096, 32, 32, 11008, vocab=32016, seq=16384, theta=1e6, eps=1e-5),
    "codellama-13b": lambda: _llama(5120, 40, 40, 13824, vocab=32016, seq=16384, theta=1e6, eps=1e-5),
    "codellama-34b": lambda: _llama(8192, 48, 64, 22016, kv=8, seq=16384, theta=1e6, eps=1e-5),
    # Llama 3 / 3.1: 128k vocab, GQA, theta 5e5; 3.1 adds the llama3 rope scaling
    "llama3-8b": lambda: _llama(4096, 32, 32, 14336, kv=8, vocab=128256, seq=8192, theta=500000.0, eps=1e-5),
    "llama3-70b": lambda: _llama(8192, 80, 64, 28672, kv=8, vocab=128256, seq=8192, theta=500000.0, eps=1e-5),
    "llama3.1-8b": lambda: _llama31(4096, 32, 32, 14336),
    "llama3.1-70b": lambda: _llama31(8192, 80, 64, 28672),
    # Llama 3.1 405B (Dubey et al. 2024, Table 3: 126 layers, 16384 wide, 128 heads, 8 KV heads, FFN 53248)
    "llama3.1-405b": lambda: _llama31(16384, 126, 128, 53248),
    # Llama 3.2 1B / 3B: the embedding is the head (tie_word_embeddings), rope scaling factor 32; 3B's head_dim
    # 128 is 3072 / 24 (config.json says it too)
    "llama3.2-1b": lambda: _llama31(2048, 16, 32, 8192, factor=32.0, tie_embeddings=True),
    "llama3.2-3b": lambda: _llama31(3072, 28, 24, 8192, factor=32.0, tie_embeddings=True),
    # Llama 3.3 70B: Llama 3.1 70B's shape
    "llama3.3-70b": lambda: _llama31(8192, 80, 64, 28672),
    # Mistral 7B v0.1: GQA + sliding window 4096
    "mistral-7b": lambda: _llama(4096, 32, 32, 14336, kv=8, seq=32768, eps=1e-5, sliding_window=4096),
    # Mixtral: Mistral's attention (no window) with 8 SwiGLU experts per layer, 2 per token; theta 1e6
    "mixtral-8x7b": lambda: _llama(
        4096, 32, 32, 14336, kv=8, seq=32768, theta=1e6, eps=1e-5, num_experts=8, experts_per_token=2
    ),
    "mixtral-8x22b": lambda: _llama(
        6144, 56, 48, 16384, kv=8, vocab=32768, seq=65536, theta=1e6, eps=1e-5, num_experts=8, experts_per_token=2
    ),
    # The MoE benchmark shape (issue 20): llama-1b's attention, 8 experts of 5632, top-2
    "mixtral-1b": lambda: _llama(2048, 16, 32, 5632, kv=8, seq=4096, eps=1e-5, num_experts=8, experts_per_token=2),
    # The benchmark shape (issue 7): ~1.1B parameters
    "llama-1b": lambda: _llama(2048, 16, 32, 5632, kv=8, seq=4096, eps=1e-5),
    # Tiny shapes for tests and the CPU demo
    "llama-tiny": lambda: _llama(256, 4, 8, 688, kv=4, vocab=4096, seq=512, eps=1e-5),
    "llama-test": lambda: _llama(64, 2, 4, 160, kv=2, vocab=256, seq=128, eps=1e-5),
    "mistral-test": lambda: _llama(64, 2, 4, 160, kv=2, vocab=256, seq=128, eps=1e-5, sliding_window=16),
    "llama3-test": lambda: _llama(
        64,
        2,
        4,
        160,
        kv=1,
        vocab=256,
        seq=128,
        theta=500000.0,
        eps=1e-5,
        rope_scaling=RopeScaling("llama3", 8.0, 32, 1.0, 4.0),
    ),
    "mixtral-test": lambda: _llama(
        64, 2, 4, 96, kv=2, vocab=256, seq=128, eps=1e-5, num_experts=4, experts_per_token=2
    ),
    "mixtral-test4": lambda: _llama(
        64, 4, 4, 96, kv=2, vocab=256, seq=128, eps=1e-5, num_experts=4, experts_per_token=2
    ),  # pipeline tests: 4 layers
    "llama-test4": lambda: _llama(64, 4, 4, 160, kv=2, vocab=256, seq=128, eps=1e-5),  # pipeline tests: 4 layers
}
