"""Llama 4 (issue 34): exact to transformers' Llama4ForCausalLM on text configs it never saw (chunked local
attention, NoPE layers with temperature tuning, the L2 q/k norm, sigmoid routing of the experts' inputs, a shared
expert, dense layers among the MoE ones), each of those checked to matter (switched off, the logits leave
transformers'), imported and exported bitwise, the published sizes, what the format cannot hold refused in one line,
and expert, tensor and pipeline parallelism equal to the single process, resumed across expert layouts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from layout import assert_matches, assert_same_weights, run_train
from test_qwen import _run
from test_qwen_moe import assert_round_trip_is_bitwise

from llamatron.errors import HFConversionError
from llamatron.interop.hf import config_from_hf, hf_to_llamatron
from llamatron.models import build_model, get_preset
from llamatron.models.families import model_problems
from llamatron.models.inventory import active_params, num_params

transformers = pytest.importorskip("transformers")


def random_config(seed: int) -> dict:
    """A Llama 4 text config.json no test wrote by hand, drawn from `seed`: sizes, experts, top-k, the MoE and
    NoPE intervals, the chunk, the q/k norm and the temperature floor."""
    rng = random.Random(seed)
    kv = rng.choice([1, 2])
    experts = rng.choice([4, 8])
    return dict(
        vocab_size=rng.choice([97, 128]),
        hidden_size=rng.choice([32, 48]),
        intermediate_size=rng.choice([16, 24]),
        intermediate_size_mlp=rng.choice([32, 40]),
        num_hidden_layers=4,
        num_attention_heads=kv * rng.choice([2, 4]),
        num_key_value_heads=kv,
        head_dim=rng.choice([8, 16]),
        num_local_experts=experts,
        num_experts_per_tok=rng.choice([1, 2]),
        interleave_moe_layer_step=rng.choice([1, 2]),
        no_rope_layer_interval=rng.choice([2, 4]),
        attention_chunk_size=rng.choice([8, 16]),
        use_qk_norm=seed != 1,
        attn_temperature_tuning=True,
        floor_scale=rng.choice([4, 8]),
        attn_scale=rng.choice([0.1, 0.5]),
        max_position_embeddings=128,
        rms_norm_eps=rng.choice([1e-6, 1e-5]),
        rope_theta=rng.choice([1e4, 5e5]),
        tie_word_embeddings=rng.random() < 0.5,
    )


def hf_llama4(config: dict, seed: int):
    config = transformers.Llama4TextConfig(**config)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Llama4ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p)) if p.dim() == 1 else p.normal_(0.0, 0.1)
    return model.eval()


def imported(hf_model):
    hf_config = hf_model.config.to_dict()
    cfg = config_from_hf(hf_config)
    model = build_model(cfg, device="cpu")
    model.load_state_dict(hf_to_llamatron(hf_model.state_dict(), cfg, hf_config), strict=True)
    return cfg, model.eval()


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


# Each of Llama 4's features switched off on the imported model: the logits must then leave transformers'.
SWITCHES = {
    "chunked attention": lambda m: m.attention_chunks.update({k: None for k in m.attention_chunks}),
    "NoPE layers": lambda m: [setattr(b.attn, "rope", True) for b in m.layers.values()],
    "temperature tuning": lambda m: [setattr(b.attn, "temperature", None) for b in m.layers.values()],
    "routed inputs": lambda m: [setattr(b.mlp, "weights_input", False) for b in m.layers.values() if _moe(b)],
    "sigmoid scores": lambda m: [setattr(b.mlp, "sigmoid_scores", False) for b in m.layers.values() if _moe(b)],
    "shared expert": lambda m: [setattr(b.mlp, "shared", None) for b in m.layers.values() if _moe(b)],
}


def _moe(block) -> bool:
    return hasattr(block.mlp, "router")


@pytest.mark.parametrize("seed", range(3))
def test_logits_of_unseen_random_configs_match_transformers(seed):
    hf_model = hf_llama4(random_config(seed), seed)
    cfg, model = imported(hf_model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))
    expected = _logits(hf_model, tokens).logits
    assert expected.abs().max() > 0.1
    assert (_logits(model, tokens) - expected).abs().max().item() <= 1e-4
    assert num_params(cfg) == sum(p.numel() for p in hf_model.parameters())
    c = hf_model.config
    assert cfg.num_moe_layers == len(c.moe_layers) and cfg.qk_l2_norm == c.use_qk_norm
    assert [cfg.layer_has_rope(i) for i in range(cfg.num_layers)] == [bool(x) for x in c.no_rope_layers]
    for name, switch_off in SWITCHES.items():
        _, changed = imported(hf_model)
        switch_off(changed)
        gap = (_logits(changed, tokens) - expected).abs().max().item()
        assert gap > 1e-3, f"{name} switched off leaves the logits within {gap} of transformers'"


def test_l2_qk_norm_matters():
    hf_model = hf_llama4({**random_config(0), "use_qk_norm": True}, 0)
    tokens = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    _, model = imported(hf_model)
    for block in model.layers.values():
        block.attn.l2_eps = None
    assert (_logits(model, tokens) - _logits(hf_model, tokens).logits).abs().max() > 1e-3


def test_import_export_round_trip_is_bitwise(tmp_path):
    hf_model = hf_llama4(random_config(5), 5)
    config = assert_round_trip_is_bitwise(hf_model, tmp_path)
    c = hf_model.config
    assert config["model_type"] == "llama4_text"
    for key in ("interleave_moe_layer_step", "moe_layers", "no_rope_layers", "attention_chunk_size", "floor_scale"):
        assert config[key] == getattr(c, key), key
    assert _run("verify", tmp_path / "ck", "--hf", tmp_path / "out", "--batches", "2") == 0


def test_presets_have_the_published_sizes():
    """Meta's model cards: Scout 17B active of 109B (with its ~1B vision encoder, not built here), Maverick 17B of
    400B."""
    for name, total, active in (("llama4-scout-17b-16e", 109, 17), ("llama4-maverick-17b-128e", 400, 17)):
        cfg = get_preset(name)
        assert model_problems(cfg) == []
        assert num_params(cfg) / 1e9 == pytest.approx(total, rel=0.02)
        assert active_params(cfg) / 1e9 == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"moe_layers": [0, 3]}, "moe_layers"),
        ({"no_rope_layers": [1, 0, 0, 1]}, "no_rope_layers"),
        ({"floor_scale": 2.5}, "floor_scale"),
    ],
)
def test_configs_llamatron_cannot_represent_are_refused_in_one_line(change, words):
    with pytest.raises(HFConversionError, match=words):
        config_from_hf({**random_config(0), "model_type": "llama4_text", **change})


def test_settings_the_format_cannot_hold_are_refused():
    cfg = get_preset("llama4-test")
    for change, words in (
        ({"router_score": "softmax"}, "Llama 4's routing"),
        ({"shared_expert_ffn": 32}, "as wide as its routed ones"),
        ({"sliding_window": 8}, "attention_chunk_size and sliding_window"),
        ({"router_score": "tanh"}, "router_score 'tanh' must be one of softmax, sigmoid"),
        ({"moe_layer_step": 9}, "no layer has experts"),
    ):
        assert any(words in p for p in model_problems(cfg.with_changes(change))), change
    qwen = get_preset("qwen3-moe-test")
    assert any("no such option" in p for p in model_problems(qwen.with_changes({"router_score": "sigmoid"})))


# name -> (flags, processes)
LAYOUTS = {
    "ep2": (["--ep", "2"], 2),
    "tp2-sp": (["--tp", "2", "--sequence-parallel"], 2),
    "pp2": (["--pp", "2", "--pp-layers", "1,3", "--micro-batch-size", "1"], 2),
    # stages of 1 and 1 MoE layers with dense ones between, experts split over 2 ranks of each stage
    "ep2-pp2": (["--ep", "2", "--pp", "2", "--micro-batch-size", "1"], 4),
    "ep2-distopt-recompute": (["--ep", "2", "--distributed-optimizer", "--recompute", "full"], 2),
    # the shared expert split over tp beside the routed experts' ffn, the routed ones also over ep
    "ep2-tp2-sp": (["--ep", "2", "--tp", "2", "--sequence-parallel"], 4),
    # the interleaved schedule, chunks of one layer: stage 0 holds layers 0 and 2 (no MoE), stage 1 layers 1 and 3
    "ep2-pp2-vpp2": (["--ep", "2", "--pp", "2", "--vpp", "2", "--micro-batch-size", "1"], 4),
}


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> tuple[list[dict], Path]:
    """The single process's per-step metrics and its final weights."""
    path = tmp_path_factory.mktemp("single")
    return run_train(["--save", "ck"], 1, path, model="llama4-test"), path / "ck" / "step-5"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_match_the_single_process(name, single_run, tmp_path):
    """Every logged field of each step (the router statistics too) and the evaluation, and the final weights."""
    flags, nproc = LAYOUTS[name]
    records, weights = single_run
    assert_matches(records, run_train([*flags, "--save", "ck"], nproc, tmp_path, model="llama4-test"))
    assert_same_weights(weights, tmp_path / "ck" / "step-5")


