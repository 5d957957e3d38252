"""DeepSeek-V3 as a family in one folder (issue 49): exact to transformers' DeepseekV3ForCausalLM on configs it never
saw (with and without the low-rank query, YaRN, dense first layers, groups), imported and exported bitwise under
the Hub's names, the published sizes, and what it cannot represent refused in one line."""

from __future__ import annotations

import random

import pytest
import torch
from hf_fixtures import make_random_model
from test_qwen import _run
from test_qwen_moe import assert_round_trip_is_bitwise

from llamatron.errors import HFConversionError
from llamatron.interop.hf import config_from_hf, hf_to_llamatron
from llamatron.models import build_model, get_preset
from llamatron.models.families import model_problems
from llamatron.models.inventory import active_params, num_params

pytest.importorskip("transformers")


def random_config(seed: int) -> dict:
    """A DeepSeek-V3 config.json no test wrote by hand, its sizes drawn from `seed`; seeds 0-3 take each option
    both ways (low-rank query, YaRN, dense first layers, groups)."""
    rng = random.Random(seed)
    groups = [4, 1, 2, 1][seed % 4]
    heads = rng.choice([2, 4])
    config = dict(
        vocab_size=rng.choice([97, 128]),
        hidden_size=rng.choice([32, 48]),
        intermediate_size=rng.choice([48, 64]),
        moe_intermediate_size=rng.choice([8, 16]),
        num_hidden_layers=rng.choice([2, 3]),
        num_attention_heads=heads,
        num_key_value_heads=heads,  # transformers' default (128) is DeepSeek-V3's head count
        n_shared_experts=rng.choice([1, 2]),
        n_routed_experts=8,
        num_experts_per_tok=rng.choice([1, 2, 3]),
        n_group=groups,
        topk_group=max(1, groups // 2),
        first_k_dense_replace=seed % 2,
        q_lora_rank=None if seed % 3 == 0 else 16,
        kv_lora_rank=rng.choice([8, 12]),
        qk_nope_head_dim=rng.choice([8, 16]),
        qk_rope_head_dim=rng.choice([4, 8]),
        v_head_dim=rng.choice([8, 12]),
        norm_topk_prob=rng.random() < 0.7,
        routed_scaling_factor=rng.choice([1.0, 2.5]),
        max_position_embeddings=64,
        rms_norm_eps=rng.choice([1e-6, 1e-5]),
        num_nextn_predict_layers=0,
        tie_word_embeddings=rng.random() < 0.3,
    )
    if seed % 4 in (0, 3):  # YaRN past its trained 16 positions, mscale_all_dim apart from mscale
        config["rope_parameters"] = dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=16,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=rng.choice([0.8, 1.0]),
        )
    return config


def random_model(seed: int, config: dict | None = None):
    model = make_random_model("DeepseekV3", config or random_config(seed), seed=seed)
    with torch.no_grad():  # the balancing bias is a buffer there: random too, so it routes
        for name, t in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed))
    return model


