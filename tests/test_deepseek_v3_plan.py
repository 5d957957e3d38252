"""The planner's counts for DeepSeek-V3 come from its latent attention's own declaration (mla.py's MLACounts, read
through models/inventory.py): activation bytes against what autograd saves, the decode cache against the buffers
decoding allocates, and `plan` on the published sizes."""

import dataclasses
import json
import time

import pytest
import torch
from test_plan import layer_saved_per_token, model_saved_per_token
from test_plan_cli import main_code

from llamatron.kernels import triton_check
from llamatron.models import KernelChoices, build_model, get_preset, materialize
from llamatron.models.inventory import active_params, decode_cache_bytes_per_token, flops_per_token, layers, num_params
from llamatron.models.kv_cache import KVCache
from llamatron.planning import activations as A
from llamatron.planning.params import stage_params


def _dense_test_model(q_lora_rank: int | None):
    """deepseek-v3-test with dense layers only (its MoE layers' shared experts are another count) and values as
    wide as the query·key heads: CPU's SDPA runs its fused kernel only for one width (for two it runs the math
    kernel, which keeps the seq x seq probabilities); the widths still differ inside (v_head_dim 24 = 16 + 8)."""
    cfg = get_preset("deepseek-v3-test")
    return dataclasses.replace(cfg, first_k_dense_replace=cfg.num_layers, v_head_dim=24, q_lora_rank=q_lora_rank)


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["low-rank-q", "full-q"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton-norm-swiglu"])
def test_layer_activations_match_autograd(q_lora_rank, dtype, fused, monkeypatch):
    monkeypatch.setattr(triton_check, "kernels_on", lambda backend, x: backend == "triton")  # the ops' CPU kernels
    cfg = _dense_test_model(q_lora_rank)
    pick = "triton" if fused else "torch"
    measured = layer_saved_per_token(cfg, dtype, KernelChoices(rmsnorm=pick, rope=pick, swiglu=pick))
    a = 2 if dtype == torch.bfloat16 else 4
    terms = A.layer_activation_terms(cfg, a, kernels=A.LayerKernels(norms=fused, swiglu=fused))
    assert "latent_norms" in terms  # the latent attention's own declaration, not the shared attention's
    assert measured == sum(terms.values()) + 2 * a * cfg.qk_rope_head_dim  # + cos/sin, qk_rope_head_dim wide


@pytest.mark.parametrize("name", ["llama3-test", "qwen2-test", "deepseek-v3-test"])
def test_decode_cache_bytes_are_what_decoding_allocates(name):
    """The declared decode-cache width (2 x kv heads x head_dim for the shared attention, kv_lora_rank +
    qk_rope_head_dim for MLA) against the buffers a KV cache really holds after a prefill and a step."""
    cfg = get_preset(name)
    model = materialize(build_model(cfg), cfg, 1, "cpu", torch.float32).eval()
    slots, rows = 16, 2
    cache = KVCache(slots)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (rows, 5)), cache=cache)
        model(torch.randint(0, cfg.vocab_size, (rows, 1)), cache=cache)
    held = 0
    for layer in model.layers:
        held += sum(t.nbytes for t in vars(cache.layer(layer)).values() if isinstance(t, torch.Tensor))
    assert held == rows * slots * decode_cache_bytes_per_token(cfg, 4)


@pytest.mark.parametrize(("model", "gpus"), [("deepseek-v3", 256), ("kimi-k2", 512)])
def test_plan_finds_layouts_for_the_published_sizes(model, gpus, capsys):
    start = time.perf_counter()
    assert main_code(["plan", "--model", model, "--gpus", str(gpus), "--top", "3", "--json"]) == 0
    took = time.perf_counter() - start
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert len(layouts) == 3 and took < 30, took
    assert all(lay["memory_gb"]["total"] <= 80 for lay in layouts), layouts


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_model_activations_match_autograd(recompute):
    """The whole model and its loss: the chunk's terms (cos/sin at the rotary width, what selective recompute frees
    as MLA declares it: the kernel's output too, which the output projection's input copies)."""
    cfg = _dense_test_model(32)
    measured = model_saved_per_token(cfg, recompute, KernelChoices(rmsnorm="torch", rope="torch", swiglu="torch"))
    chunk = A.chunk_activation_bytes(cfg, cfg.num_layers, True, True, 2, 1, False, recompute, pipelined=False)
    assert measured == pytest.approx(chunk + 4 * cfg.vocab_size, rel=0.01)  # + the loss's saved log-softmax