def test_resume_across_expert_layouts(single_run, tmp_path):
    """Saved at ep 2 with the distributed optimizer after step 2 (of 2: the cosine schedule's first two steps are
    those of the 5-step run), resumed in one process and at ep 4 (one expert per rank) with the optimizer state
    resharded: the resumed steps and final weights are the uninterrupted single process's. (The ep 4 layout's test
    too.)"""
    save = ["--ep", "2", "--distributed-optimizer", "--train-steps", "2", "--save", "ep2"]
    run_train(save, 2, tmp_path, model="llama4-test")
    records, weights = single_run
    for flags, nproc in (([], 1), (["--ep", "4", "--distributed-optimizer"], 4)):
        resumed = run_train(
            ["--load", "ep2", "--save", f"resumed{nproc}", *flags], nproc, tmp_path, model="llama4-test"
        )
        assert_matches(records[2:], resumed)
        assert_same_weights(weights, tmp_path / f"resumed{nproc}" / "step-5")


def test_a_checkpoint_with_the_vision_tower_imports_its_text_model(tmp_path, capsys):
    text = {**random_config(2), "num_hidden_layers": 2}
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=8)
    vision.update(patch_size=4, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    full = transformers.Llama4ForConditionalGeneration(config)
    full.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    assert _run("import-hf", tmp_path / "hf", tmp_path / "ck") == 0
    notice = [line for line in capsys.readouterr().err.splitlines() if "vision" in line]
    assert len(notice) == 1 and "vision tower; importing its text model only" in notice[0]
    assert _run("export-hf", tmp_path / "ck", tmp_path / "out") == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "llama4_text" and "vision_config" not in config
    text_model = transformers.Llama4ForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, text["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = full.language_model(tokens).logits  # its text model
        got = text_model(tokens).logits
    assert (got - expected).abs().max() <= 1e-4
