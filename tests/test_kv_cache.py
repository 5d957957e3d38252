"""Generation with the KV cache gives the tokens and logits of recomputing the whole sequence per token (fp32)."""

from __future__ import annotations

import pytest
import torch

from llamatron.inference.generate import next_token_logits, sample
from llamatron.models import RopeScaling, build_model, config_from_dict, get_preset, materialize
from llamatron.models.kv_cache import KVCache

# init_std 0.15, seed 1: a random tiny model whose next token depends on its context (at 0.02 it repeats one token).
_BASE = dict(
    family="llama", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=96, max_seq_length=64
)
SHAPES = {
    "llama-mha": dict(_BASE, num_kv_heads=4),
    "llama-gqa": dict(_BASE, num_kv_heads=2),
    "llama3-mqa-rope-scaling": dict(
        _BASE, num_kv_heads=1, rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, original_max_position=8)
    ),
    "llama-linear-scaling-tied-bias": dict(
        _BASE, num_kv_heads=2, rope_scaling=RopeScaling("linear", 4.0), tie_embeddings=True, bias=True
    ),
    # the frequencies change with the length past 12 tokens: the cache must be refilled from there on
    "llama-dynamic-scaling": dict(_BASE, num_kv_heads=2, rope_scaling=RopeScaling("dynamic", 2.0, 12)),
    "mistral-window": dict(_BASE, num_kv_heads=2, sliding_window=5),  # shorter than the generated length
    "falcon-7b-layout": dict(_BASE, family="falcon", num_kv_heads=1),
    "falcon-40b-layout": dict(_BASE, family="falcon", num_heads=8, num_kv_heads=2, separate_mlp_norm=True, bias=True),
    "past-the-context": dict(_BASE, num_kv_heads=2, max_seq_length=12),  # 4 + 24 tokens: cropped, positions shift
    "mixtral-experts": dict(_BASE, num_kv_heads=2, num_experts=4, experts_per_token=2),
    # latent attention (its compressed cache: the latent and the rotary key), YaRN, grouped routing, a dense layer
    "deepseek-v3-latent": {**get_preset("deepseek-v3-test").to_dict(), "vocab_size": 128, "max_seq_length": 64},
}
PROMPT, NEW = [5, 17, 99, 3], 24


def tiny_model(shape: str):
    cfg = config_from_dict({**SHAPES[shape], "init_std": 0.15})  # each family's config class
    return materialize(build_model(cfg), cfg, 1, "cpu", torch.float32).eval()


@pytest.mark.parametrize("shape", SHAPES)
def test_cached_steps_match_the_full_recompute(shape):
    model = tiny_model(shape)
    ids, cache = list(PROMPT), KVCache(min(len(PROMPT) + NEW, model.cfg.max_seq_length))
    with torch.no_grad():
        for step in range(NEW):
            full = next_token_logits(model, ids, None)
            cached = next_token_logits(model, ids, cache)
            assert (cached - full).abs().max() <= 1e-5, f"step {step}"
            ids.append(int(full.argmax()))
    generated = ids[len(PROMPT) :]
    assert len(set(generated)) >= 4, generated  # the model's choice depends on its context
    assert sample(model, PROMPT, NEW, temperature=0, use_cache=True) == generated
    assert sample(model, PROMPT, NEW, temperature=0, use_cache=False) == generated


def test_sampling_draws_the_same_tokens_with_the_cache():
    model = tiny_model("llama-gqa")
    with_cache = sample(model, PROMPT, NEW, temperature=1.0, top_k=20, seed=3, use_cache=True)
    assert with_cache == sample(model, PROMPT, NEW, temperature=1.0, top_k=20, seed=3, use_cache=False)
    assert with_cache != sample(model, PROMPT, NEW, temperature=1.0, top_k=20, seed=4, use_cache=True)


def test_the_prompt_runs_once_then_one_token_per_step():
    model = tiny_model("llama-gqa")
    lengths = []
    model.embed.register_forward_pre_hook(lambda _m, args: lengths.append(args[0].shape[1]))
    sample(model, PROMPT, 6, temperature=0)
    assert lengths == [len(PROMPT)] + [1] * 5


@pytest.mark.parametrize("window", [None, 3])
def test_a_chunk_after_the_cache_sees_the_cached_prefix(window):
    """Several tokens at once after a cache (queries at an offset: the mask of models/attention.py)."""
    cfg = config_from_dict({**SHAPES["llama-gqa"], "sliding_window": window, "init_std": 0.15})
    model = materialize(build_model(cfg), cfg, 1, "cpu", torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    cache = KVCache(16)
    with torch.no_grad():
        full = model(tokens)
        first = model(tokens[:, :4], cache=cache)
        rest = model(tokens[:, 4:], cache=cache)
    assert cache.length == 11
    assert (torch.cat([first, rest], 1) - full).abs().max() <= 1e-5


def test_a_full_cache_is_refused():
    model = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match="KV cache full: 3 cached \\+ 2 new tokens > max_length 4"):
        cache = KVCache(4)
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        model(torch.tensor([[4, 5]]), cache=cache)
