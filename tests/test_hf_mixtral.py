"""Mixtral (MixtralForCausalLM) through import-hf, export-hf and verify: transformers' logits, bitwise weights both
ways, the Hub's per-expert names and transformers 5's stacked ones, fine-tuning from an import, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_fixtures import (
    MIXTRAL,
    VOCAB,
    make_mixtral,
    make_random_model,
    mixtral_hub_state,
    random_tokens,
    rewrite_imported_weights,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_hf_interop import read_hf_weights, run_cli, write_tokenizer

from llamatron.inference.generate import load_for_generation
from llamatron.interop.hf import HFConversionError, config_from_hf, config_to_hf, hf_to_llamatron
from llamatron.models import get_preset


def save_mixtral(directory: Path, variant: str = "mixtral", **kwargs):
    model = make_mixtral(variant)
    model.save_pretrained(directory, **kwargs)
    write_tokenizer(directory)
    return model


def routing_margin(hf_model, tokens: torch.Tensor) -> float:
    """The smallest gap, over every token and layer, between the probability of the last expert chosen and the
    first one left out (far above float noise: no near-tie can route llamatron and transformers differently);
    and that every layer uses every expert (a swapped or misplaced expert shows)."""
    with torch.no_grad():
        router_logits = hf_model(tokens, output_router_logits=True).router_logits
    k, experts = hf_model.config.num_experts_per_tok, hf_model.config.num_local_experts
    for r in router_logits:
        assert set(r.topk(k, -1).indices.flatten().tolist()) == set(range(experts))
    probs = [torch.softmax(r.float(), -1).sort(-1, descending=True).values for r in router_logits]
    return min((p[:, k - 1] - p[:, k]).min().item() for p in probs)


@pytest.mark.parametrize("variant", sorted(MIXTRAL))
def test_imported_logits_match_transformers(variant, tmp_path):
    hf_model = save_mixtral(tmp_path / "hf", variant)
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt") == 0
    model, meta = load_for_generation(str(tmp_path / "ckpt"))
    cfg, hf = model.cfg, hf_model.config
    assert (cfg.num_experts, cfg.experts_per_token) == (hf.num_local_experts, hf.num_experts_per_tok)
    assert cfg.router_aux_loss_coef == hf.router_aux_loss_coef and cfg.sliding_window == hf.sliding_window
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    tokens = random_tokens(2, MIXTRAL[variant][1])
    assert routing_margin(hf_model, tokens) > 1e-4
    with torch.no_grad():
        expected, got = hf_model(tokens).logits, model(tokens)
    assert expected.abs().max() > 0.1  # the comparison is not vacuous
    assert (got - expected).abs().max().item() <= 1e-4
    if cfg.sliding_window is not None:
        assert tokens.shape[1] > cfg.sliding_window


def test_round_trip_is_bitwise_and_transformers_reloads_it(tmp_path):
    import transformers

    hf_model = save_mixtral(tmp_path / "hf")
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt") == 0
    assert run_cli("export-hf", tmp_path / "ckpt", tmp_path / "out", "--max-shard-size", "100KB") == 0
    assert (tmp_path / "out/model.safetensors.index.json").exists()  # sharded: experts split across files
    original, exported = read_hf_weights(tmp_path / "hf"), read_hf_weights(tmp_path / "out")
    assert set(exported) == set(original)
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in exported  # the Hub's names
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    source = json.loads((tmp_path / "hf/config.json").read_text())
    for key in ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "sliding_window"):
        assert config[key] == source[key], key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert type(reloaded).__name__ == "MixtralForCausalLM"
    tokens = random_tokens(2, 40)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(tokens).logits, hf_model(tokens).logits)


def test_hub_and_stacked_expert_names_import_to_the_same_weights(tmp_path):
    """The Hub's layout (per-expert w1/w2/w3, 4.x config keys, sharded), written here by hand, and transformers
    5's in-memory one (stacked gate_up_proj/down_proj) give the checkpoint that save_pretrained's files give."""
    hf_model = save_mixtral(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf/model.safetensors"), framework="pt") as f:  # what save_pretrained writes
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in f.keys()
    source = json.loads((tmp_path / "hf/config.json").read_text())
    hub = tmp_path / "hub"
    write_tokenizer(hub)
    hub_config = {k: v for k, v in source.items() if k not in ("rope_parameters", "dtype")}
    hub_config.update(rope_theta=1e6, torch_dtype="float32", transformers_version="4.36.0.dev0")
    (hub / "config.json").write_text(json.dumps(hub_config))
    state = mixtral_hub_state(hf_model)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, part in shards.items():
        save_file({n: state[n] for n in part}, str(hub / fname))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (hub / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    stacked = tmp_path / "stacked"
    write_tokenizer(stacked)
    (stacked / "config.json").write_text(json.dumps(source))
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(stacked / "model.safetensors"))
    with safe_open(str(stacked / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    for d in ("hf", "hub", "stacked"):
        assert run_cli("import-hf", tmp_path / d, tmp_path / f"ck-{d}") == 0
    want = load_file(str(tmp_path / "ck-hf/step-0/model.safetensors"))
    for d in ("hub", "stacked"):
        got = load_file(str(tmp_path / f"ck-{d}/step-0/model.safetensors"))
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), d
    # The fused tensor is each expert's [w1; w3] rows, read straight off the per-expert files.
    expert = "model.layers.1.block_sparse_moe.experts.2"
    w1, w3 = state[f"{expert}.w1.weight"], state[f"{expert}.w3.weight"]
    assert torch.equal(want["layers.1.mlp.experts.gate_up"][2], torch.cat([w1, w3]))
    assert torch.equal(want["layers.1.mlp.router.weight"], state["model.layers.1.block_sparse_moe.gate.weight"])
    # The in-memory conversion reads the stacked names too.
    in_memory = hf_to_llamatron(hf_model.state_dict(), config_from_hf(source), source)
    assert all(torch.equal(in_memory[n], want[n]) for n in want)


def test_verify_passes_and_fails_when_an_expert_is_perturbed(tmp_path, capsys):
    save_mixtral(tmp_path / "hf")
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt") == 0
    verify = ["verify", tmp_path / "ckpt", "--hf", tmp_path / "hf", "--batches", "2", "--seq-length", "40"]
    assert run_cli(*verify) == 0
    assert "PASS" in capsys.readouterr().out
    weights_file = tmp_path / "ckpt/step-0/model.safetensors"
    state = load_file(str(weights_file))
    down = state["layers.1.mlp.experts.down"]  # one expert of the last layer, by a little
    down[2] += 0.02 * torch.randn(down[2].shape, generator=torch.Generator().manual_seed(0))
    rewrite_imported_weights(weights_file.parent, state)
    assert run_cli(*verify) == 1
    assert "FAIL" in capsys.readouterr().out


def test_fine_tuning_an_import_and_exporting_it(tmp_path):
    """import-hf -> train --load --finetune (the model from the checkpoint, 2 steps, CPU, mock data) -> export-hf
    -> transformers computes what llamatron's tuned checkpoint computes."""
    import transformers

    hf_model = save_mixtral(tmp_path / "hf")
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "imported") == 0
    train = ["train", "--load", tmp_path / "imported", "--finetune", "--mock-data", "--device", "cpu"]
    train += ["--precision", "fp32", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4"]
    train += ["--train-steps", "2", "--lr", "1e-3", "--no-progress", "--eval-iters", "1", "--save", tmp_path / "tuned"]
    assert run_cli(*train) == 0
    tuned, meta = load_for_generation(str(tmp_path / "tuned"))
    assert meta["step"] == 2 and tuned.cfg.num_experts == 4
    assert run_cli("export-hf", tmp_path / "tuned", tmp_path / "out") == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    tokens = random_tokens(2, 32)
    with torch.no_grad():
        theirs, ours, before = exported.eval()(tokens).logits, tuned(tokens), hf_model(tokens).logits
    assert (theirs - ours).abs().max() <= 1e-4
    assert (theirs - before).abs().max() > 1e-3  # training changed the model
    assert json.loads((tmp_path / "out/config.json").read_text())["router_aux_loss_coef"] == 0.02


def test_export_of_a_mixtral_trained_from_scratch(tmp_path, capsys):
    """No Hugging Face config to start from: export builds Mixtral's from the model config."""
    args = ["train", "--model", "mixtral-test", "--mock-data", "--device", "cpu", "--precision", "fp32"]
    args += ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-steps", "1"]
    assert run_cli(*args, "--no-progress", "--eval-iters", "1", "--save", tmp_path / "ckpt") == 0
    assert run_cli("export-hf", tmp_path / "ckpt", tmp_path / "out") == 0
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 4, 2)
    assert run_cli("verify", tmp_path / "ckpt", "--hf", tmp_path / "out", "--batches", "1") == 0
    assert "PASS" in capsys.readouterr().out


