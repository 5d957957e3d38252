"""Falcon 7B and 40B with their published shapes, and tiny ones for tests."""

from __future__ import annotations

from collections.abc import Callable

from .config import FalconConfig


def _falcon(h: int, layers: int, heads: int, kv: int, ffn: int, vocab: int = 65024, **kw) -> FalconConfig:
    return FalconConfig(
        family="falcon",
        vocab_size=vocab,
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        max_seq_length=kw.pop("seq", 2048),
        tie_embeddings=True,
        **kw,
    )


PRESETS: dict[str, Callable[[], FalconConfig]] = {
    # parallel attention/MLP, LayerNorm, GELU MLP, tied embeddings
    "falcon-7b": lambda: _falcon(4544, 32, 71, 1, 4 * 4544),
    "falcon-40b": lambda: _falcon(8192, 60, 128, 8, 4 * 8192, separate_mlp_norm=True),
    # Tiny shapes for tests
    "falcon-test4": lambda: _falcon(64, 4, 4, 1, 256, vocab=256, seq=128),
    "falcon-test": lambda: _falcon(64, 2, 4, 1, 256, vocab=256, seq=128),
    "falcon40b-test": lambda: _falcon(64, 2, 8, 2, 256, vocab=256, seq=128, separate_mlp_norm=True),
}
