"""The KV cache on CUDA (pytest -m gpu): decoding through SDPA and the Triton rotary/RMSNorm kernels with
one-token inputs, and the windowed prefill through flex, give the full recompute's logits (fp32) and tokens."""

import pytest
import torch
from test_kv_cache import NEW, PROMPT, SHAPES

from llamatron.inference.generate import next_token_logits, sample
from llamatron.models import build_model, config_from_dict, materialize
from llamatron.models.kv_cache import KVCache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", ["llama-gqa", "mistral-window", "falcon-7b-layout"])
def test_cached_steps_on_cuda_match_the_full_recompute(shape):
    cfg = config_from_dict({**SHAPES[shape], "init_std": 0.15})  # each family's config class
    model = materialize(build_model(cfg), cfg, 1, "cuda", torch.float32).eval()
    ids, cache = list(PROMPT), KVCache(len(PROMPT) + NEW)
    with torch.no_grad():
        for step in range(NEW):
            full = next_token_logits(model, ids, None)
            cached = next_token_logits(model, ids, cache)
            assert (cached - full).abs().max() <= 1e-4, f"step {step}"
            ids.append(int(full.argmax()))
    assert sample(model, PROMPT, NEW, temperature=0, use_cache=True) == ids[len(PROMPT) :]