def test_export_names_the_training_settings_config_json_has_no_key_for(tmp_path, capsys):
    """A capacity factor and global-batch balancing shape training only: the export says they are not in it."""
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: mixtral-test\nmodel_overrides: {moe_capacity_factor: 1.5, router_aux_loss_scope: global_batch}\n"
    )
    args = ["train", "--config", config, "--mock-data", "--device", "cpu", "--precision", "fp32", "--seq-length", "32"]
    args += ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-steps", "1", "--eval-iters", "1"]
    assert run_cli(*args, "--no-progress", "--save", tmp_path / "ckpt") == 0
    capsys.readouterr()
    assert run_cli("export-hf", tmp_path / "ckpt", tmp_path / "out") == 0
    notice = [line for line in capsys.readouterr().out.splitlines() if "not in config.json" in line]
    assert notice == [
        "  not in config.json (training settings it has no key for): moe_capacity_factor 1.5 (probs), "
        "router_aux_loss_scope global_batch"
    ]


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"sliding_window": 16, "router_aux_loss_coef": 0.05, "router_z_loss_coef": 1e-3},
        {"tie_embeddings": True, "experts_per_token": 1, "rope_theta": 1e4, "num_kv_heads": 4},
    ],
)
def test_transformers_reads_every_exported_field_as_meant(changes):
    """config_to_hf -> transformers' MixtralConfig -> config_from_hf is the identity: transformers builds the model
    llamatron describes (z-loss, which transformers has no use for, rides along)."""
    import dataclasses

    import transformers

    cfg = dataclasses.replace(get_preset("mixtral-test"), **changes)
    hf = config_to_hf(cfg, base={"model_type": "mixtral", "router_z_loss_coef": 0.5})  # an imported config's
    assert hf["architectures"] == ["MixtralForCausalLM"]
    read = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
    assert type(read).__name__ == "MixtralConfig"
    assert config_from_hf(read.to_dict()) == cfg


