"""DeepSeek-V3's multi-token prediction in training (the family's extra heads, models/transformer.py; the
language-model objective's share, objectives/extra_heads.py): the loss against the formula written out from the
model's own modules, gradients reaching them, the layouts it refuses, and its Hugging Face round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_deepseek_v3 import random_config, random_model
from test_qwen import _run

from llamatron.config.settings import config_from_values
from llamatron.errors import ConfigError, HFConversionError
from llamatron.interop.hf import config_from_hf, hf_to_llamatron
from llamatron.kernels.cross_entropy_op import IGNORE_INDEX
from llamatron.models import build_model, get_preset
from llamatron.models.families import model_problems
from llamatron.models.init import materialize
from llamatron.models.layer_input import LayerInput
from llamatron.models.layers import rope_cos_sin
from llamatron.objectives.language_model import LanguageModelObjective
from llamatron.parallel.mesh import Mesh
from llamatron.training.validate import validate

WEIGHT = 0.3


def mtp_config(depths: int = 2, **changes):
    return dataclasses.replace(
        get_preset("deepseek-v3-test"), **{"num_nextn_predict_layers": depths, "mtp_loss_weight": WEIGHT, **changes}
    )


def mtp_model(cfg, seed: int = 0):
    return materialize(build_model(cfg), cfg, seed, "cpu", torch.float32)


def _batch(seed: int, batch: int = 2, seq: int = 12, vocab: int = 256):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, 3] = IGNORE_INDEX  # a label that counts nothing (an SFT prompt's, a document end's)
    return {"input_ids": tokens[:, :-1], "labels": labels}


def _by_hand(model, cfg, mbs) -> torch.Tensor:
    """main CE + λ / D · Σ_k (Σ over the batch of -log p_k(t_{i+k+1}) / their number), computed from the model's
    modules one depth after another (the paper's chain), not through mtp.py's functions."""
    main_sum, main_n = torch.zeros(()), 0
    depth_sums = torch.zeros(cfg.num_nextn_predict_layers)
    depth_n = torch.zeros(cfg.num_nextn_predict_layers)
    for mb in mbs:
        ids, labels = mb["input_ids"], mb["labels"]
        seq = ids.shape[1]
        h = model.embed(ids)
        positions = torch.arange(seq).expand_as(ids)
        cos, sin = rope_cos_sin(cfg, positions, h.dtype)
        for layer in model.layers.values():
            h = layer(h, LayerInput(cos, sin, positions=positions))
        logits = model.lm_head(model.norm(h))
        main_sum = main_sum + F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        main_n += int((labels != IGNORE_INDEX).sum())
        for k, m in enumerate(model.extra_heads, start=1):
            ahead = torch.cat([ids[:, k:], torch.zeros_like(ids[:, :k])], dim=1)  # token i + k (past the end: 0)
            x = m.eh_proj(torch.cat([m.enorm(model.embed(ahead)), m.hnorm(h)], dim=-1))
            h = m.block(x, LayerInput(cos, sin, positions=positions))
            logits_k = model.lm_head(m.norm(h))
            target = torch.full_like(labels, IGNORE_INDEX)
            target[:, : seq - k] = labels[:, k:]  # label i + k = token i + k + 1
            depth_sums[k - 1] += F.cross_entropy(logits_k.flatten(0, 1), target.flatten(), reduction="sum")
            depth_n[k - 1] += int((target != IGNORE_INDEX).sum())
    return main_sum / main_n + WEIGHT * (depth_sums / depth_n).mean()


def test_training_loss_is_main_plus_weighted_mtp_loss_by_hand():
    cfg = mtp_config()
    model = mtp_model(cfg)
    objective = LanguageModelObjective.build([model], cfg, Mesh(), torch.device("cpu"))
    mbs = [_batch(1), _batch(2)]
    normaliser = objective.normaliser(mbs)
    objective.begin_step(4, None)
    total = sum(objective.loss(model(mb["input_ids"]), mb, normaliser) for mb in mbs)
    with torch.no_grad():
        expected = _by_hand(model, cfg, mbs)
    assert total.item() == pytest.approx(expected.item(), rel=1e-5)
    # the MTP statistic: the unweighted mean over the depths
    stats = objective.stat_fields(objective.step_stats(objective.local_stats(), 4).tolist())
    main = sum(objective.per_token(model(mb["input_ids"]), mb["labels"]).sum() for mb in mbs) / normaliser[0]
    assert stats["mtp_loss"] == pytest.approx((expected.item() - main.item()) / WEIGHT, rel=1e-4)
    assert "moe_aux_loss" in stats


def test_gradients_reach_the_mtp_modules_and_the_shared_embedding():
    cfg = mtp_config(depths=1)
    model = mtp_model(cfg)
    objective = LanguageModelObjective.build([model], cfg, Mesh(), torch.device("cpu"))
    mb = _batch(3)
    objective.begin_step(2, None)
    objective.loss(model(mb["input_ids"]), mb, objective.normaliser([mb])).backward()
    mtp = dict(model.extra_heads.named_parameters())
    assert {"0.eh_proj.weight", "0.enorm.weight", "0.hnorm.weight", "0.norm.weight"} <= set(mtp)
    for name in ("0.eh_proj.weight", "0.enorm.weight", "0.hnorm.weight", "0.norm.weight", "0.block.attn.o.weight"):
        assert mtp[name].grad is not None and mtp[name].grad.abs().sum() > 0, name
    # the MTP block's experts route and count as a MoE layer: 3 layers, the first dense, and one MTP block
    assert objective.router is not None and objective.router.num_layers == 2 + 1


def test_mtp_off_is_the_plain_model():
    cfg = mtp_config(depths=0)
    model = mtp_model(cfg)
    assert model.extra_heads is None
    objective = LanguageModelObjective.build([model], cfg, Mesh(), torch.device("cpu"))
    assert objective.extra is None and "mtp_loss" not in objective.stat_fields([0.0] * 11)


def test_tensor_and_context_parallelism_train_mtp():
    run = config_from_values({"model": "deepseek-v3-test", "seq_length": 32, "global_batch_size": 8, "tp": 2})
    validate(run, world_size=2, model=mtp_config())
    assert mtp_config().layout_problems(2, 1, 2) == []


def test_fsdp_over_several_ranks_is_refused_in_one_line():
    """Seen: --fsdp on dp 2 with one MTP module (no balancing bias, 4 layers) parts from the single process at step
    2's grad norm (0.9274 against 0.9263); --fsdp --pp 2 (one rank a stage: nothing sharded) matches it."""
    given = {"model": "deepseek-v3-test", "seq_length": 32, "global_batch_size": 8, "fsdp": True}
    no_bias = mtp_config(router_expert_bias=False)
    with pytest.raises(ConfigError) as err:
        validate(config_from_values(given), world_size=2, model=no_bias)
    assert "\n" not in str(err.value) and "--fsdp over 2 ranks" in str(err.value)
    validate(config_from_values(given), world_size=2, model=dataclasses.replace(no_bias, num_nextn_predict_layers=0))
    validate(config_from_values({**given, "pp": 2, "pp_layers": "2,1"}), world_size=2, model=no_bias)


def test_a_pipeline_trains_mtp_unless_the_embedding_is_tied():
    """The last stage holds a copy of the embedding for the MTP modules; a tied head would be a second copy."""
    run = config_from_values(
        {"model": "deepseek-v3-test", "seq_length": 32, "global_batch_size": 8, "pp": 2, "pp_layers": "2,1"}
    )
    validate(run, world_size=2, model=mtp_config())
    (problem,) = mtp_config(tie_embeddings=True).layout_problems(1, 2, 1)
    assert "tie_embeddings and --pp 2" in problem and mtp_config(tie_embeddings=True).layout_problems(1, 1, 1) == []


def test_sequences_no_longer_than_the_depths_are_refused():
    (problem,) = mtp_config().seq_length_problems(2, "deepseek-v3-test")
    assert problem.startswith("--seq-length 2 is too short") and "give more than 2" in problem
    assert mtp_config().seq_length_problems(3, "deepseek-v3-test") == []
    assert ">= 0" in " ".join(model_problems(mtp_config(mtp_loss_weight=-1.0)))


def _hf_checkpoint_with_mtp(path, seed: int = 5) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3 directory laid out as DeepSeek publishes MTP (transformers builds no MTP module): a random
    model of L + 1 layers saved, then config.json told L layers and one MTP module, whose layer L gains enorm,
    hnorm, eh_proj, shared_head.norm and the copies of the embedding and head. Returns the saved tensors."""
    config = {**random_config(seed), "num_hidden_layers": 3, "first_k_dense_replace": 1, "q_lora_rank": 16}
    config["tie_word_embeddings"] = False
    random_model(seed, config).save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    hidden, g = config["hidden_size"], torch.Generator().manual_seed(seed)
    layer = "model.layers.2"
    tensors[f"{layer}.enorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    tensors[f"{layer}.hnorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    tensors[f"{layer}.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    tensors[f"{layer}.eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=g)
    tensors[f"{layer}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{layer}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 2, "num_nextn_predict_layers": 1}))
    return tensors


def test_import_verify_export_keeps_the_mtp_weights_bitwise(tmp_path):
    saved = _hf_checkpoint_with_mtp(tmp_path / "hf")
    assert _run("import-hf", tmp_path / "hf", tmp_path / "ck") == 0
    ours = load_file(str(next((tmp_path / "ck").glob("step-0/*.safetensors"))))
    assert torch.equal(ours["extra_heads.0.eh_proj.weight"], saved["model.layers.2.eh_proj.weight"])
    assert torch.equal(ours["extra_heads.0.norm.weight"], saved["model.layers.2.shared_head.norm.weight"])
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in ours)  # one embedding, one head
    # transformers ignores the MTP layer: the main logits still match it
    assert _run("verify", tmp_path / "ck", "--hf", tmp_path / "hf", "--batches", "2") == 0
    assert _run("export-hf", tmp_path / "ck", tmp_path / "out") == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(saved) and all(torch.equal(exported[n], t) for n, t in saved.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_mtp_copies_of_the_embedding_that_differ_are_refused(tmp_path):
    saved = _hf_checkpoint_with_mtp(tmp_path / "hf")
    saved["model.layers.2.embed_tokens.weight"][0, 0] += 1.0
    save_file(saved, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match="copies of embed.weight differ"):
        hf_to_llamatron(saved, config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text())), {})


def test_export_drop_mtp_writes_the_model_without_them(tmp_path, capsys):
    saved = _hf_checkpoint_with_mtp(tmp_path / "hf")
    assert _run("import-hf", tmp_path / "hf", tmp_path / "ck") == 0
    assert _run("export-hf", tmp_path / "ck", tmp_path / "out", "--drop-mtp") == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    kept = {n: t for n, t in saved.items() if not n.startswith("model.layers.2.")}
    assert set(exported) == set(kept) and all(torch.equal(exported[n], t) for n, t in kept.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert _run("verify", tmp_path / "ck", "--hf", tmp_path / "out", "--batches", "1") == 0
    capsys.readouterr()
    # a model without them: one line, nothing written
    assert _run("import-hf", tmp_path / "out", tmp_path / "ck2") == 0
    assert _run("export-hf", tmp_path / "ck2", tmp_path / "out2", "--drop-mtp") != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "has no multi-token prediction modules" in err[-1] and not (tmp_path / "out2").exists()
