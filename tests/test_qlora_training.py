"""--base-precision nf4 through `llamatron train`: a QLoRA run saves only its adapters (its base is the loaded
checkpoint), resumes exactly, runs data- and pipeline-parallel as on one process, exports a PEFT adapter, and
--merge gives the base it trained on (torchao's dequantisation of the base checkpoint's weights) plus the update."""

from __future__ import annotations

import json

import pytest
import torch
from layout import assert_matches, run_train

from llamatron.adapters.export import export_adapter
from llamatron.adapters.merge import lora_update, open_model_weights
from llamatron.checkpoint.reader import CheckpointReader, load_full_tensors

torchao = pytest.importorskip("torchao")
from torchao.quantization import to_nf4  # noqa: E402  (after the skip: torchao is in the test extra)

# q, k, v, o: 128 x 128; gate, up, down: 256 x 128: whole numbers of NF4's 16,384-weight groups
SHAPE = ["--hidden-size", "128", "--ffn-hidden-size", "256", "--num-query-groups", "4", "--train-steps", "4"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,v,down", "--lr", "1e-2"]
NF4 = [*SHAPE, *LORA, "--base-precision", "nf4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("qlora")
    run_train([*SHAPE, "--train-steps", "1", "--save", str(d / "base")], 1, d)
    tune = [*NF4, "--load", str(d / "base"), "--finetune"]
    out = {"nf4": run_train([*tune, "--save", str(d / "nf4"), "--save-interval", "2"], 1, d)}
    out["resumed"] = run_train([*NF4, "--load", str(d / "nf4" / "step-2")], 1, d)
    out["dp2"] = run_train(tune, 2, d)
    out["pp2"] = run_train([*tune, "--pp", "2"], 2, d)
    out["bf16-base"] = run_train([*SHAPE, *LORA, "--load", str(d / "base"), "--finetune"], 1, d)
    return d, out


def test_a_qlora_run_resumes_exactly_and_runs_data_and_pipeline_parallel_as_on_one_process(runs):
    _, out = runs
    assert_matches([r for r in out["nf4"] if r["step"] > 2], out["resumed"], rtol=1e-6)
    assert_matches(out["nf4"], out["dp2"], rtol=1e-5)
    assert_matches(out["nf4"], out["pp2"], rtol=1e-5)
    # the base is NF4: the first step (adapters B = 0, the base alone) differs from the dense base's
    first, dense = out["nf4"][0]["loss"], out["bf16-base"][0]["loss"]
    assert first != dense and abs(first - dense) < 0.05 * dense


def test_a_qlora_checkpoint_holds_only_the_adapters(runs):
    d, _ = runs
    step = d / "nf4" / "step-4"
    stored = set(json.loads((step / "index.json").read_text())["tensors"]["model"])
    assert len(stored) == 8 and all(n.endswith((".lora_a", ".lora_b")) for n in stored)  # q,v (one qkv), down x 2
    assert CheckpointReader(step).names("exp_avg") == stored
    meta = json.loads((step / "meta.json").read_text())
    assert meta["base_checkpoint"]["path"] == str((d / "base" / "step-1").resolve())
    assert meta["config"]["lora"]["base_precision"] == "nf4"


def test_merge_dequantises_the_base_and_the_adapter_exports_for_peft(runs, tmp_path):
    d, _ = runs
    base, tuned = load_full_tensors(d / "base"), load_full_tensors(d / "nf4")
    merged = open_model_weights(d / "nf4")
    # not adapted: torchao's dequantisation of the base's weight, bitwise
    assert torch.equal(
        merged.read("model", "layers.0.attn.o.weight"), to_nf4(base["layers.0.attn.o.weight"]).get_original_weight()
    )
    # adapted: each Hugging Face tensor's dequantisation, plus alpha / r * B A
    qkv = base["layers.1.attn.qkv.weight"]
    deq = torch.cat([to_nf4(qkv[i * 128 : (i + 1) * 128]).get_original_weight() for i in range(3)])
    (target,) = [t for t in merged.lora.targets if t.module == "layers.1.attn.qkv"]
    update = lora_update(tuned["layers.1.attn.qkv.lora_a"], tuned["layers.1.attn.qkv.lora_b"], target, 4)
    assert update.abs().max() > 0
    assert torch.allclose(merged.read("model", "layers.1.attn.qkv.weight"), deq + 2.0 * update, atol=1e-6)
    summary = export_adapter(d / "nf4", tmp_path / "adapter", base_model=None)
    assert summary["files"] == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_flag_nf4_cannot_take_is_one_line_before_anything_is_built(tmp_path):
    with pytest.raises(AssertionError, match="command failed") as err:
        run_train([*NF4, "--save", str(tmp_path / "out")], 1, tmp_path)
    (line,) = [x for x in str(err.value).splitlines() if "--base-precision nf4 saves only the adapters" in x]
    assert "Traceback" not in str(err.value) and line.endswith("or no --save")
    assert not (tmp_path / "out").exists()
