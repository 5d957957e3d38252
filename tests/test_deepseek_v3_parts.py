"""DeepSeek-V3's own modules (llamatron/models/families/deepseek_v3/), each against transformers' DeepSeek-V3 or the
formula written out here: multi-head latent attention (with and without the low-rank query, the interleaved rotary
rows of DeepSeek's checkpoints, YaRN), its compressed decode cache against the full forward, YaRN's tables,
group-limited routing, and multi-token prediction with its loss. fp32, tiny shapes, random weights."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
    DeepseekV3TopkRouter,
)

from llamatron.errors import ConfigError
from llamatron.models import yarn as shared_yarn
from llamatron.models.attention import attention_mask, decode_mask
from llamatron.models.families.deepseek_v3 import mla, mtp, rope, routing
from llamatron.models.families.deepseek_v3.mla_cache import MLACache
from llamatron.models.kv_cache import KVCache
from llamatron.models.layer_input import LayerInput


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-5 relative, an element near 0 within 1e-5 of the tensor's largest (fp32 sums of a few hundred
    terms round at ~1e-7 of their largest term)."""
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.detach().abs().max()))


def hf_config(q_lora_rank: int | None, rope_interleave: bool = True, **kw) -> DeepseekV3Config:
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=10,  # narrower than qk_head_dim (14): the values' width is their own
        rope_interleave=rope_interleave,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        max_position_embeddings=64,
        vocab_size=50,
    )
    config = DeepseekV3Config(**{**base, **kw})
    config._attn_implementation = "eager"
    return config


def mla_config(hf: DeepseekV3Config, softmax_scale: float | None = None) -> mla.MLAConfig:
    return mla.MLAConfig(
        hidden_size=hf.hidden_size,
        num_heads=hf.num_attention_heads,
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        softmax_scale=softmax_scale,
    )


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn anew (norm weights too: ones would hide a swapped norm)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 1 else 0.3) + (1.0 if p.dim() == 1 else 0))


def hf_attention(config: DeepseekV3Config, seed: int = 0) -> DeepseekV3Attention:
    attn = DeepseekV3Attention(config, layer_idx=0)
    randomize(attn, seed)
    return attn


def ours_from(hf: DeepseekV3Attention, cfg: mla.MLAConfig, rope_interleave: bool) -> mla.MLAttention:
    attn = mla.MLAttention(cfg)
    attn.load_state_dict(mla.state_from_hf(hf.state_dict(), cfg, rope_interleave))
    return attn


def causal_bias(seq: int) -> torch.Tensor:
    return torch.full((1, 1, seq, seq), float("-inf")).triu(1)


