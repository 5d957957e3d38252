"""llamatron's models compute what transformers' do, for every family, through the Hugging Face name mapping."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import FAMILIES, make_hf_model, random_tokens

from llamatron.interop.hf import config_from_hf, hf_to_llamatron, llamatron_to_hf
from llamatron.models import build_model


def llamatron_from_hf(hf_model):
    hf_config = hf_model.config.to_dict()
    cfg = config_from_hf(hf_config)
    model = build_model(cfg, device="cpu")
    model.load_state_dict(hf_to_llamatron(hf_model.state_dict(), cfg, hf_config), strict=True)
    return model.eval(), cfg


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family):
    hf_model = make_hf_model(family)
    model, cfg = llamatron_from_hf(hf_model)
    seq = FAMILIES[family][2]
    tokens = random_tokens(2, seq)
    with torch.no_grad():
        expected = hf_model(tokens).logits
        got = model(tokens)
    assert got.shape == expected.shape
    assert expected.abs().max() > 0.1  # the check below is not vacuous
    assert (got - expected).abs().max().item() <= 1e-4
    if cfg.sliding_window is not None:
        assert seq > cfg.sliding_window


def test_features_reach_the_llamatron_config():
    """The variants above really exercise what they are named after."""
    cfgs = {f: config_from_hf(make_hf_model(f).config.to_dict()) for f in FAMILIES}
    assert cfgs["llama2-gqa"].num_kv_heads == 2
    assert cfgs["llama3-rope-scaling"].rope_scaling.kind == "llama3"
    assert cfgs["llama3-rope-scaling"].rope_scaling.original_max_position == 16
    assert cfgs["codellama-theta"].rope_theta == 1e6
    assert cfgs["llama-linear-scaling"].rope_scaling.kind == "linear"
    assert cfgs["llama-dynamic-scaling"].rope_scaling.kind == "dynamic"
    assert cfgs["llama-tied-bias"].tie_embeddings and cfgs["llama-tied-bias"].bias
    assert cfgs["mistral-window"].sliding_window == 8
    assert cfgs["falcon-7b-layout"].num_kv_heads == 1 and not cfgs["falcon-7b-layout"].separate_mlp_norm
    assert cfgs["falcon-40b-layout"].num_kv_heads == 2 and cfgs["falcon-40b-layout"].separate_mlp_norm
    assert cfgs["falcon-mha-bias"].num_kv_heads == 4 and cfgs["falcon-mha-bias"].bias


@pytest.mark.parametrize("family", ["llama2-gqa", "falcon-40b-layout", "falcon-mha-bias"])
def test_mapping_back_restores_every_tensor(family):
    hf_model = make_hf_model(family)
    hf_config = hf_model.config.to_dict()
    cfg = config_from_hf(hf_config)
    original = {k: v for k, v in hf_model.state_dict().items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    back = llamatron_to_hf(hf_to_llamatron(original, cfg, hf_config), cfg, hf_config)
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_falcon_grouped_layout_puts_each_query_head_with_its_kv_head():
    """Falcon 40B's fused rows are [q.. x (heads/kv), k, v] per KV head: check the de-interleaving directly."""
    hf_model = make_hf_model("falcon-40b-layout")
    hf_config = hf_model.config.to_dict()
    cfg = config_from_hf(hf_config)
    fused = hf_model.state_dict()["transformer.h.0.self_attention.query_key_value.weight"]
    d, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    ours = hf_to_llamatron(hf_model.state_dict(), cfg, hf_config)["layers.0.attn.qkv.weight"]
    q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d
    for g in range(cfg.num_kv_heads):
        base = g * (group + 2) * d
        k_hf = fused[base + group * d : base + (group + 1) * d]
        v_hf = fused[base + (group + 1) * d : base + (group + 2) * d]
        assert torch.equal(ours[q_rows + g * d : q_rows + (g + 1) * d], k_hf)
        assert torch.equal(ours[q_rows + kv_rows + g * d : q_rows + kv_rows + (g + 1) * d], v_hf)
        for j in range(group):
            head = g * group + j
            assert torch.equal(ours[head * d : (head + 1) * d], fused[base + j * d : base + (j + 1) * d])
