"""Training with LoRA (`--lora-rank`): from a base checkpoint with --finetune, only the adapters train (the base
weights are saved bitwise unchanged, optimizer state exists for the adapters alone), a resume continues exactly,
and what LoRA does not run yet is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_train import llamatron

from llamatron.adapters.export import export_adapter
from llamatron.adapters.merge import open_model_weights
from llamatron.adapters.targets import apply_lora, find_targets
from llamatron.checkpoint.hf_io import export_hf
from llamatron.checkpoint.reader import CheckpointReader, load_full_tensors, open_weights
from llamatron.errors import CheckpointError
from llamatron.inference.generate import load_for_generation
from llamatron.models import build_model, get_preset

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

RUN = ["--model", "llama-test", "--mock-data", "--device", "cpu", "--seq-length", "16", "--global-batch-size", "2"]
RUN += ["--micro-batch-size", "1", "--no-progress", "--lr", "1e-2", "--warmup-steps", "0"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,v,down"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A base checkpoint; LoRA on it for 6 steps (saved at 3 and 6), and resumed from step 3 to 6."""
    d = tmp_path_factory.mktemp("lora")
    llamatron("train", *RUN, "--train-steps", "2", "--save", str(d / "base"), cwd=d)
    start = [*RUN, *LORA, "--load", str(d / "base"), "--finetune", "--train-steps", "6", "--save-interval", "3"]
    llamatron("train", *start, "--save", str(d / "a"), "--metrics-file", str(d / "a.jsonl"), cwd=d)
    resume = ["--load", str(d / "a" / "step-3"), "--train-steps", "6", "--metrics-file", str(d / "b.jsonl")]
    llamatron("train", *RUN, *LORA, *resume, cwd=d)
    return d


def _losses(path) -> dict[int, float]:
    records = map(json.loads, path.read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r and r.get("grad_norm") is not None}  # training steps


def test_only_the_adapters_train(runs):
    base, tuned = load_full_tensors(runs / "base"), load_full_tensors(runs / "a")
    adapters = {n for n in tuned if n.endswith((".lora_a", ".lora_b"))}
    assert adapters == {
        f"layers.{i}.{m}.{x}" for i in range(2) for m in ("attn.qkv", "mlp.down") for x in ("lora_a", "lora_b")
    }
    assert set(tuned) - adapters == set(base)
    assert all(torch.equal(tuned[n], base[n]) for n in base)  # the base is frozen
    assert all(tuned[n].abs().max() > 0 for n in adapters if n.endswith("lora_b"))  # B left zero: it trained
    reader = CheckpointReader(runs / "a")
    assert reader.names("exp_avg") == adapters  # no optimizer state for the base


def test_a_lora_run_resumes_exactly(runs):
    straight, resumed = _losses(runs / "a.jsonl"), _losses(runs / "b.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == pytest.approx(straight[s], rel=1e-6) for s in resumed), (straight, resumed)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-targets", "qkv"], "--lora-targets qkv names no linear"),
        (["--lora-rank", "-1"], "--lora-rank"),
        (["--lora-rank", "0"], "--lora-alpha, --lora-targets set up LoRA adapters, but --lora-rank is 0"),
    ],
)
def test_what_lora_cannot_do_is_one_line(tmp_path, flags, message):
    proc = llamatron("train", *RUN, *LORA, *flags, "--train-steps", "1", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_lora_checkpoint_is_not_resumed_without_its_adapters(runs, tmp_path):
    proc = llamatron("train", *RUN, "--load", str(runs / "a"), "--train-steps", "7", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "load it with those flags" in proc.stderr, proc.stderr
    with pytest.raises(CheckpointError, match="read without merging its adapters"):
        open_weights(runs / "a")  # the plain reader never drops the adapters silently


def _our_lora_logits(ckpt, tokens):
    """llamatron's model with the adapters applied (not merged), loaded with every tensor of `ckpt`."""
    cfg = get_preset("llama-test")
    model = build_model(cfg, device="meta")
    apply_lora(model, find_targets(model, cfg, ["q", "v", "down"]), 4, 8.0, 0.0)
    model.load_state_dict(load_full_tensors(ckpt), strict=True, assign=True)
    with torch.no_grad():
        return model.eval()(tokens)


def test_exports_merge_the_adapters_and_peft_loads_them_onto_the_base(runs, tmp_path):
    export_hf(runs / "base", tmp_path / "base")
    export_hf(runs / "a", tmp_path / "merged", weights=open_model_weights(runs / "a"))
    proc = llamatron("export-hf", str(runs / "a"), str(tmp_path / "adapter"), "--adapter", cwd=tmp_path)
    assert "adapter_model.safetensors" in proc.stdout
    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = _our_lora_logits(runs / "a", tokens)
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        base = load(tmp_path / "base").eval()
        without = base(tokens).logits
        merged = load(tmp_path / "merged").eval()(tokens).logits
        with_peft = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(tokens).logits
    vocab = without.shape[-1]
    assert (ours[..., :vocab] - without).abs().max() > 1e-3  # the adapters change the model: not vacuous
    assert (merged - ours[..., :vocab]).abs().max() < 1e-5
    assert (with_peft - ours[..., :vocab]).abs().max() < 1e-5
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        4,
        8.0,
        ["down_proj", "q_proj", "v_proj"],
    )


def test_generate_and_verify_read_a_lora_checkpoint_merged(runs, tmp_path):
    export_hf(runs / "a", tmp_path / "merged", weights=open_model_weights(runs / "a"))
    proc = llamatron("verify", str(runs / "a"), "--hf", str(tmp_path / "merged"), "--batches", "1", cwd=tmp_path)
    assert "PASS" in proc.stdout
    model, _ = load_for_generation(str(runs / "a"))
    tokens = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - _our_lora_logits(runs / "a", tokens)).abs().max() < 1e-5