def inv_freq(dim: int, theta: float = 1000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def rotary(inv_freq: torch.Tensor, positions: torch.Tensor, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin in llamatron's half-split layout (as layers.rope_cos_sin makes them), times YaRN's factor."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * factor, emb.sin() * factor


def cos_sin(dim: int, seq: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary(inv_freq(dim), torch.arange(seq).expand(batch, seq))


def hf_forward(attn: DeepseekV3Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return attn(x, position_embeddings=(cos, sin), attention_mask=causal_bias(x.shape[1]))[0]


# ---- multi-head latent attention ------------------------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("interleave", [True, False])
def test_mla_matches_transformers_outputs_and_input_gradients(q_lora_rank, interleave):
    config = hf_config(q_lora_rank, interleave)
    theirs = hf_attention(config)
    cfg = mla_config(config)
    ours = ours_from(theirs, cfg, interleave)
    assert (ours.q is None) == (q_lora_rank is not None)
    x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = cos_sin(config.qk_rope_head_dim, 9, batch=2)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = hf_forward(theirs, x1, cos, sin), ours(x2, LayerInput(cos, sin))
    assert_close(got, expected)
    expected.square().sum().backward()
    got.square().sum().backward()
    assert_close(x2.grad, x1.grad)


def test_the_interleaved_rotary_rows_must_be_reordered_at_import():
    """DeepSeek's checkpoints rotate pairs (rope_interleave): loaded without reordering, the rotary rows rotate the
    wrong dimensions together and the output is not transformers'."""
    config = hf_config(12, rope_interleave=True)
    theirs = hf_attention(config)
    cfg = mla_config(config)
    unordered = ours_from(theirs, cfg, rope_interleave=False)
    x = torch.randn(1, 7, config.hidden_size, generator=torch.Generator().manual_seed(2))
    cos, sin = cos_sin(config.qk_rope_head_dim, 7)
    assert not torch.allclose(unordered(x, LayerInput(cos, sin)), hf_forward(theirs, x, cos, sin), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_mla_names_and_row_order_round_trip_bitwise(q_lora_rank):
    config = hf_config(q_lora_rank)
    theirs = hf_attention(config).state_dict()
    cfg = mla_config(config)
    ours = mla.state_from_hf(theirs, cfg, rope_interleave=True)
    assert set(ours) == set(mla.MLAttention(cfg).state_dict())
    back = mla.state_to_hf(ours, cfg, rope_interleave=True)
    assert set(back) == set(theirs)
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)
    # the rotary rows of each block, pairs (0, 1), (2, 3), (4, 5) in the checkpoint, become halves 0 2 4 | 1 3 5
    halves = [0, 2, 4, 1, 3, 5]
    q = "q_b" if q_lora_rank else "q"
    for name, blocks, block in ((q, 4, 14), ("kv_a", 1, 22)):
        mine, hf = ours[f"{name}.weight"].view(blocks, block, -1), theirs[f"{mla.HF_NAMES[name]}.weight"]
        hf = hf.view(blocks, block, -1)
        assert torch.equal(mine[:, : block - 6], hf[:, : block - 6])
        assert torch.equal(mine[:, block - 6 :], hf[:, [block - 6 + i for i in halves]])


def test_mla_with_yarn_matches_transformers():
    """YaRN end to end: transformers' rotary table (its cos/sin times the attention factor) and its softmax scale
    (times mscale(factor, mscale_all_dim)²) against rope.py's, with mscale and mscale_all_dim apart."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 500.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
        "mscale": 0.9,
        "mscale_all_dim": 0.7,
    }
    config = hf_config(12, rope_parameters=yarn)
    theirs = hf_attention(config, seed=3)
    scale = rope.yarn_softmax_scale(config.qk_nope_head_dim + config.qk_rope_head_dim, 4.0, 0.7)
    cfg = mla_config(config, softmax_scale=scale)
    ours = ours_from(theirs, cfg, rope_interleave=True)
    seq = 40  # past the trained 16 positions
    x = torch.randn(1, seq, config.hidden_size, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(seq)[None]
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(config)(x, positions)
    inv_freq = shared_yarn.yarn_inv_freq(config.qk_rope_head_dim, 500.0, 4.0, 16, beta_fast=8.0, beta_slow=1.0)
    cos, sin = rotary(inv_freq, positions, shared_yarn.yarn_attention_factor(4.0, 0.9, 0.7))
    assert_close(ours(x, LayerInput(cos, sin)), hf_forward(theirs, x, hf_cos, hf_sin))


@pytest.mark.parametrize("v_head_dim", [10, 20])
def test_values_of_another_width_run_under_the_one_width_kernels(v_head_dim):
    """SDPA's flash kernel wants q, k and v equally wide (on CPU too): v_head_dim 10 or 20 against qk_head_dim 14
    is padded, not refused, and the output is the math kernel's."""
    config = hf_config(12, v_head_dim=v_head_dim)
    cfg = mla_config(config)
    ours = ours_from(hf_attention(config), cfg, rope_interleave=True)
    x = torch.randn(2, 8, config.hidden_size, generator=torch.Generator().manual_seed(5))
    cos, sin = cos_sin(config.qk_rope_head_dim, 8, batch=2)
    ours.backend = "math"
    expected = ours(x, LayerInput(cos, sin))
    ours.backend = "flash"
    assert_close(ours(x, LayerInput(cos, sin)), expected)


def test_mla_config_problems_are_one_line_each_and_refused_before_building():
    bad = mla.MLAConfig(32, 4, 0, 16, 8, 5, 10, softmax_scale=-1.0)
    problems = bad.problems()
    assert len(problems) == 3 and all("\n" not in p for p in problems)
    assert any("qk_rope_head_dim=5" in p and "even" in p for p in problems)
    assert any("q_lora_rank=0" in p for p in problems)
    with pytest.raises(ConfigError, match="multi-head latent attention: .*q_lora_rank=0"):
        mla.MLAttention(bad)
    assert not mla_config(hf_config(None)).problems()


# ---- the compressed decode cache -------------------------------------------------------------------------------


def decode_stepwise(attn: mla.MLAttention, x: torch.Tensor, prefill: int) -> tuple[torch.Tensor, MLACache]:
    """x's outputs computed as generation does: `prefill` tokens at once, then one token a step after the cache."""
    batch, seq, _ = x.shape
    cos, sin = cos_sin(attn.cfg.qk_rope_head_dim, seq, batch)
    owner = KVCache(max_length=seq + 3)
    cache = MLACache(owner)
    outs = [attn(x[:, :prefill], LayerInput(cos[:, :prefill], sin[:, :prefill], None, cache))]
    owner.advance(prefill)
    for i in range(prefill, seq):
        mask = attention_mask(1, None, None, x.device, offset=owner.length)
        outs.append(attn(x[:, i : i + 1], LayerInput(cos[:, i : i + 1], sin[:, i : i + 1], mask, cache)))
        owner.advance(1)
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize(("q_lora_rank", "prefill", "yarn"), [(None, 1, False), (12, 5, True)])
def test_decoding_with_the_compressed_cache_equals_the_full_forward(q_lora_rank, prefill, yarn):
    config = hf_config(q_lora_rank)
    cfg = mla_config(config, softmax_scale=rope.yarn_softmax_scale(14, 40.0, 1.0) if yarn else None)
    attn = ours_from(hf_attention(config, seed=6), cfg, rope_interleave=True)
    seq = 18
    x = torch.randn(2, seq, config.hidden_size, generator=torch.Generator().manual_seed(7))
    full = attn(x, LayerInput(*cos_sin(cfg.qk_rope_head_dim, seq, 2)))
    with torch.no_grad():
        stepwise, cache = decode_stepwise(attn, x, prefill)
    assert_close(stepwise, full)
    # per token and layer the cache holds the latent and the rotary key, nothing per head
    assert cache.buffer is not None
    bytes_per_token = cache.buffer.numel() * cache.buffer.element_size() / (2 * (seq + 3))
    assert bytes_per_token == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 == cfg.cache_bytes_per_token(4)


def test_the_absorbed_decode_never_builds_keys_or_values_per_head():
    """After the prefill kv_b is never called: its weight is read, split into the key and value parts."""
    config = hf_config(12)
    attn = ours_from(hf_attention(config), mla_config(config), rope_interleave=True)
    calls = []
    attn.kv_b.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(1, 6, config.hidden_size)
    with torch.no_grad():
        decode_stepwise(attn, x, prefill=2)
    assert len(calls) == 1


def test_per_row_decoding_after_a_right_padded_prefill():
    """Two prompts of 3 and 5 tokens prefilled right-padded, then one token a row and step at each row's own
    position (KVCache.continue_rows, decode_mask): every row's outputs are its own sequence's full forward."""
    config = hf_config(12)
    cfg = mla_config(config)
    attn = ours_from(hf_attention(config, seed=8), cfg, rope_interleave=True)
    steps, lengths = 4, [3, 5]
    seqs = [torch.randn(1, n + steps, config.hidden_size, generator=torch.Generator().manual_seed(n)) for n in lengths]
    fulls = [attn(s, LayerInput(*cos_sin(cfg.qk_rope_head_dim, s.shape[1]))) for s in seqs]
    owner = KVCache(max_length=12)
    cache = MLACache(owner)
    prompt = torch.zeros(2, 5, config.hidden_size)
    for row, (s, n) in enumerate(zip(seqs, lengths)):
        prompt[row, :n] = s[0, :n]
    with torch.no_grad():
        attn(prompt, LayerInput(*cos_sin(cfg.qk_rope_head_dim, 5, 2), None, cache))
        owner.advance(5)
        owner.continue_rows(torch.tensor(lengths))
        for step in range(steps):
            positions = owner.positions.clone()
            x = torch.stack([s[0, n + step] for s, n in zip(seqs, lengths)])[:, None]
            cos, sin = rotary(inv_freq(cfg.qk_rope_head_dim), positions[:, None])
            out = attn(x, LayerInput(cos, sin, decode_mask(positions, 12, None, x.dtype), cache))
            for row, (full, n) in enumerate(zip(fulls, lengths)):
                assert_close(out[row, 0], full[0, n + step])
            owner.advance(1)


# ---- YaRN -----------------------------------------------------------------------------------------------------

DEEPSEEK_V3_YARN = {  # DeepSeek-V3's published rope_scaling (config.json), with its rope_theta
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
SMALL_YARN = {  # a small one no checkpoint has: every knob away from its default
    "rope_type": "yarn",
    "rope_theta": 500.0,
    "factor": 5.5,
    "original_max_position_embeddings": 64,
    "beta_fast": 16.0,
    "beta_slow": 2.0,
    "mscale": 0.8,
    "mscale_all_dim": 0.6,
}


@pytest.mark.parametrize(
    ("params", "rope_dim", "truncate"),
    [
        (DEEPSEEK_V3_YARN, 64, True),
        (SMALL_YARN, 16, True),
        (SMALL_YARN, 16, False),
        ({**SMALL_YARN, "mscale": 0}, 8, True),
    ],
)
def test_yarn_tables_match_transformers(params, rope_dim, truncate):
    params = {**params, "truncate": truncate}
    config = DeepseekV3Config(
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=2 * rope_dim, rope_parameters=params, max_position_embeddings=163840
    )
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    p = params
    got = shared_yarn.yarn_inv_freq(
        rope_dim,
        p["rope_theta"],
        p["factor"],
        p["original_max_position_embeddings"],
        p["beta_fast"],
        p["beta_slow"],
        truncate,
    )
    torch.testing.assert_close(got, hf_inv_freq, rtol=1e-6, atol=0)
    assert shared_yarn.yarn_attention_factor(p["factor"], p["mscale"], p["mscale_all_dim"]) == pytest.approx(
        hf_factor, rel=1e-12
    )
    qk = 3 * rope_dim
    # transformers' own function (5.25; older releases lack it: the GPU machine's 5.17)
    yarn_apply_mscale = pytest.importorskip("transformers.modeling_rope_utils").__dict__.get("yarn_apply_mscale")
    if yarn_apply_mscale is None:
        pytest.skip("this transformers has no yarn_apply_mscale (5.25 has)")
    expected = yarn_apply_mscale(config.rope_parameters, qk**-0.5)
    assert rope.yarn_softmax_scale(qk, p["factor"], p["mscale_all_dim"]) == pytest.approx(expected, rel=1e-12)


def test_yarn_by_its_formula():
    """The formula as the paper writes it, for DeepSeek-V3's numbers: mscale = 0.1 ln(40) + 1, the softmax scale
    192^-1/2 · mscale², the fastest dimension as trained and the slowest divided by 40."""
    m = 0.1 * math.log(40) + 1
    assert shared_yarn.yarn_mscale(40.0, 1.0) == pytest.approx(m) and shared_yarn.yarn_mscale(0.5, 1.0) == 1.0
    assert rope.yarn_softmax_scale(192, 40.0, 1.0) == pytest.approx(192**-0.5 * m * m)
    assert shared_yarn.yarn_attention_factor(40.0, 1.0, 1.0) == 1.0
    inv_freq = shared_yarn.yarn_inv_freq(64, 10000.0, 40.0, 4096)
    assert inv_freq[0] == 1.0 and inv_freq[-1] == pytest.approx(10000.0 ** (-62 / 64) / 40)


# ---- group-limited routing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("experts", "n_group", "topk_group", "top_k", "norm"),
    [(32, 8, 3, 6, True), (32, 8, 3, 6, False), (16, 4, 1, 4, True), (12, 1, 1, 3, True)],
)
def test_group_limited_topk_matches_transformers_router(experts, n_group, topk_group, top_k, norm):
    config = DeepseekV3Config(
        hidden_size=24,
        n_routed_experts=experts,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    router = DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.3)
    hidden = torch.randn(96, 24, generator=g)  # continuous draws: no ties between scores
    logits, hf_weights, hf_chosen = router(hidden)
    chosen, weights = routing.group_limited_topk(
        logits, router.e_score_correction_bias, n_group, topk_group, top_k, norm, 2.5
    )
    order, hf_order = chosen.sort(dim=-1), hf_chosen.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices), rtol=1e-6, atol=0
    )
    if topk_group < n_group:  # the groups matter here: without them the choice differs for some tokens
        plain = (torch.sigmoid(logits) + router.e_score_correction_bias).topk(top_k, dim=-1).indices.sort(-1).values
        assert not torch.equal(plain, order.values)


def test_the_bias_chooses_and_the_unbiased_score_weighs():
    """A large bias on expert 3 puts it among every token's choices; its weight stays its plain sigmoid score."""
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(10))
    bias = torch.zeros(8)
    bias[3] = 100.0
    chosen, weights = routing.group_limited_topk(logits, bias, 1, 1, 2, False, 1.0)
    assert (chosen == 3).any(-1).all()
    torch.testing.assert_close(weights[chosen == 3], torch.sigmoid(logits[:, 3]))


def test_routing_problems_name_each_rule_in_one_line():
    assert routing.routing_problems(256, 8, 4, 8) == []
    assert "does not divide" in routing.routing_problems(10, 4, 2, 2)[0]
    assert "best 2" in routing.routing_problems(8, 8, 4, 2)[0]
    assert "topk_group=5" in routing.routing_problems(16, 4, 5, 2)[0]
    assert "num_experts_per_tok=9" in routing.routing_problems(16, 4, 2, 9)[0]


# ---- multi-token prediction ------------------------------------------------------------------------------------


class HFToyLayer(torch.nn.Module):
    """A stand-in decoder layer with transformers' call (MtpLayer builds its block from a class)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.mix = torch.nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, **kwargs):
        return hidden_states + torch.tanh(self.mix(hidden_states))


class ToyLayer(torch.nn.Module):
    """The same layer with llamatron's call; `causal`: plus a running sum over the positions (position i reads
    positions <= i, so padding after the end cannot reach an earlier position)."""

    def __init__(self, hidden: int, causal: bool = True):
        super().__init__()
        self.mix = torch.nn.Linear(hidden, hidden)
        self.causal = causal

    def forward(self, x, inputs):
        out = x + torch.tanh(self.mix(x))
        return out + 0.1 * x.cumsum(dim=1) * inputs.cos[..., :1] if self.causal else out


def test_mtp_module_matches_transformers_mtp_layer():
    """enorm on the embedding, hnorm on the hidden state, eh_proj over [embedding; hidden] (DeepSeek's order),
    the block, then the module's own norm (shared_head.norm, transformers' post_norm)."""
    config = DeepseekV3Config(hidden_size=16, rms_norm_eps=1e-6)
    # transformers 5.25's (older releases, the GPU machine's 5.17, lack it)
    mtp_layer = pytest.importorskip("transformers.modeling_layers").__dict__.get("MtpLayer")
    if mtp_layer is None:
        pytest.skip("this transformers has no MtpLayer (5.25 has)")
    theirs = mtp_layer(config, HFToyLayer, DeepseekV3RMSNorm, layer_idx=0)
    randomize(theirs, 11)
    ours = mtp.MTPModule(mtp.MTPConfig(16, 1e-6), ToyLayer(16, causal=False))
    names = {"post_norm": "norm", "mtp_block": "block"}
    ours.load_state_dict(
        {names.get(k.split(".")[0], k.split(".")[0]) + k[k.index(".") :]: v for k, v in theirs.state_dict().items()}
    )
    g = torch.Generator().manual_seed(12)
    h, emb = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    cos, sin = cos_sin(4, 5, 2)
    expected = theirs(emb, h, position_embeddings=(cos, sin), attention_mask=None, position_ids=None, cache=None)
    assert_close(ours.norm(ours(h, emb, LayerInput(cos, sin))), expected)


def test_mtp_depths_read_the_tokens_ahead_and_chain_their_hidden_states():
    """Depth k at position i reads token i + k and the previous depth's hidden state at i (before that depth's
    norm); its logits are head(norm_k(h_k)). Written out position by position."""
    hidden, vocab, depths = 8, 11, 2
    g = torch.Generator().manual_seed(13)
    embed, head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab, bias=False)
    modules = [mtp.MTPModule(mtp.MTPConfig(hidden, 1e-6), ToyLayer(hidden)) for _ in range(depths)]
    for i, m in enumerate([embed, head, *modules]):
        randomize(m, 20 + i)
    tokens = torch.randint(0, vocab, (2, 6), generator=g)
    h0 = torch.randn(2, 6, hidden, generator=g)
    cos, sin = cos_sin(4, 6, 2)
    got = mtp.mtp_logits(modules, h0, tokens, embed, head, LayerInput(cos, sin))
    h = h0
    for k, module in enumerate(modules, start=1):
        ahead = torch.zeros_like(tokens)
        for b in range(2):
            for i in range(6):
                ahead[b, i] = tokens[b, i + k] if i + k < 6 else 0
        h = module(h, embed(ahead), LayerInput(cos, sin))
        assert_close(got[k - 1], head(module.norm(h)))


def test_mtp_loss_against_the_formula_written_out():
    """λ/D · Σ_k mean over the positions i whose target t_{i+k+1} = labels[i+k] exists and is not IGNORE_INDEX
    of -log softmax(logits_k[i])[target]; the last k positions of depth k have none and count nothing."""
    depths, batch, seq, vocab, weight = 3, 2, 7, 13, 0.3
    g = torch.Generator().manual_seed(14)
    logits = [torch.randn(batch, seq, vocab, generator=g) for _ in range(depths)]
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, 4] = labels[1, 0] = -100  # IGNORE_INDEX: a masked label
    per_depth = []
    for k in range(1, depths + 1):
        total, count = 0.0, 0
        for b in range(batch):
            for i in range(seq):
                if i + k < seq and labels[b, i + k] != -100:
                    total -= torch.log_softmax(logits[k - 1][b, i].double(), dim=-1)[labels[b, i + k]].item()
                    count += 1
        per_depth.append(total / count)
    expected = weight * sum(per_depth) / depths
    assert mtp.mtp_loss(logits, labels, weight).item() == pytest.approx(expected, rel=1e-6)
    sums, counts = mtp.mtp_sums(logits, labels)
    assert counts.tolist() == [2 * (seq - k) - (k <= 4) for k in range(1, depths + 1)]
    # the positions without a target: anything there changes nothing
    for k, depth in enumerate(logits, start=1):
        depth[:, seq - k :] = 1e4 * torch.randn(batch, k, vocab, generator=g)
    assert mtp.mtp_loss(logits, labels, weight).item() == pytest.approx(expected, rel=1e-6)


def test_mtp_problems():
    assert mtp.mtp_problems(1, 0.3, 4096) == [] and mtp.mtp_problems(0, 0.0, 1) == []
    assert "must exceed" in mtp.mtp_problems(2, 0.1, 2)[0]
    assert ">= 0" in mtp.mtp_problems(-1, 0.1, 8)[0]