def test_keys_a_config_json_leaves_out_take_transformers_defaults():
    """A bare config.json means what transformers' MixtralConfig makes of it (rope theta 1e6, 8 KV heads, 131072
    positions, eps 1e-5, 8 experts, top-2, aux coefficient 0.001), not Llama's defaults."""
    import transformers

    bare = {"model_type": "mixtral", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96}
    bare.update(num_hidden_layers=2, num_attention_heads=8)
    ours = config_from_hf(bare)
    theirs = transformers.MixtralConfig(**{k: v for k, v in bare.items() if k != "model_type"}).to_dict()
    assert ours == config_from_hf(theirs)
    assert (ours.rope_theta, ours.num_kv_heads, ours.max_seq_length, ours.norm_eps) == (1e6, 8, 131072, 1e-5)
    assert (ours.num_experts, ours.experts_per_token, ours.router_aux_loss_coef) == (8, 2, 1e-3)
    assert not config_from_hf({**bare, "attention_bias": True}).bias  # transformers' Mixtral has no biases


def _hub_config(**changes) -> dict:
    return {**MIXTRAL["mixtral"][0], "model_type": "mixtral", **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 under model_type mixtral"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False"),
        ({"shared_expert_intermediate_size": 128}, "shared_expert_intermediate_size=128"),
        ({"num_experts_per_tok": 5}, "num_local_experts=4, num_experts_per_tok=5"),
        ({"moe_intermediate_size": 32}, "moe_intermediate_size=32 besides intermediate_size=96"),
    ],
)
def test_configs_llamatron_cannot_represent_fail_in_one_line(changes, message):
    config_from_hf(_hub_config())  # the base config is fine
    with pytest.raises(HFConversionError, match=message) as err:
        config_from_hf(_hub_config(**changes))
    assert "\n" not in str(err.value)