def test_adapter_export_of_a_plain_checkpoint_is_one_line(runs, tmp_path):
    proc = llamatron("export-hf", str(runs / "base"), str(tmp_path / "x"), "--adapter", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "holds no LoRA adapters" in proc.stderr, proc.stderr


def test_lora_init_from_starts_the_adapters_from_a_peft_directory(runs, tmp_path):
    llamatron("export-hf", str(runs / "a"), str(tmp_path / "adapter"), "--adapter", cwd=tmp_path)
    start = ["--load", str(runs / "base"), "--finetune", "--train-steps", "1", "--lr", "0", "--min-lr", "0"]
    init = ["--lora-init-from", str(tmp_path / "adapter")]
    llamatron("train", *RUN, *LORA, *start, *init, "--save", str(tmp_path / "c"), cwd=tmp_path)
    trained, started = load_full_tensors(runs / "a"), load_full_tensors(tmp_path / "c")
    adapters = [n for n in trained if n.endswith((".lora_a", ".lora_b"))]
    assert adapters and all(torch.equal(started[n], trained[n]) for n in adapters)  # lr 0: as read


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-alpha", "16"], "train with --lora-rank 4 --lora-alpha 8.0 --lora-targets down_proj,q_proj,v_proj"),
        (["--lora-rank", "0"], "--lora-init-from set up LoRA adapters, but --lora-rank is 0"),
    ],
)
def test_an_adapter_that_does_not_fit_is_one_line(runs, tmp_path, flags, message):
    export_adapter(runs / "a", tmp_path / "adapter")
    init = ["--lora-init-from", str(tmp_path / "adapter"), "--train-steps", "1"]
    proc = llamatron("train", *RUN, *LORA, *flags, *init, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_lora_checkpoint_stores_the_adapters_and_names_its_base(runs, tmp_path):
    step = runs / "a" / "step-6"
    stored = set(json.loads((step / "index.json").read_text())["tensors"]["model"])
    assert stored and all(n.endswith((".lora_a", ".lora_b")) for n in stored)  # no frozen weight written again
    meta = json.loads((step / "meta.json").read_text())
    assert meta["base_checkpoint"]["path"] == str((runs / "base" / "step-2").resolve())
    # A copy whose base is elsewhere: read through it while it is the same; refused once changed or gone.
    shutil.copytree(runs / "base" / "step-2", tmp_path / "base")
    shutil.copytree(step, tmp_path / "lora")
    meta["base_checkpoint"]["path"] = str(tmp_path / "base")
    (tmp_path / "lora" / "meta.json").write_text(json.dumps(meta))
    assert torch.equal(
        CheckpointReader(tmp_path / "lora").read("model", "norm.weight"),
        load_full_tensors(runs / "base")["norm.weight"],
    )
    with open(tmp_path / "base" / "index.json", "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match="has changed since"):
        CheckpointReader(tmp_path / "lora")
    shutil.rmtree(tmp_path / "base")
    proc = llamatron("export-hf", str(tmp_path / "lora"), str(tmp_path / "hf"), cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "its base checkpoint" in proc.stderr and "is gone" in proc.stderr, proc.stderr
