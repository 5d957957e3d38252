"""Qwen3-MoE (issue 34, first step): exact to transformers' Qwen3MoeForCausalLM on configs it never saw, imported
and exported bitwise under the Hub's per-expert names, the published sizes, what it cannot represent refused in one
line, and expert and tensor parallelism equal to the single process."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hf_fixtures import make_random_model
from layout import assert_matches, assert_same_weights, run_train, single_runs
from safetensors.torch import load_file
from test_qwen import _run, assert_imports_exactly

from llamatron.errors import HFConversionError
from llamatron.interop.hf import config_from_hf
from llamatron.models import get_preset
from llamatron.models.inventory import active_params, num_params

pytest.importorskip("transformers")


def random_config(seed: int, kind: str = "Qwen3Moe") -> dict:
    """A Qwen3-MoE (or Qwen2-MoE) config.json no test wrote by hand: experts, top-k, widths, heads, head_dim, tying
    drawn from `seed`."""
    rng = random.Random(seed)
    kv = rng.choice([1, 2])
    experts = rng.choice([4, 6, 8])
    if kind == "Qwen2Moe":  # Qwen2's attention (head_dim from hidden / heads), a gated shared expert
        heads = kv * rng.choice([1, 2, 4])
        return dict(
            vocab_size=rng.choice([97, 128]),
            hidden_size=heads * rng.choice([8, 16]),
            intermediate_size=64,
            moe_intermediate_size=rng.choice([16, 24]),
            shared_expert_intermediate_size=rng.choice([32, 48]),
            num_experts=experts,
            num_experts_per_tok=rng.choice([1, 2, 3]),
            norm_topk_prob=seed == 1,
            num_hidden_layers=rng.choice([1, 2]),
            num_attention_heads=heads,
            num_key_value_heads=kv,
            max_position_embeddings=128,
            rope_theta=rng.choice([1e4, 1e6]),
            tie_word_embeddings=rng.random() < 0.5,
        )
    return dict(
        vocab_size=rng.choice([97, 128]),
        hidden_size=rng.choice([48, 64]),
        intermediate_size=rng.choice([64, 96]),  # the dense width: unused when every layer is sparse
        moe_intermediate_size=rng.choice([16, 24, 32]),
        num_experts=experts,
        num_experts_per_tok=rng.choice([1, 2, 3]),
        norm_topk_prob=seed != 1,  # renormalised top-k weights, or (seed 1) the softmax's own
        num_hidden_layers=rng.choice([1, 2]),
        num_attention_heads=kv * rng.choice([1, 2, 4]),
        num_key_value_heads=kv,
        head_dim=rng.choice([8, 16]) * 2,
        max_position_embeddings=128,
        rms_norm_eps=rng.choice([1e-6, 1e-5]),
        rope_theta=rng.choice([1e4, 1e6]),
        tie_word_embeddings=rng.random() < 0.5,
    )


def test_dense_layers_among_the_sparse_ones_match_transformers():
    """decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense SwiGLUs `intermediate_size` wide."""
    config = {**random_config(4), "num_hidden_layers": 4, "decoder_sparse_step": 2}
    cfg = assert_imports_exactly(make_random_model("Qwen3Moe", config, seed=4), 4)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert cfg.layer_ffn(0) == config["intermediate_size"] != cfg.layer_ffn(1)


def test_dense_layers_at_chosen_indices_match_transformers(tmp_path):
    """mlp_only_layers [0] (issue 49: DeepSeek-V3's dense first layers by the same per-layer hook): layer 0 a dense
    SwiGLU `intermediate_size` wide, the others sparse; imported, exported and imported again alike."""
    config = {**random_config(5), "num_hidden_layers": 3, "mlp_only_layers": [0]}
    hf_model = make_random_model("Qwen3Moe", config, seed=5)
    cfg = assert_imports_exactly(hf_model, 5)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True] and cfg.num_moe_layers == 2
    exported = assert_round_trip_is_bitwise(hf_model, tmp_path, per_expert_names=True)
    assert exported["mlp_only_layers"] == [0]


@pytest.mark.parametrize("kind, seed", [(k, s) for k in ("Qwen3Moe", "Qwen2Moe") for s in range(3)])
def test_logits_of_unseen_random_configs_match_transformers(kind, seed):
    hf_model = make_random_model(kind, random_config(seed, kind), seed=seed)
    cfg = assert_imports_exactly(hf_model, seed)
    c = hf_model.config
    assert (cfg.num_experts, cfg.experts_per_token, cfg.ffn_hidden_size) == (
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
    )
    assert bool(cfg.shared_expert_ffn) == (kind == "Qwen2Moe")


def assert_round_trip_is_bitwise(hf_model, tmp_path, per_expert_names: bool = False) -> dict:
    """Save `hf_model`, import-hf (verify), export-hf: the same tensors bitwise (a tied head once); returns the
    exported config.json."""
    hf_model.save_pretrained(tmp_path / "hf")
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    if per_expert_names:
        assert any(".mlp.experts.0.gate_proj.weight" in n for n in saved)  # the Hub's per-expert layout
    assert _run("import-hf", tmp_path / "hf", tmp_path / "ck") == 0
    assert _run("verify", tmp_path / "ck", "--hf", tmp_path / "hf", "--batches", "2") == 0
    assert _run("export-hf", tmp_path / "ck", tmp_path / "out") == 0
    exported = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        exported.update(load_file(str(f)))
    saved.pop("lm_head.weight", None) if hf_model.config.tie_word_embeddings else None
    assert set(exported) == set(saved) and all(torch.equal(exported[n], t) for n, t in saved.items())
    return json.loads((tmp_path / "out" / "config.json").read_text())


@pytest.mark.parametrize("kind", ["Qwen3Moe", "Qwen2Moe"])
def test_import_export_round_trip_is_bitwise_under_the_hubs_expert_names(kind, tmp_path):
    hf_model = make_random_model(kind, random_config(7, kind), seed=7)
    config = assert_round_trip_is_bitwise(hf_model, tmp_path, per_expert_names=True)
    assert config["model_type"] == kind.lower().replace("moe", "_moe")
    assert config["norm_topk_prob"] == hf_model.config.norm_topk_prob
    assert _run("verify", tmp_path / "ck", "--hf", tmp_path / "out", "--batches", "2") == 0


@pytest.mark.parametrize(
    "change, words",
    [
        ({"mlp_only_layers": "0"}, "a list of layer indices"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ({"num_experts_per_tok": 9}, "1 <= num_experts_per_tok <= num_experts"),
    ],
)
def test_configs_llamatron_cannot_represent_are_refused_in_one_line(change, words):
    base = make_random_model("Qwen3Moe", random_config(0)).config.to_dict()
    with pytest.raises(HFConversionError, match=words):
        config_from_hf({**base, **change})


def test_presets_have_the_published_sizes():
    """Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active; Qwen3-235B-A22B: 235 B, 22 B (the model cards)."""
    for name, total, active in (("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-235b-a22b", 235.1, 22.2)):
        cfg = get_preset(name)
        assert (cfg.num_experts, cfg.experts_per_token, cfg.head_dim, cfg.qk_norm) == (128, 8, 128, True)
        assert num_params(cfg) / 1e9 == pytest.approx(total, abs=0.05)
        assert active_params(cfg) / 1e9 == pytest.approx(active, abs=0.06)


# name -> (flags, processes, model)
LAYOUTS = {
    "ep2": (["--ep", "2"], 2, "qwen3-moe-test"),
    "tp2-sp": (["--tp", "2", "--sequence-parallel"], 2, "qwen3-moe-test"),
    "shared-ep2": (["--ep", "2"], 2, "qwen2-moe-test"),
    "shared-pp2-dp2": (["--pp", "2", "--micro-batch-size", "1"], 4, "qwen2-moe-test"),
    "shared-tp2-sp": (["--tp", "2", "--sequence-parallel"], 2, "qwen2-moe-test"),
    # the gated shared expert split over tp beside the routed experts, those also over ep; without sp, where the
    # gate's gradient is partial only by its own spec (under sp every replicated weight's is)
    "shared-ep2-tp2": (["--ep", "2", "--tp", "2"], 4, "qwen2-moe-test"),
    "ep4": (["--ep", "4"], 4, "qwen3-moe-test"),  # 2 of the 8 fine-grained experts per rank, top 2 renormalised
    "ep2-distopt-recompute": (["--ep", "2", "--distributed-optimizer", "--recompute", "full"], 2, "qwen3-moe-test"),
}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """model -> the single process's per-step metrics and its final weights."""
    return single_runs(tmp_path_factory, lambda _model, _path: [], lambda model: model)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_match_the_single_process(name, single, tmp_path):
    """Every logged field of each step (the router statistics too) and the evaluation, and the final weights."""
    flags, nproc, model = LAYOUTS[name]
    records, weights = single(model)
    assert_matches(records, run_train([*flags, "--save", "ck"], nproc, tmp_path, model=model))
    assert_same_weights(weights, tmp_path / "ck" / "step-5")
