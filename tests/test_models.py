"""Model pieces against their definitions (equivalence with transformers is in test_hf_equivalence.py)."""

import pytest
import torch

from llamatron.kernels.cross_entropy_op import cross_entropy_per_token
from llamatron.models import PRESET_NAMES, build_model, get_preset, materialize
from llamatron.models.config import RopeScaling
from llamatron.models.inventory import flops_per_token, input_embedding_params, num_params
from llamatron.models.layer_input import LayerInput
from llamatron.models.layers import Attention, rope_inv_freq


def make(name, seed=0, **overrides):
    cfg = get_preset(name)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = materialize(build_model(cfg), cfg, seed, "cpu", torch.float32)
    return cfg, model


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_parameter_count_formula_matches_modules(name):
    cfg = get_preset(name)
    model = build_model(cfg)  # meta: no memory even for 70B
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)


def test_published_sizes():
    assert round(num_params(get_preset("llama2-7b")) / 1e9, 2) == 6.74
    assert round(num_params(get_preset("llama2-70b")) / 1e9, 2) == 68.98
    assert round(num_params(get_preset("llama3-8b")) / 1e9, 2) == 8.03
    assert round(num_params(get_preset("mistral-7b")) / 1e9, 2) == 7.24
    assert round(num_params(get_preset("falcon-7b")) / 1e9, 2) == 6.92


def test_init_is_deterministic_and_seed_dependent():
    _, a = make("llama-test", seed=1)
    _, b = make("llama-test", seed=1)
    _, c = make("llama-test", seed=2)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if p.ndim == 2:
            assert not torch.equal(p, r), n


def test_gqa_equals_multi_head_with_repeated_kv():
    cfg, _ = make("llama-test")
    torch.manual_seed(0)
    gqa = Attention(cfg)
    mha_cfg = get_preset("llama-test")
    mha_cfg.num_kv_heads = mha_cfg.num_heads
    mha = Attention(mha_cfg)
    d, nq, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q, k, v = gqa.qkv.weight.split([nq * d, nkv * d, nkv * d])
    rep = lambda w: w.view(nkv, d, -1).repeat_interleave(nq // nkv, dim=0).reshape(nq * d, -1)
    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat([q, rep(k), rep(v)]))
        mha.qkv.bias = None
        mha.o.weight.copy_(gqa.o.weight)
    x = torch.randn(2, 10, cfg.hidden_size)
    pos = torch.arange(10).expand(2, 10)
    from llamatron.models.layers import rope_cos_sin

    cos, sin = rope_cos_sin(cfg, pos, x.dtype)
    torch.testing.assert_close(gqa(x, LayerInput(cos, sin)), mha(x, LayerInput(cos, sin)), atol=1e-5, rtol=1e-5)


def test_causality_and_sliding_window():
    cfg, model = make("mistral-test")  # window 16
    x = torch.randint(0, cfg.vocab_size, (1, 40))
    base = model(x)
    changed = x.clone()
    changed[0, 30] = (changed[0, 30] + 1) % cfg.vocab_size
    out = model(changed)
    torch.testing.assert_close(out[:, :30], base[:, :30])  # the future never leaks
    assert not torch.allclose(out[:, 30:], base[:, 30:])
    # With 2 layers the receptive field is 2 * (window - 1) tokens back.
    early = x.clone()
    early[0, 2] = (early[0, 2] + 1) % cfg.vocab_size
    out = model(early)
    torch.testing.assert_close(out[:, 2 + 2 * 15 + 1 :], base[:, 2 + 2 * 15 + 1 :])
    assert not torch.allclose(out[:, 3:10], base[:, 3:10])


def test_rope_scaling_kinds():
    plain = rope_inv_freq(64, 10000.0, None, 0)
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, RopeScaling("linear", 4.0), 0), plain / 4)
    dyn = RopeScaling("dynamic", 2.0, original_max_position=128)
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, dyn, 100), plain)  # inside the trained context
    assert (rope_inv_freq(64, 10000.0, dyn, 512)[1:] < plain[1:]).all()  # longer: lower frequencies
    l3 = rope_inv_freq(64, 500000.0, RopeScaling("llama3", 8.0, 8192, 1.0, 4.0), 0)
    base = rope_inv_freq(64, 500000.0, None, 0)
    assert torch.equal(l3[0], base[0])  # highest frequency kept
    torch.testing.assert_close(l3[-1], base[-1] / 8)  # lowest slowed by the factor
    yarn = rope_inv_freq(64, 10000.0, RopeScaling("yarn", 8.0, 4096), 0)
    assert torch.equal(yarn[0], plain[0])  # high frequencies kept (transformers' table: tests/hf_fixtures llama-yarn)
    torch.testing.assert_close(yarn[-1], plain[-1] / 8)  # low ones slowed by the factor
    with pytest.raises(ValueError, match="unknown rope scaling"):
        rope_inv_freq(64, 1e4, RopeScaling("longrope", 2.0), 0)


def test_tied_embeddings_share_one_tensor():
    cfg, model = make("falcon-test")
    assert model.lm_head is None and model.head_weight() is model.embed.weight


def test_loss_ignores_masked_labels():
    cfg, model = make("llama-test")
    x = torch.randint(0, cfg.vocab_size, (2, 12))
    labels = x.clone()
    labels[:, :6] = -100
    loss = cross_entropy_per_token(model(x), labels)
    assert (loss[:, :6] == 0).all() and (loss[:, 6:] > 0).all()


