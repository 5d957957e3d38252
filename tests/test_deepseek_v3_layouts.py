"""DeepSeek-V3 under every layout against the single process (issue 49, item 5): latent attention split over tensor
parallelism (the down-projections replicated, the shared rotary key made whole by `tp_parallel_inputs`), with and
without sequence parallelism, expert parallelism alone and with tp (--etp 1), the distributed optimizer, FSDP,
pipelines plain and interleaved, and context parallelism (values narrower than keys through its key gather).

Each run compares every logged field of every step and evaluation with the single process's (layout.assert_matches:
loss, gradient norm, the router losses, the dropped fraction, every expert's share of the token choices; fp32, gloo,
relative 1e-4), and the final weights (the balancing bias included) to 1e-3 of each tensor's norm. Where a layout
needs another shape, the reference has the same overrides: 4 layers for the pipelines (with multi-token
prediction too); no balancing bias under FSDP
(refused with it, below); a dense model under context parallelism (refused with experts, below). LoRA on latent
attention's five projections: under tp 2 + sp against the single process, and its exported adapter loaded by PEFT
onto the base in transformers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from layout import assert_matches, assert_same_weights, run_train, single_runs

from llamatron.adapters.export import export_adapter
from llamatron.adapters.problems import lora_problems
from llamatron.adapters.targets import apply_lora, find_targets
from llamatron.checkpoint.reader import load_full_tensors
from llamatron.config.settings import LoraConfig
from llamatron.interop.hf import config_to_hf, weight_rules
from llamatron.models import build_model, get_preset
from llamatron.models.moe_balance import balancing_run_problems
from llamatron.parallel.expert import expert_parallel_problems
from llamatron.parallel.tensor import tensor_parallel_problems

MODEL = "deepseek-v3-test"
OVERRIDES = {  # --config YAML -> its model_overrides
    "": {},
    "four-layers": {"num_layers": 4},
    "no-bias": {"router_expert_bias": "false"},
    "dense": {"num_experts": 0},  # MLA without experts (the preset's MoE settings go with them)
    # multi-token prediction: under a pipeline the last stage holds a copy of the embedding for it (its gradient
    # summed with the first stage's, as a tied head's is); mtp_loss is among the logged fields compared
    "mtp": {"num_layers": 4, "num_nextn_predict_layers": 1, "mtp_loss_weight": 0.3},
    "mtp-dense": {"num_experts": 0, "num_nextn_predict_layers": 2, "mtp_loss_weight": 0.3},  # cp: no experts
}
# name -> (flags, processes, overrides)
LAYOUTS = {
    "tp2-sp": (["--tp", "2", "--sequence-parallel"], 2, ""),
    "tp2": (["--tp", "2"], 2, ""),  # the rotary key's gradient all-reduced (no sequence gather)
    "ep2": (["--ep", "2"], 2, ""),
    "ep2-tp2-etp1": (["--ep", "2", "--tp", "2", "--etp", "1", "--sequence-parallel"], 4, ""),
    "dp2-distopt": (["--distributed-optimizer"], 2, ""),
    "dp2-fsdp": (["--fsdp"], 2, "no-bias"),
    "pp2": (["--pp", "2"], 2, "four-layers"),
    "pp2-vpp2": (["--pp", "2", "--vpp", "2"], 2, "four-layers"),
    "cp2": (["--cp", "2"], 2, "dense"),
    "mtp-pp2": (["--pp", "2"], 2, "mtp"),
    "mtp-pp2-vpp2": (["--pp", "2", "--vpp", "2"], 2, "mtp"),
    "mtp-tp2-sp": (["--tp", "2", "--sequence-parallel"], 2, "mtp"),
    "mtp-tp2": (["--tp", "2"], 2, "mtp"),
    "mtp-tp2-pp2": (["--tp", "2", "--pp", "2"], 4, "mtp"),
    "mtp-cp2": (["--cp", "2"], 2, "mtp-dense"),  # the tokens and labels ahead from the whole sequence's
}


def _config(workdir: Path, overrides: str) -> list[str]:
    if not overrides:
        return []
    path = workdir / f"{overrides}.yaml"
    lines = "".join(f"  {k}: {v}\n" for k, v in OVERRIDES[overrides].items())
    path.write_text(f"model_overrides:\n{lines}")
    return ["--config", str(path)]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """overrides -> the single process's per-step metrics and its final weights (each run once per module)."""
    return single_runs(tmp_path_factory, lambda overrides, path: _config(path, overrides), lambda _: MODEL)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_match_the_single_process(name, single, tmp_path):
    flags, nproc, overrides = LAYOUTS[name]
    reference, weights = single(overrides)
    got = run_train([*_config(tmp_path, overrides), *flags, "--save", "ck"], nproc, tmp_path, model=MODEL)
    assert_matches(reference, got)  # every logged field of every step and evaluation
    assert_same_weights(weights, tmp_path / "ck" / "step-5")


