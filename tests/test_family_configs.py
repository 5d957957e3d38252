"""A family's own options live in its config class (issue 49): a subclass of the common ModelConfig in its folder,
which its presets, its Hugging Face import and its checkpoints' meta.json come back as; what only one family's
modules read is not a field of ModelConfig."""

from __future__ import annotations

import dataclasses

import pytest

from llamatron.cli import main
from llamatron.models import ModelConfig, build_model, config_from_dict
from llamatron.models.families import FAMILIES, families_with_field, get_preset, model_problems

# Options that moved from the common config into their family's (the one family whose modules read them)
FAMILY_ONLY = {
    "falcon": {"separate_mlp_norm"},
    "llama4": {
        "nope_layer_interval",
        "attention_chunk_size",
        "qk_l2_norm",
        "attn_temperature_floor",
        "router_weights_input",
    },
    "qwen": {"mlp_only_layers"},
    "deepseek_v3": {"kv_lora_rank", "q_lora_rank", "n_group", "first_k_dense_replace", "num_nextn_predict_layers"},
}


def _code(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_presets_are_their_familys_config_and_round_trip_through_a_dict(family):
    cls = FAMILIES[family].config_class
    for name, make in FAMILIES[family].presets.items():
        cfg = make()
        assert type(cfg) is cls, name
        back = config_from_dict(cfg.to_dict())
        assert type(back) is cls and back == cfg, name
        assert type(cfg.with_changes({"num_layers": 1})) is cls


@pytest.mark.parametrize(("family", "names"), sorted(FAMILY_ONLY.items()))
def test_a_familys_own_options_are_not_common_fields(family, names):
    common = {f.name for f in dataclasses.fields(ModelConfig)}
    assert not names & common
    assert names <= set(FAMILIES[family].config_class.own_fields())
    assert all(families_with_field(n) == [family] for n in names)


def test_a_config_of_the_wrong_class_is_refused_in_one_line():
    problems = model_problems(ModelConfig(family="falcon", num_layers=2))
    assert problems == ["a falcon model's config is a FalconConfig, not ModelConfig"]
    with pytest.raises(ValueError, match="not one of"):
        config_from_dict({"family": "gpt2"})
    with pytest.raises(ValueError, match="mapping of its fields"):
        config_from_dict(["llama"])  # type: ignore[arg-type]


def test_a_familys_option_changes_its_layers_and_is_refused_on_another_family(capsys):
    cfg = get_preset("llama4-test").with_changes({"attention_chunk_size": 8})
    model = build_model(cfg)
    rotary = [str(i) for i in range(cfg.num_layers) if cfg.layer_has_rope(i)]
    assert rotary and all(model.attention_chunks[i] == 8 for i in rotary)
    assert all(model.attention_chunks[str(i)] is None for i in range(cfg.num_layers) if str(i) not in rotary)
    argv = ["train", "--model", "llama-test", "--model-override", "attention_chunk_size=8", "--train-steps", "1"]
    assert _code(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "attention_chunk_size is an option of the llama4 family's config" in err[0], err


def test_a_checkpoint_config_written_before_the_split_still_loads():
    """meta.json of a checkpoint saved when every option was a ModelConfig field: another family's options at their
    defaults load; set to anything else they are refused (that model cannot be built)."""
    old = {**get_preset("llama-test").to_dict(), "separate_mlp_norm": False, "nope_layer_interval": 0}
    old.update(attention_chunk_size=None, qk_l2_norm=False, attn_temperature_floor=0, attn_temperature_scale=0.1)
    assert config_from_dict(old) == get_preset("llama-test")
    with pytest.raises(ValueError, match="qk_l2_norm"):
        config_from_dict({**old, "qk_l2_norm": True})


def test_qwen_s_options_are_its_config_s_and_old_checkpoint_configs_still_load():
    """qkv_bias, qk_norm and shared_expert_gate are QwenConfig's fields, not the common config's. A meta.json written
    while they were ModelConfig's loads: a llama model's (them at their defaults) as before, set on it they are
    refused; a qwen model's keeps them."""
    assert {"qkv_bias", "qk_norm", "shared_expert_gate"} & {f.name for f in dataclasses.fields(ModelConfig)} == set()
    old = {**get_preset("llama-test").to_dict(), "qkv_bias": False, "qk_norm": False, "shared_expert_gate": False}
    assert config_from_dict(old) == get_preset("llama-test")
    with pytest.raises(ValueError, match="qk_norm"):
        config_from_dict({**old, "qk_norm": True})
    qwen = get_preset("qwen2-moe-test")
    assert qwen.qkv_bias and qwen.shared_expert_gate and config_from_dict(qwen.to_dict()) == qwen


def test_router_weights_input_is_llama4s_and_old_checkpoint_configs_still_load():
    """router_weights_input is Llama4Config's field (its MoE, families/llama4/moe.py, reads it). A meta.json written
    while it was ModelConfig's loads: a Mixtral model's (it at its default) as before, set on it it is refused; a
    llama4 model's keeps it."""
    old = {**get_preset("mixtral-test").to_dict(), "router_weights_input": False}
    assert config_from_dict(old) == get_preset("mixtral-test")
    with pytest.raises(ValueError, match="router_weights_input"):
        config_from_dict({**old, "router_weights_input": True})
    llama4 = get_preset("llama4-test")
    assert llama4.router_weights_input and config_from_dict(llama4.to_dict()) == llama4


@pytest.mark.parametrize("preset", ["deepseek-v3-test", "mixtral-test", "qwen3-moe-test"])
def test_a_mixture_of_experts_made_dense_drops_its_moe_settings(preset):
    """model_overrides {num_experts: 0} on a MoE preset: a dense model of the same shape (its MoE settings back at
    their defaults, which a dense model must keep), not a refusal naming settings the user never gave."""
    cfg = get_preset(preset).with_changes({"num_experts": 0})
    assert not cfg.is_moe and model_problems(cfg) == []