def test_forcing_an_attention_backend_sets_the_layers_and_leaves_the_process_alone():
    """--attention-backend: the chosen SDPA kernel is each attention layer's own (tests/test_kernel_choices.py
    shows it runs); every kernel stays enabled for the process, and torch.compile's caches stay on."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from llamatron.models import KernelChoices, apply_kernels

    caches = (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache)
    cfg, model = make("llama-test")
    apply_kernels(model, KernelChoices(attention="flash"))
    assert [layer.attn.backend for layer in model.layers.values()] == ["flash"] * cfg.num_layers
    model(torch.randint(0, cfg.vocab_size, (1, 8)))
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache) == caches
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        KernelChoices(attention="fast")
    with pytest.raises(ValueError, match="unknown rope backend 'fast'"):
        KernelChoices(rope="fast")


def test_swiglu_op_matches_the_plain_expression_forward_and_backward():
    """The custom op behind the fused SwiGLU (its CPU kernel states the derivative the Triton kernel computes)."""
    import torch.nn.functional as F

    from llamatron.kernels.swiglu_op import swiglu_op

    torch.manual_seed(0)
    x = torch.randn(3, 5, 2 * 37, dtype=torch.float64, requires_grad=True)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = swiglu_op(x)
    torch.testing.assert_close(out, ref)
    dy = torch.randn_like(ref)
    (g_ref,) = torch.autograd.grad(ref, x, dy)
    (g_out,) = torch.autograd.grad(out, x, dy)
    torch.testing.assert_close(g_out, g_ref)
    assert torch.autograd.gradcheck(swiglu_op, (x[:1, :2].detach().clone().requires_grad_(),))
    # Registration (fake tensor shapes, autograd, compile tracing) is consistent with the kernel.
    torch.library.opcheck(swiglu_op, (torch.randn(4, 16, requires_grad=True),))


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_with_residual_equals_residual_plus_mlp(bias):
    """The residual rides in the down projection's addmm (bias-free) or is added after it (with a bias):
    both equal residual + mlp(x), values and gradients."""
    from dataclasses import replace

    from llamatron.models.blocks import SwiGLU

    torch.manual_seed(0)
    cfg = replace(get_preset("llama-test"), bias=bias)
    mlp = SwiGLU(cfg)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, cfg.hidden_size, requires_grad=True)
    residual = torch.randn(2, 5, cfg.hidden_size, requires_grad=True)
    out = mlp(x, residual=residual)
    ref = residual + mlp(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    inputs = (x, residual, *mlp.parameters())
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flops_per_token_counts_the_keys_a_query_attends_to():
    """6·(N - input embedding) + 12·L·h·S with S the sequence length, or the sliding window where it is shorter
    (the parameter term by hand: tests/test_flops.py)."""
    import dataclasses

    cfg = get_preset("mistral-test")  # window 16
    plain = dataclasses.replace(cfg, sliding_window=None)
    n = 6.0 * (num_params(cfg) - input_embedding_params(cfg))
    attention = 12.0 * cfg.num_layers * cfg.hidden_size
    assert flops_per_token(plain, 64) == n + attention * 64
    assert flops_per_token(cfg, 64) == n + attention * 16
    assert flops_per_token(cfg, 8) == flops_per_token(plain, 8) == n + attention * 8


def test_llama31_405b_preset_has_the_published_parameter_count():
    """Llama 3.1 405B (Dubey et al. 2024, Table 3): 405.85B parameters as the released checkpoint counts them."""
    from llamatron.models import get_preset
    from llamatron.models.inventory import num_params

    assert num_params(get_preset("llama3.1-405b")) == pytest.approx(405.85e9, rel=0.001)


# The published config.json values of Meta's Llama 3.1/3.2/3.3 releases (the keys the shape depends on).
_LLAMA3_COMMON = {
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}
_LLAMA_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "intermediate_size": 28672}
PUBLISHED_LLAMA3 = {
    # preset: (config.json keys, rope scaling factor, billions of parameters as the model card rounds them)
    "llama3.1-70b": ({**_LLAMA_70B, "tie_word_embeddings": False}, 8.0, 70.6),
    "llama3.3-70b": ({**_LLAMA_70B, "tie_word_embeddings": False}, 8.0, 70.6),
    "llama3.2-1b": (
        {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "intermediate_size": 8192,
         "head_dim": 64, "tie_word_embeddings": True},
        32.0,
        1.24,
    ),
    "llama3.2-3b": (
        {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "intermediate_size": 8192,
         "head_dim": 128, "tie_word_embeddings": True},
        32.0,
        3.21,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED_LLAMA3))
def test_llama3_point_releases_have_the_published_shape_and_parameter_count(name):
    """Llama 3.1 70B, 3.2 1B/3B, 3.3 70B: the export's config.json holds the published values, the inventory's count
    rounds to the model card's, and transformers' own model built from the export counts the same."""
    import transformers

    from llamatron.interop.hf import config_to_hf

    keys, factor, billions = PUBLISHED_LLAMA3[name]
    cfg = get_preset(name)
    hf = config_to_hf(cfg)
    assert {k: hf[k] for k in {**_LLAMA3_COMMON, **keys}} == {**_LLAMA3_COMMON, **keys}
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert {k: hf["rope_scaling"][k] for k in scaling} == scaling
    assert hf["rope_scaling"]["original_max_position_embeddings"] == 8192
    digits = 1 if billions > 10 else 2
    assert round(num_params(cfg) / 1e9, digits) == billions
    with torch.device("meta"):  # no memory, even for 70B
        reference = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**hf))
    assert reference.num_parameters() == num_params(cfg)