def test_layouts_out_of_reach_are_refused_in_one_line():
    """DeepSeek-V3's balancing bias is a frozen parameter FSDP's sharded buffer does not hold, and LoRA would lose
    its moves; its router losses are per sequence, which context parallelism splits."""
    cfg = get_preset(MODEL)
    assert balancing_run_problems(cfg, lora=False, fsdp=True) == [
        "router_expert_bias with --fsdp: its sharded parameters hold no frozen bias; drop one"
    ]
    (lora,) = balancing_run_problems(cfg, lora=True, fsdp=False)
    assert "LoRA" in lora and "router_expert_bias" in lora
    cp = expert_parallel_problems(cfg, ep=1, cp=2)
    assert len(cp) == 1 and "--cp 2 with a mixture of experts" in cp[0]
    # latent attention's heads split whole over tp (its latents are replicated: no other count constrains it)
    assert tensor_parallel_problems(cfg, 8) == ["num_attention_heads=4 is not divisible by tp=8; use tp in [1, 2, 4]"]


# ---- LoRA on latent attention's projections ---------------------------------------------------------------------

MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", ",".join(MLA_TARGETS), "--lr", "1e-2"]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """A base checkpoint (no balancing bias: LoRA keeps it frozen, refused above) and LoRA on it in one process."""
    d = tmp_path_factory.mktemp("lora")
    config = _config(d, "no-bias")
    run_train([*config, "--train-steps", "2", "--save", "base"], 1, d, model=MODEL)
    records = run_train([*config, *LORA, "--load", "base", "--finetune", "--save", "a"], 1, d, model=MODEL)
    return d, config, records


def test_lora_on_latent_attention_under_tp2_sp_matches_the_single_process(lora_runs, tmp_path):
    """The replicated down-projections' adapters are used on sequence shards: their gradients summed over tp."""
    d, config, reference = lora_runs
    flags = [*config, *LORA, "--load", str(d / "base"), "--finetune", "--tp", "2", "--sequence-parallel"]
    got = run_train([*flags, "--save", "a"], 2, tmp_path, model=MODEL)
    assert_matches(reference, got)
    assert_same_weights(d / "a" / "step-5", tmp_path / "a" / "step-5")


def test_lora_on_latent_attention_exports_an_adapter_peft_loads_onto_the_base(lora_runs, tmp_path):
    """export_adapter's directory, loaded by PEFT onto the transformers model of the base checkpoint, gives our
    adapted model's logits. The base goes to transformers in this process (weight_rules) with a zero balancing
    bias, which routes as none (export-hf writes the same for a checkpoint trained without one)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    d, _, _ = lora_runs
    export_adapter(d / "a", tmp_path / "adapter")
    cfg = replace(get_preset(MODEL), router_expert_bias=False)
    model = build_model(cfg, device="meta")
    apply_lora(model, find_targets(model, cfg, MLA_TARGETS), 4, 8.0, 0.0)
    model.load_state_dict(load_full_tensors(d / "a"), strict=True, assign=True)
    biased = replace(cfg, router_expert_bias=True)
    state = dict(load_full_tensors(d / "base"))
    state.update({f"layers.{i}.mlp.expert_bias": torch.zeros(cfg.num_experts) for i in (1, 2)})
    hf_config = config_to_hf(biased)
    base = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf_config)).eval()
    rules = weight_rules(biased, hf_config, base.state_dict().keys())  # transformers 5's stacked experts
    base.load_state_dict({n: t for r in rules for n, t in zip(r.hf_names, r.split(state[r.name]))}, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(tokens)
        without = base(tokens).logits
        with_peft = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(tokens).logits
    assert (ours - without).abs().max() > 1e-3  # the adapters change the model: not vacuous
    assert (with_peft - ours).abs().max() < 1e-5
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(MLA_TARGETS)


def test_lora_on_a_shared_expert_under_tp_is_refused_in_one_line():
    """parallel/expert.py splits a shared expert's linears in place: adapters built for their full shape would not
    fit (seen: a shape error in the first forward)."""
    cfg = replace(get_preset(MODEL), router_expert_bias=False)
    lora = LoraConfig(lora_rank=4, lora_targets=["all-linear"])
    assert lora_problems(lora, cfg, tp=1) == []
    (problem,) = lora_problems(lora, cfg, tp=2)
    assert "shared expert's down_proj,gate_proj,up_proj" in problem and "--tp 2" in problem
    assert lora_problems(LoraConfig(lora_rank=4, lora_targets=MLA_TARGETS), cfg, tp=2) == []


def test_lora_all_linear_adapts_what_peft_adapts_on_the_transformers_model():
    """PEFT's all-linear on transformers' DeepseekV3ForCausalLM (peft 0.22, transformers 5): every nn.Linear but the
    output head, and, as it resolved all-linear on transformers 4's modules, the router (DeepseekV3TopkRouter's
    gate.weight) and the stacked routed experts through target_parameters. Ours adapts the same modules but the
    routed experts (grouped GEMMs, which LoRA here does not adapt). The model trains without the balancing bias
    (LoRA's rule), whose export writes a zero bias beside the router's weight: no module of its own."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = replace(get_preset(MODEL), router_expert_bias=False)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config_to_hf(cfg)))
    adapted = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules="all-linear"))
    theirs = {n.removeprefix("base_model.model.") for n, m in adapted.named_modules() if hasattr(m, "lora_A")}
    routed = {n for n in theirs if ".mlp.experts" in n}
    assert routed and {"model.layers.1.mlp.gate", "model.layers.2.mlp.gate"} <= theirs
    ours = find_targets(build_model(cfg, device="meta"), cfg, ["all-linear"])
    assert {h for t in ours for h in t.hf_modules} == theirs - routed
