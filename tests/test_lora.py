"""LoRA adapters (llamatron/adapters/) against PEFT's on the transformers model: the same adapter weights give
the same logits, and they map to PEFT's names and back bitwise — fused q/k/v and gate/up (Falcon's interleaved
rows too), partial targets inside a fused linear, and the frozen base."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import FAMILIES, make_hf_model, random_tokens
from test_hf_equivalence import llamatron_from_hf

from llamatron.adapters.lora import LoraLinear
from llamatron.adapters.peft_format import adapter_config, load_peft_state, peft_state
from llamatron.adapters.targets import apply_lora, find_targets
from llamatron.errors import ConfigError

peft = pytest.importorskip("peft")  # in the test extra: skipped only outside it

RANK, ALPHA = 4, 8.0
# family -> (our targets, PEFT's target_modules)
CASES = {
    "llama2-gqa": ("all-linear", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen3": ("q,v,down", ["q_proj", "v_proj", "down_proj"]),
    "falcon-40b-layout": ("all-linear", ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
}


def _adapted_pair(family: str):
    """transformers + PEFT with random adapters (B not zero), and llamatron with the same base and adapters."""
    ours_targets, peft_targets = CASES[family]
    hf_model = make_hf_model(family)
    model, cfg = llamatron_from_hf(hf_model)
    torch.manual_seed(1)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=peft_targets, init_lora_weights=False)
    peft_model = peft.get_peft_model(hf_model, config).eval()
    reference = peft.get_peft_model_state_dict(peft_model)
    targets = find_targets(model, cfg, ours_targets.split(","))
    apply_lora(model, targets, RANK, ALPHA, 0.0)
    load_peft_state(model, targets, reference)
    return peft_model, model, cfg, targets, reference


@pytest.mark.parametrize("family", sorted(CASES))
def test_adapters_give_peft_logits_and_map_back_bitwise(family):
    peft_model, model, cfg, targets, reference = _adapted_pair(family)
    tokens = random_tokens(2, FAMILIES[family][2])
    with torch.no_grad():
        expected = peft_model(tokens).logits
        base = peft_model.get_base_model()
        with peft_model.disable_adapter():
            without = base(tokens).logits
        got = model(tokens)
    assert (expected - without).abs().max() > 1e-2  # the adapters change the logits: the check is not vacuous
    assert (got - expected).abs().max().item() <= 1e-5
    back = peft_state(model, targets)
    assert back.keys() == reference.keys()
    assert all(torch.equal(back[k], reference[k]) for k in reference)
    config = adapter_config(targets, RANK, ALPHA, 0.0, "base")
    assert sorted(config["target_modules"]) == sorted(CASES[family][1])
    assert peft.LoraConfig(**{k: v for k, v in config.items() if k != "peft_type"}).r == RANK


def test_only_the_adapters_train_and_a_new_adapter_changes_nothing():
    hf_model = make_hf_model("llama2-gqa")
    model, cfg = llamatron_from_hf(hf_model)
    tokens = random_tokens(2, 16)
    with torch.no_grad():
        before = model(tokens)
    apply_lora(model, find_targets(model, cfg, ["all-linear"]), RANK, ALPHA, 0.0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_a", ".lora_b")) for n in trainable)
    assert len(trainable) == 2 * 4 * cfg.num_layers  # qkv, o, gate_up, down per layer
    with torch.no_grad():
        assert torch.equal(model(tokens), before)  # B starts at zero, as PEFT's
    model(tokens).float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) <= trainable and any(g.abs().max() > 0 for g in grads.values())


def test_merged_weight_is_the_base_plus_the_update():
    peft_model, model, cfg, targets, _ = _adapted_pair("llama2-gqa")
    merged = peft_model.merge_and_unload().state_dict()
    module = model.get_submodule("layers.1.attn.qkv")
    assert isinstance(module, LoraLinear)
    ours = module.weight + module.delta_weight()
    q, k, v = (merged[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.allclose(ours, torch.cat([q, k, v]), atol=1e-6)


def test_a_target_that_names_no_linear_is_one_line():
    model, cfg = llamatron_from_hf(make_hf_model("llama2-gqa"))
    with pytest.raises(ConfigError, match=r"--lora-targets qkv names no linear .* use all-linear or some of .*q_proj"):
        find_targets(model, cfg, ["qkv"])