def test_a_missing_expert_tensor_fails_in_one_line_naming_it(tmp_path, capsys):
    save_mixtral(tmp_path / "hf")
    weights = tmp_path / "hf/model.safetensors"
    state = load_file(str(weights))
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, str(weights))
    capsys.readouterr()
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt") == 2
    err = capsys.readouterr().err.strip()
    assert "missing model.layers.1.block_sparse_moe.experts.3.w2.weight" in err and "4 experts" in err
    assert "\n" not in err
    assert not (tmp_path / "ckpt/latest").exists()
    config = json.loads((tmp_path / "hf/config.json").read_text())
    (tmp_path / "hf/config.json").write_text(json.dumps({**config, "router_jitter_noise": 0.5}))
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt2") == 2  # config problems come first
    assert "router_jitter_noise=0.5" in capsys.readouterr().err


def test_router_losses_train_as_transformers_mixtral_loss_times_its_coefficients():
    """The gradient of a training step equals that of transformers' Mixtral loss (language model + coefficient x
    its load-balancing loss) plus the z-loss written out (coefficient x mean logsumexp(router logits)^2; transformers
    has none). One sequence and one MoE layer, where transformers' batch-wide balancing loss and llamatron's
    per-sequence one are the same number (issue 39: dropping either coefficient changed no test)."""
    from llamatron.interop.hf import hf_to_llamatron
    from llamatron.models import build_model
    from llamatron.models.moe import MoE

    aux_coef, z_coef = 0.5, 0.1
    hf_model = make_random_model(
        "Mixtral", dict(MIXTRAL["mixtral"][0], num_hidden_layers=1, router_aux_loss_coef=aux_coef), seed=3
    )
    hf_config = hf_model.config.to_dict()
    cfg = config_from_hf(hf_config).with_changes({"router_z_loss_coef": z_coef})
    model = build_model(cfg, device="cpu")
    model.load_state_dict(hf_to_llamatron(hf_model.state_dict(), cfg, hf_config), strict=True)
    tokens = random_tokens(1, 24)

    out = hf_model(tokens, labels=tokens, output_router_logits=True)
    z_loss = torch.logsumexp(out.router_logits[0].float(), dim=-1).pow(2).mean()
    (out.loss + z_coef * z_loss).backward()
    expected = hf_to_llamatron({n: p.grad for n, p in hf_model.named_parameters()}, cfg, hf_config)

    def our_grads(aux: float, z: float) -> dict[str, torch.Tensor]:
        model.zero_grad()
        for m in model.modules():
            if isinstance(m, MoE):
                m.aux_coef, m.z_coef = aux, z
                m.router_loss_weight = torch.tensor(1.0)  # 1 / (sequences x MoE layers)
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:]).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    got = our_grads(aux_coef, z_coef)
    for name, want in expected.items():
        assert torch.allclose(got[name], want, rtol=1e-4, atol=1e-6), name
    router = "layers.0.mlp.router.weight"
    for aux, z in ((0.0, z_coef), (aux_coef, 0.0)):  # each coefficient moves the router's gradient
        assert not torch.allclose(our_grads(aux, z)[router], expected[router], rtol=1e-3, atol=1e-5), (aux, z)