# ---- multi-token prediction's modules ---------------------------------------------------------------------------


def _mtp(cfg, depths: int = 2):
    return dataclasses.replace(cfg, num_nextn_predict_layers=depths)


def test_parameter_counts_include_the_mtp_modules():
    """num_params and active_params against the built model (the MTP modules' block, eh_proj and three norms, the
    embedding and head shared) and against the formula: each module adds a decoder layer numbered after the model's
    (a MoE layer, experts_per_token experts active) and eh_proj 2h x h plus three norms h."""
    cfg = _mtp(get_preset("deepseek-v3-test"))
    built = sum(p.numel() for p in build_model(cfg).parameters())
    assert num_params(cfg) == built
    plain = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    h, moe_layer = cfg.hidden_size, layers(plain)[-1]
    experts = moe_layer.params("expert")
    per_module = 2 * h * h + 3 * h
    assert num_params(cfg) - num_params(plain) == 2 * (moe_layer.params() + per_module)
    active = moe_layer.params() - experts + experts * cfg.experts_per_token // cfg.num_experts
    assert active_params(cfg) - active_params(plain) == 2 * (active + per_module)


def test_flops_include_the_mtp_modules_and_their_head():
    """6 x (their active parameters + the output head once more each) + 12 x their layers' attention width x S."""
    cfg = _mtp(get_preset("deepseek-v3-test"))
    plain = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    seq, width = 32, layers(plain)[-1].attention_width
    extra = active_params(cfg) - active_params(plain) + 2 * cfg.vocab_size * cfg.hidden_size
    assert flops_per_token(cfg, seq) - flops_per_token(plain, seq) == pytest.approx(6 * extra + 12 * 2 * width * seq)


def test_stage_params_hold_the_mtp_modules_on_the_last_stage():
    """The last stage's count: the modules (built there, on meta) and, under a pipeline, the embedding's copy."""
    cfg = _mtp(dataclasses.replace(get_preset("deepseek-v3-test"), num_layers=4))
    plain = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    modules = sum(p.numel() for p in build_model(cfg).extra_heads.parameters())
    assert stage_params(cfg, 1, 1, 0, 4)[0] - stage_params(plain, 1, 1, 0, 4)[0] == modules
    assert stage_params(cfg, 1, 2, 0, 2)[0] == stage_params(plain, 1, 2, 0, 2)[0]
    copy = cfg.vocab_size * cfg.hidden_size
    assert stage_params(cfg, 1, 2, 1, 2)[0] - stage_params(plain, 1, 2, 1, 2)[0] == modules + copy


def test_mtp_activations_match_autograd():
    """What the MTP modules save in the model's forward (a model without experts, whose modules' layers are then
    its others'): autograd with them less autograd without, against the last chunk's terms with them less without."""
    cfg = _mtp(dataclasses.replace(_dense_test_model(32), num_experts=0), depths=1)
    plain = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    choices = KernelChoices(rmsnorm="torch", rope="torch", swiglu="torch")
    measured = model_saved_per_token(cfg, "none", choices) - model_saved_per_token(plain, "none", choices)

    def chunk(c):
        return A.chunk_activation_bytes(c, c.num_layers, True, True, 2, 1, False, "none", pipelined=False)

    assert chunk(cfg) - chunk(plain) == pytest.approx(measured, rel=0.01)
