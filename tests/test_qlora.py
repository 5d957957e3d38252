"""--base-precision nf4 (llamatron/adapters/nf4.py): the frozen base as torchao's NF4 against torchao itself and
against transformers + PEFT's LoRA on the same NF4 weights; gradients reach the adapters and the input only."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import FAMILIES, make_random_model, random_tokens
from test_hf_equivalence import llamatron_from_hf

from llamatron.adapters.lora import LoraLinear, adapters_off
from llamatron.adapters.nf4 import BLOCK, GROUP, NF4Linear, fused_rows, nf4_bytes, nf4_problems, quantize_base
from llamatron.adapters.peft_format import load_peft_state
from llamatron.adapters.targets import apply_lora, find_targets
from llamatron.config.settings import config_from_values
from llamatron.models import get_preset
from llamatron.planning.plan import predict_peak_memory

peft = pytest.importorskip("peft")
torchao = pytest.importorskip("torchao")
from torchao.quantization import to_nf4  # noqa: E402  (after the skip: torchao is in the test extra)

RANK, ALPHA = 4, 8.0
# Each of q, k, v, o, gate, up, down a whole number of 16,384-weight groups: 128 x 128, 256 x 128
LLAMA = dict(FAMILIES["llama"][1], hidden_size=128, intermediate_size=256)
HF_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# kind, config, PEFT's all-linear: biases on every linear; Falcon's query_key_value (one Hugging Face tensor whose
# rows llamatron's fused projection holds reordered: 256 x 128), dense, dense_h_to_4h and dense_4h_to_h
MODELS = {
    "llama": ("Llama", LLAMA, HF_LINEARS),
    "llama-bias": ("Llama", dict(LLAMA, attention_bias=True, mlp_bias=True), HF_LINEARS),
    "falcon-40b": (
        "Falcon",
        dict(FAMILIES["falcon-40b-layout"][1], hidden_size=128, num_attention_heads=8, num_kv_heads=4),
        ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    ),
}


def _hf_linears(hf_model, names=HF_LINEARS):
    return {n: m for n, m in hf_model.named_modules() if n.rsplit(".", 1)[-1] in names}


def _pair(targets="all-linear", model_name="llama"):
    """transformers + PEFT (random adapters) whose base linears hold torchao's NF4 of their weights, and llamatron
    with the same base and adapters, its base made NF4 by quantize_base."""
    kind, kwargs, linears = MODELS[model_name]
    hf_model = make_random_model(kind, kwargs)
    model, cfg = llamatron_from_hf(hf_model)
    found = find_targets(model, cfg, targets.split(","))
    apply_lora(model, found, RANK, ALPHA, 0.0)
    torch.manual_seed(1)
    names = list(linears) if targets == "all-linear" else [f"{t}_proj" for t in targets.split(",")]
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=names, init_lora_weights=False)
    dense = {n: m.weight.detach().clone() for n, m in _hf_linears(hf_model, linears).items()}
    for m in _hf_linears(hf_model, linears).values():  # F.linear on torchao's NF4 runs its LinearNF4
        nf4 = to_nf4(m.weight.detach())
        # transformers' FalconLinear computes x @ W.T, which torchao's NF4 does not run (no permute): it holds
        # torchao's dequantisation, the weight LinearNF4 multiplies by
        m.weight = torch.nn.Parameter(nf4.get_original_weight() if kind == "Falcon" else nf4, requires_grad=False)
    peft_model = peft.get_peft_model(hf_model, config).eval()
    load_peft_state(model, found, peft.get_peft_model_state_dict(peft_model))
    quantize_base(model, cfg, fused_rows(cfg))
    return peft_model, model, cfg, dense


def test_the_dequantised_base_is_torchaos_bitwise_and_holds_its_bytes():
    _, model, cfg, dense = _pair("q,down")
    hf = "model.layers.{}.{}.{}"
    parts = {"attn.qkv": ("self_attn", "qkv"), "attn.o": ("self_attn", "o"), "mlp.gate_up": ("mlp", ("gate", "up"))}
    parts["mlp.down"] = ("mlp", ("down",))
    for i in range(cfg.num_layers):
        for ours, (block, names) in parts.items():
            m = model.get_submodule(f"layers.{i}.{ours}")
            assert isinstance(m, (LoraLinear, NF4Linear))  # adapted or not, every decoder linear is NF4
            reference = torch.cat(
                [to_nf4(dense[hf.format(i, block, f"{n}_proj")]).get_original_weight() for n in names]
            )
            assert torch.equal(m.weight.dequantize(), reference)
            numel = sum(dense[hf.format(i, block, f"{n}_proj")].numel() for n in names)
            assert numel % GROUP == 0 and m.weight.nbytes() == sum(
                nf4_bytes(dense[hf.format(i, block, f"{n}_proj")].numel(), 4) for n in names
            )
    assert not any(isinstance(p, type(to_nf4(torch.ones(GROUP)))) for p in model.parameters())
    assert {n for n, p in model.named_parameters() if n.endswith("weight")} == {
        "embed.weight",
        "lm_head.weight",
        "norm.weight",
        *(f"layers.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "mlp_norm")),
    }


def test_nf4_bytes_is_half_a_byte_a_weight_plus_the_scales():
    numel = 3 * GROUP
    nf4 = to_nf4(torch.randn(numel // 128, 128, dtype=torch.bfloat16))
    names, _ = nf4.__tensor_flatten__()
    held = sum(getattr(nf4, n).numel() * getattr(nf4, n).element_size() for n in names)
    # codes 0.5 B/weight, int8 scale per 64, bf16 factor per 256 scales, bf16 mean and 16-entry table
    assert held == nf4_bytes(numel, 2) == numel // 2 + numel // BLOCK + 2 * (3 + 1 + 16)


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_logits_and_gradients_equal_peft_on_torchaos_nf4(model_name):
    peft_model, model, _, _ = _pair(model_name=model_name)
    assert sum(isinstance(m, LoraLinear) and not isinstance(m.weight, torch.Tensor) for m in model.modules()) == 8
    tokens = random_tokens(2, 16)
    expected = peft_model(tokens).logits
    got = model(tokens)
    with torch.no_grad(), peft_model.disable_adapter():
        without = peft_model(tokens).logits
    assert (expected - without).abs().max() > 1e-2  # the adapters change the logits: the check is not vacuous
    assert (got - expected).abs().max().item() <= 1e-5
    with torch.no_grad(), adapters_off([model]):  # DPO's reference pass: the NF4 base alone
        assert (model(tokens) - without).abs().max().item() <= 1e-5
    expected.pow(2).mean().backward()
    got.pow(2).mean().backward()
    theirs = {n: p.grad for n, p in peft_model.named_parameters() if p.grad is not None}
    ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(ours) == {n for n, p in model.named_parameters() if n.endswith(("lora_a", "lora_b"))}
    # the first layer's q_proj (Falcon: query_key_value) adapter: its gradient went back through every later NF4
    # linear's input gradient
    first = [n for n in theirs if ".layers.0." in n or ".h.0." in n]
    (a,) = [theirs[n] for n in first if any(f"{m}.lora_A" in n for m in ("q_proj", "query_key_value"))]
    assert torch.allclose(ours["layers.0.attn.qkv.lora_a"][:RANK], a, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, "base", None, {}, False, "none"), "but --lora-rank is 0: give --lora-rank R"),
        ((4, None, "out", {}, False, "none"), "give --load CHECKPOINT (e.g. --finetune of an import), or no --save"),
        ((4, "base", None, {"tp": 2, "pp": 2}, False, "none"), "nf4 with --tp 2 is not supported yet"),
        ((4, "base", None, {"cp": 2}, False, "none"), "nf4 with --cp 2 is not supported yet"),
        ((4, "base", None, {}, True, "none"), "with --fsdp is not supported yet"),
        ((4, "base", None, {}, False, "rowwise"), "--fp8 rowwise both replace the base's matmul"),
    ],
)
def test_what_nf4_cannot_do_is_one_line(args, message):
    (problem,) = nf4_problems("nf4", *args)
    assert message in problem and "\n" not in problem
    assert nf4_problems("same", *args) == []
    assert nf4_problems("nf4", 4, None, None, {"tp": 1, "pp": 2}, False, "none") == []  # no saves: no base to name


def _train(model, steps=3):
    """A few AdamW steps on the adapters; returns them."""
    adapters = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=1e-2)
    for step in range(steps):
        tokens = random_tokens(2, 16, seed=step)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_training_on_the_nf4_base_equals_training_on_its_dequantisation():
    _, model, cfg, dense = _pair("q,v,down")
    hf_model = make_random_model("Llama", LLAMA)
    with torch.no_grad():  # the same model, its linears holding torchao's dequantisation of their NF4
        for n, m in _hf_linears(hf_model).items():
            m.weight.copy_(to_nf4(dense[n]).get_original_weight())
    reference, _ = llamatron_from_hf(hf_model)
    found = find_targets(reference, cfg, ["q", "v", "down"])
    apply_lora(reference, found, RANK, ALPHA, 0.0)
    reference.load_state_dict(
        {n: p for n, p in model.state_dict().items() if n.endswith(("lora_a", "lora_b"))}, strict=False
    )
    got, expected = _train(model.train()), _train(reference.train())
    assert got.keys() == expected.keys() and len(got) == 8  # qkv (q, v) and down in 2 layers
    for n in got:
        assert torch.allclose(got[n], expected[n], rtol=1e-5, atol=1e-6), n


def test_plan_counts_the_nf4_base_as_half_a_byte_a_weight_plus_its_scales():
    values = {"model": "llama-1b", "seq_length": 4096, "device": "cuda", "precision": "bf16", "lora_rank": 16}
    dense = predict_peak_memory(config_from_values(values), 1)["weights"]
    nf4 = predict_peak_memory(config_from_values({**values, "base_precision": "nf4", "load": "base"}), 1)["weights"]
    m = get_preset("llama-1b")
    kv = m.num_kv_heads * m.hidden_size // m.num_heads
    # per layer q, o (h x h), k, v (kv x h), gate, up, down (ffn x h): each 16,384-weight groups, quantised alone
    tensors = [m.hidden_size * n for n in (m.hidden_size, m.hidden_size, kv, kv, *[m.ffn_hidden_size] * 3)]
    held = sum(n / 2 + n / 64 + 2 * (n / 16384 + 1 + 16) for n in tensors) * m.num_layers  # codes, scales, bf16 rest
    assert dense - nf4 == 2 * sum(tensors) * m.num_layers - held
    staged = {**values, "base_precision": "nf4", "pp": 2, "micro_batch_size": 1, "global_batch_size": 8}
    halves = predict_peak_memory(config_from_values({**staged, "base_precision": "same"}), 2)["weights"]
    assert halves - predict_peak_memory(config_from_values(staged), 2)["weights"] == (dense - nf4) / 2  # its layers