@pytest.mark.parametrize("seed", range(4))
def test_logits_of_unseen_random_configs_match_transformers(seed):
    hf_model = random_model(seed)
    hf_config = hf_model.config.to_dict()
    cfg = config_from_hf(hf_config)
    assert model_problems(cfg) == []
    model = build_model(cfg, device="cpu")
    model.load_state_dict(hf_to_llamatron(hf_model.state_dict(), cfg, hf_config), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected, got = hf_model(tokens).logits, model.eval()(tokens)
    assert expected.abs().max() > 0.1
    assert (got - expected).abs().max().item() <= 1e-4
    hf_count = sum(p.numel() for p in hf_model.parameters())
    bias = sum(b.numel() for n, b in hf_model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert num_params(cfg) == hf_count + bias  # llamatron's balancing bias is a (frozen) parameter


def test_the_configs_options_reach_the_model():
    """The draws above cover each option; here each is checked to be what the model was built with."""
    seen = {"q_lora": set(), "yarn": set(), "dense_first": set(), "groups": set()}
    for seed in range(4):
        cfg = config_from_hf(random_model(seed).config.to_dict())
        seen["q_lora"].add(cfg.q_lora_rank is not None)
        seen["yarn"].add(cfg.rope_scaling is not None)
        seen["dense_first"].add(cfg.first_k_dense_replace > 0)
        seen["groups"].add(cfg.n_group > 1)
        model = build_model(cfg)
        assert [hasattr(model.layers[str(i)].mlp, "router") for i in range(cfg.num_layers)] == [
            i >= cfg.first_k_dense_replace for i in range(cfg.num_layers)
        ]
    assert all(s == {True, False} for s in seen.values()), seen


def test_import_export_round_trip_is_bitwise(tmp_path):
    config = {**random_config(1), "q_lora_rank": 16, "first_k_dense_replace": 1, "num_hidden_layers": 2}
    exported = assert_round_trip_is_bitwise(random_model(1, config), tmp_path, per_expert_names=True)
    assert exported["model_type"] == "deepseek_v3" and exported["n_group"] == config["n_group"]
    assert _run("verify", tmp_path / "ck", "--hf", tmp_path / "out", "--batches", "2") == 0


def test_published_sizes():
    """The model cards' totals and active parameters (multi-token prediction left out)."""
    expect = {"deepseek-v3": (671, 37), "kimi-k2": (1026, 32), "moonlight-16b-a3b": (16, 3)}
    for name, (total, active) in expect.items():
        cfg = get_preset(name)
        assert round(num_params(cfg) / 1e9) == total, name
        assert abs(active_params(cfg) / 1e9 - active) < 1.0, name  # the cards round: 37.6, 32.9, 2.9


@pytest.mark.parametrize(
    "change, words",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"topk_method": "greedy"}, "noaux_tc"),
        ({"n_group": 3}, "does not divide"),
        ({"first_k_dense_replace": 2, "num_hidden_layers": 2}, "leaves no layer with experts"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 2.0}}, "attention_factor"),
    ],
)
def test_configs_llamatron_cannot_represent_are_refused_in_one_line(change, words):
    config = {**random_config(0), "model_type": "deepseek_v3", **change}
    with pytest.raises((HFConversionError, ValueError)) as err:
        cfg = config_from_hf(config)
        problems = model_problems(cfg)
        if problems:
            raise ValueError("; ".join(problems))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_generation_keeps_the_compressed_cache():
    """Decoding keeps per token and layer the latent and the rotary key alone (kv_lora_rank + qk_rope_head_dim
    numbers, not 2 x heads x head widths): each layer's cache is its attention's own kind. Decoding with it equals
    recomputing the whole sequence: tests/test_kv_cache.py's deepseek-v3-latent shape."""
    from llamatron.models import materialize
    from llamatron.models.families.deepseek_v3.mla_cache import MLACache
    from llamatron.models.kv_cache import KVCache

    cfg = get_preset("deepseek-v3-test")
    model = materialize(build_model(cfg), cfg, 1, "cpu", torch.float32).eval()
    cache = KVCache(16)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (2, 5)), cache=cache)
        model(torch.randint(0, cfg.vocab_size, (2, 1)), cache=cache)
    layers = [cache.layer(name) for name in model.layers]
    assert all(isinstance(c, MLACache) for c in layers)
    per_token = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert all(c.buffer.shape == (2, 1, 16, per_token) for c in layers)
    assert per_token < 2 * cfg.num_heads * cfg.v_head_dim  # the full keys and values it replaces


def test_a_model_trained_without_the_balancing_bias_exports_with_a_zero_one(tmp_path):
    """DeepSeek-V3's format has e_score_correction_bias in every MoE layer: a checkpoint trained without the bias
    (router_expert_bias false, as --fsdp and LoRA need) exports zeros, and transformers' model of the export gives
    our logits (verify)."""
    from layout import run_train
    from safetensors.torch import load_file

    (tmp_path / "no-bias.yaml").write_text("model_overrides:\n  router_expert_bias: false\n")
    flags = ["--config", str(tmp_path / "no-bias.yaml"), "--train-steps", "2", "--save", "ck"]
    run_train(flags, 1, tmp_path, model="deepseek-v3-test")
    assert _run("export-hf", tmp_path / "ck" / "step-2", tmp_path / "hf") == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    biases = {n: t for n, t in exported.items() if n.endswith("e_score_correction_bias")}
    assert sorted(biases) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)]
    assert all(t.dtype == torch.float32 and not t.any() for t in biases.values())
    assert _run("verify", tmp_path / "ck" / "step-2", "--hf", tmp_path / "hf", "--batches", "2") == 0
