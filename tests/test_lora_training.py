"""Training with LoRA (`--lora-rank`): from a base checkpoint with --finetune, only the adapters train (the base
weights are saved bitwise unchanged, optimizer state exists for the adapters alone), a resume continues exactly,
and what LoRA does not run yet is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors.torch
import torch
from test_train import llamatron

from llamatron.adapters.export import export_adapter
from llamatron.adapters.merge import open_base_weights, open_model_weights
from llamatron.adapters.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_dir_problems
from llamatron.adapters.targets import apply_lora, find_targets
from llamatron.checkpoint.reader import CheckpointReader, fingerprint, load_full_tensors, open_weights
from llamatron.errors import CheckpointError
from llamatron.inference.generate import load_for_generation
from llamatron.interop.hf_io import export_hf
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
        # an allocation traceback; the widest of q, v, down: q_proj's 64 x 64 (v_proj 32 rows, down_proj 160 x 64)
        (["--lora-rank", "1000000000000"], "(64 at most in these targets); give --lora-rank 64 or less"),
        (["--lora-rank", "65"], "--lora-rank 65 is above every adapted linear's width"),
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


def _peft_logits(adapter, tokens):
    """What a PEFT user gets from the adapter directory alone: its base_model_name_or_path, loaded by peft."""
    with torch.no_grad():
        return peft.AutoPeftModelForCausalLM.from_pretrained(adapter).eval()(tokens).logits


def test_an_adapter_names_its_base_in_hugging_face_format(runs, tmp_path):
    """No Hugging Face directory of the base yet: adapter_config.json names BASE-step-N-hf beside it and the export
    prints the command that writes it there; run, AutoPeftModelForCausalLM loads the adapter onto it, with
    llamatron's logits. A later export finds it, --base-model names another, and another model's is refused."""
    proc = llamatron("export-hf", str(runs / "a"), str(tmp_path / "adapter"), "--adapter", cwd=tmp_path)
    command = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("llamatron export-hf")]
    hf = tmp_path / "base-step-2-hf"
    want = ["llamatron", "export-hf", str((runs / "base" / "step-2").resolve()), str(hf)]
    assert command == [want], proc.stdout
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf)
    llamatron(*want[1:], cwd=tmp_path)
    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    assert (
        _peft_logits(tmp_path / "adapter", tokens) - _our_lora_logits(runs / "a", tokens)[..., :vocab]
    ).abs().max() < 1e-5
    assert export_adapter(runs / "a", tmp_path / "again")["base"] == str(hf)  # found beside the adapter

    shutil.copytree(hf, tmp_path / "given")
    llamatron("export-hf", str(runs / "a"), str(tmp_path / "b"), "--adapter", "--base-model", "given", cwd=tmp_path)
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "given")
    weights = safetensors.torch.load_file(tmp_path / "given" / "model.safetensors")
    weights["model.norm.weight"] *= 2
    safetensors.torch.save_file(weights, tmp_path / "given" / "model.safetensors", {"format": "pt"})
    for given, problem in (
        (tmp_path / "given", r"another model .*\(norm.weight differs\)"),
        (tmp_path / "b", "no config.json there"),
    ):
        with pytest.raises(CheckpointError, match=f"--base-model {given}: {problem}"):
            export_adapter(runs / "a", tmp_path / "c", given)
    assert not (tmp_path / "c").exists()


def test_an_adapter_of_an_imported_base_names_the_directory_it_came_from(runs, tmp_path):
    export_hf(runs / "base", tmp_path / "hf")
    llamatron("import-hf", str(tmp_path / "hf"), str(tmp_path / "imported"), cwd=tmp_path)
    tuned = ["--load", str(tmp_path / "imported"), "--finetune", "--train-steps", "1", "--save", str(tmp_path / "t")]
    llamatron("train", *RUN, *LORA, *tuned, cwd=tmp_path)
    proc = llamatron("export-hf", str(tmp_path / "t"), str(tmp_path / "adapter"), "--adapter", cwd=tmp_path)
    assert "llamatron export-hf" not in proc.stdout, proc.stdout
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "hf").resolve())
    tokens = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(2))
    assert (_peft_logits(tmp_path / "adapter", tokens) - _our_lora_logits(tmp_path / "t", tokens)).abs().max() < 1e-5


def _edit_meta(step_dir, **changes):
    """meta.json's keys changed (a checkpoint with an index.json: its fingerprint, the index's sha256, stays)."""
    meta = json.loads((step_dir / "meta.json").read_text())
    (step_dir / "meta.json").write_text(json.dumps({**meta, **changes}))


def test_an_adapter_names_the_directory_its_base_was_imported_from_only_for_the_import_itself(runs, tmp_path):
    """A fine-tune of an import carries the import's Hugging Face source in its meta.json, not its weights: the
    adapters of a LoRA run on it are not named after that source (here a copy whose meta says so)."""
    export_hf(runs / "base", tmp_path / "hf")
    shutil.copytree(runs / "base" / "step-2", tmp_path / "tuned" / "step-2")
    shutil.copytree(runs / "a" / "step-6", tmp_path / "lora")
    origin = {"source": str(tmp_path / "hf"), "format": "safetensors"}
    _edit_meta(tmp_path / "tuned" / "step-2", hf=origin)
    base = json.loads((tmp_path / "lora" / "meta.json").read_text())["base_checkpoint"]
    _edit_meta(tmp_path / "lora", hf=origin, base_checkpoint={**base, "path": str(tmp_path / "tuned" / "step-2")})
    summary = export_adapter(tmp_path / "lora", tmp_path / "adapter")
    assert summary["base"] == str(tmp_path / "tuned-step-2-hf") and summary["export_base"], summary
    _edit_meta(tmp_path / "tuned" / "step-2", weights_only=True)  # as an import's says
    assert export_adapter(tmp_path / "lora", tmp_path / "again")["base"] == str(tmp_path / "hf")


def test_without_adapters_exports_the_base_a_lora_checkpoint_was_trained_on(runs, tmp_path):
    """A LoRA run from random weights holds its base itself: --without-adapters writes it (the export of the
    base checkpoint here, which the adapters' checkpoint reads through)."""
    export_hf(runs / "base", tmp_path / "base")
    llamatron("export-hf", str(runs / "a"), str(tmp_path / "frozen"), "--without-adapters", cwd=tmp_path)
    want = safetensors.torch.load_file(tmp_path / "base" / "model.safetensors")
    got = safetensors.torch.load_file(tmp_path / "frozen" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(CheckpointError, match="holds no LoRA adapters; drop --without-adapters"):
        open_base_weights(runs / "base")


def test_an_adapter_config_that_is_no_json_object_is_one_line(tmp_path):
    (tmp_path / ADAPTER_CONFIG).write_text("[1, 2]")
    (tmp_path / ADAPTER_WEIGHTS).write_bytes(b"")
    problems = peft_dir_problems(str(tmp_path), 4, 8.0, [])
    assert problems == [
        f"--lora-init-from {tmp_path}: {ADAPTER_CONFIG} holds a JSON list, not PEFT's object of settings"
    ]


@pytest.mark.parametrize("cycle", [1, 2])
def test_a_base_chain_that_comes_back_is_one_line(runs, tmp_path, cycle):
    """An adapters-only checkpoint whose meta.json names itself as its base (or two naming each other): a
    RecursionError before."""
    copies = [tmp_path / f"lora{i}" for i in range(cycle)]
    for c in copies:
        shutil.copytree(runs / "a" / "step-6", c)
    for c, base in zip(copies, copies[1:] + copies[:1]):
        meta = json.loads((c / "meta.json").read_text())
        meta["base_checkpoint"] = {"path": str(base), "sha256": fingerprint(base)}
        (c / "meta.json").write_text(json.dumps(meta))
    proc = llamatron("export-hf", str(copies[0]), str(tmp_path / "hf"), cwd=tmp_path, check=False)
    err = proc.stderr.strip()
    named = "itself" if cycle == 1 else f"{copies[0]}, closing a cycle of base checkpoints"  # read from copies[1]
    assert proc.returncode == 2 and f"base_checkpoint names {named}" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "hf").exists()
