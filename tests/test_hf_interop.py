"""import-hf, export-hf and verify: exact round trips, every source format, and the fine-tuning path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from hf_fixtures import (
    FAMILIES,
    VOCAB,
    make_hf_model,
    random_tokens,
    rewrite_imported_weights,
    train_with_bpe_tokenizer,
)
from layout import free_port
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llamatron.cli import main as llamatron_main
from llamatron.errors import CheckpointError
from llamatron.inference.generate import load_for_generation
from llamatron.interop.hf import HFConversionError, config_from_hf
from llamatron.training.checkpointing import load_checkpoint

BF16_FAMILIES = {"llama3-rope-scaling", "falcon-7b-layout", "mistral-window"}  # stored and exported as bf16


def run_cli(*args: str) -> int:
    try:
        llamatron_main([str(a) for a in args])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(directory / f)))
    return out


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"})
    )


def save_hf(family: str, directory: Path, dtype: torch.dtype = torch.float32, **kwargs):
    model = make_hf_model(family, dtype=dtype)
    model.save_pretrained(directory, **kwargs)
    write_tokenizer(directory)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_export_round_trip_is_bitwise(family, tmp_path):
    dtype = torch.bfloat16 if family in BF16_FAMILIES else torch.float32
    save_hf(family, tmp_path / "hf", dtype)
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt") == 0
    assert run_cli("export-hf", tmp_path / "ckpt", tmp_path / "out", "--max-shard-size", "40KB") == 0
    original, exported = read_hf_weights(tmp_path / "hf"), read_hf_weights(tmp_path / "out")
    tied = config_from_hf(json.loads((tmp_path / "hf/config.json").read_text())).tie_embeddings
    original.pop("lm_head.weight", None) if tied else None
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype == dtype, name
        assert torch.equal(exported[name], tensor), name
    assert (tmp_path / "out/model.safetensors.index.json").exists()  # 40KB forces several shards
    src, out = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "out"))
    for key in ("model_type", "architectures", "num_attention_heads", "vocab_size", "bos_token_id"):
        assert out.get(key) == src.get(key), key
    assert (tmp_path / "out/tokenizer.json").read_bytes() == (tmp_path / "hf/tokenizer.json").read_bytes()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_verify_passes_on_each_family(family, tmp_path, capsys):
    save_hf(family, tmp_path / "hf")
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt") == 0
    assert run_cli("verify", tmp_path / "ckpt", "--hf", tmp_path / "hf", "--batches", "2", "--seq-length", "40") == 0
    assert "PASS" in capsys.readouterr().out


def test_verify_fails_on_a_corrupted_checkpoint(tmp_path, capsys):
    save_hf("llama2-gqa", tmp_path / "hf")
    run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt")
    weights_file = tmp_path / "ckpt/step-0/model.safetensors"
    state = load_file(str(weights_file))
    qkv = state["layers.1.attn.qkv.weight"]  # swap K and V of the last layer: shapes stay valid
    q, k, v = qkv.split([64, 32, 32])
    state["layers.1.attn.qkv.weight"] = torch.cat([q, v, k])
    save_file(state, str(weights_file))  # changed behind the import's recorded checksum: refused as corrupt
    assert run_cli("verify", tmp_path / "ckpt", "--hf", tmp_path / "hf", "--batches", "2") == 2
    assert "its sha256 differs" in capsys.readouterr().err
    rewrite_imported_weights(weights_file.parent, state)  # a consistent checkpoint of wrong weights
    assert run_cli("verify", tmp_path / "ckpt", "--hf", tmp_path / "hf", "--batches", "2") == 1
    assert "FAIL" in capsys.readouterr().out
    assert run_cli("verify", tmp_path / "ckpt", "--hf", tmp_path / "hf", "--batches", "2", "--dtype", "bf16") == 1


def test_verify_bf16_passes(tmp_path, capsys):
    save_hf("llama3-rope-scaling", tmp_path / "hf", torch.bfloat16)
    run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt")
    assert run_cli("verify", tmp_path / "ckpt", "--hf", tmp_path / "hf", "--dtype", "bf16", "--batches", "2") == 0


@pytest.mark.parametrize("layout", ["bin", "bin-sharded", "safetensors-sharded"])
def test_import_reads_every_weight_format(layout, tmp_path):
    model = save_hf("llama2-gqa", tmp_path / "ref")
    src = tmp_path / layout
    if layout == "safetensors-sharded":
        model.save_pretrained(src, max_shard_size="40KB")
        assert (src / "model.safetensors.index.json").exists()
    else:  # transformers 5 no longer writes .bin: write it as older versions did
        src.mkdir()
        (src / "config.json").write_text((tmp_path / "ref/config.json").read_text())
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if layout == "bin":
            torch.save(state, src / "pytorch_model.bin")
        else:
            names = sorted(state)
            halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
            for fname, part in halves.items():
                torch.save({n: state[n] for n in part}, src / fname)
            weight_map = {n: f for f, part in halves.items() for n in part}
            (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert run_cli("import-hf", tmp_path / "ref", tmp_path / "ck-ref") == 0
    assert run_cli("import-hf", src, tmp_path / "ck") == 0
    want = load_file(str(tmp_path / "ck-ref/step-0/model.safetensors"))
    got = load_file(str(tmp_path / "ck/step-0/model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_export_strips_padded_vocabulary_rows(tmp_path):
    """A checkpoint whose vocabulary was padded (tensor parallelism) exports the real vocabulary only."""
    save_hf("llama2-gqa", tmp_path / "hf")
    run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt")
    step = tmp_path / "ckpt/step-0"
    state = load_file(str(step / "model.safetensors"))
    for name in ("embed.weight", "lm_head.weight"):
        state[name] = torch.cat([state[name], torch.randn(32, state[name].shape[1])])
    rewrite_imported_weights(step, state)
    meta = json.loads((step / "meta.json").read_text())
    meta["model_config"]["vocab_size"] = VOCAB + 32
    (step / "meta.json").write_text(json.dumps(meta))
    assert run_cli("export-hf", tmp_path / "ckpt", tmp_path / "out") == 0
    exported, original = read_hf_weights(tmp_path / "out"), read_hf_weights(tmp_path / "hf")
    assert json.loads((tmp_path / "out/config.json").read_text())["vocab_size"] == VOCAB
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(exported[name], original[name])


def test_other_architecture_fails_with_mismatch_list(tmp_path):
    from llamatron.config.settings import RunConfig
    from llamatron.parallel.mesh import build_mesh
    from llamatron.training.engine import build_engine
    from llamatron.training.validate import validate

    save_hf("llama2-gqa", tmp_path / "hf")
    run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt")
    cfg = RunConfig()
    cfg.train.model, cfg.train.device, cfg.train.precision = "llama-test", "cpu", "fp32"
    cfg.train.micro_batch_size = cfg.train.global_batch_size = 2
    engine = build_engine(cfg, validate(cfg), build_mesh())
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(engine, str(tmp_path / "ckpt"), weights_only=True)
    message = str(err.value)
    assert "embed.weight: checkpoint (96, 64) vs model (256, 64)" in message
    assert "layers.0.mlp.gate_up.weight: checkpoint (192, 64) vs model (320, 64)" in message


def test_unsupported_configs_fail_clearly():
    with pytest.raises(HFConversionError, match="alibi"):
        config_from_hf({"model_type": "falcon", "alibi": True, "hidden_size": 64, "num_attention_heads": 4})
    with pytest.raises(HFConversionError, match="longrope"):
        config_from_hf(
            dict(FAMILIES["llama"][1], model_type="llama", rope_scaling={"rope_type": "longrope", "factor": 2.0})
        )
    yarn = {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.5}
    with pytest.raises(HFConversionError, match="attention_factor"):
        config_from_hf(dict(FAMILIES["llama"][1], model_type="llama", rope_scaling=yarn))
    with pytest.raises(HFConversionError, match="model_type 'gpt2'"):
        config_from_hf({"model_type": "gpt2"})


def test_push_to_hub_arguments(tmp_path, monkeypatch, capsys):
    save_hf("llama", tmp_path / "hf")
    run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt")
    calls = []

    class FakeApi:
        def create_repo(self, **kw):
            calls.append(("create", kw))

        def upload_folder(self, **kw):
            calls.append(("upload", kw))

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(HfApi=FakeApi))
    assert run_cli("export-hf", tmp_path / "ckpt", tmp_path / "out", "--push-to-hub", "me/tiny", "--private") == 0
    assert calls[0] == ("create", {"repo_id": "me/tiny", "private": True, "exist_ok": True})
    assert calls[1][1]["folder_path"] == str(tmp_path / "out") and calls[1][1]["repo_id"] == "me/tiny"
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    assert run_cli("export-hf", tmp_path / "ckpt", tmp_path / "out2", "--push-to-hub", "me/tiny") == 2
    assert "pip install huggingface_hub" in capsys.readouterr().err


def _llamatron(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "llamatron", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def test_fine_tuning_path_from_a_fresh_shell(tmp_path, capsys):
    """save_pretrained -> import-hf -> train 5 steps (--finetune; also under tp=2) -> export-hf -> transformers."""
    import transformers

    hf_model = save_hf("llama2-gqa", tmp_path / "hf")
    proc = _llamatron("import-hf", "hf", "imported", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    train = [
        "train",
        "--load",
        "imported",
        "--mock-data",
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-steps",
        "5",
        "--lr",
        "1e-3",
        "--no-progress",
        "--eval-iters",
        "1",
        "--save",
        "tuned",
    ]
    absolute = [str(tmp_path / a) if a in ("imported", "tuned") else a for a in train]
    assert run_cli(*absolute) == 2  # resuming needs optimizer state, which an import does not have
    assert "weights-only checkpoint: add --finetune" in capsys.readouterr().err
    proc = _llamatron(*train, "--finetune", "--metrics-file", "single.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The same fine-tuning under tensor parallelism, saved from 2 ranks and exported below.
    tp2 = [a if a != "tuned" else "tuned-tp2" for a in train]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "-m",
            "llamatron",
            *tp2,
            "--finetune",
            "--tp",
            "2",
            "--metrics-file",
            "tp2.jsonl",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / f).read_text().splitlines() if "split" not in line]
        for f in ("single.jsonl", "tp2.jsonl")
    ]
    assert len(losses[0]) == 5
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(*losses)), losses
    for ckpt, out in (("tuned", "exported"), ("tuned-tp2", "exported-tp2")):
        proc = _llamatron("export-hf", ckpt, out, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    exported_tp2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported-tp2").eval()
    tuned, meta = load_for_generation(str(tmp_path / "tuned"))
    assert meta["step"] == 5
    tokens = random_tokens(2, 32)
    with torch.no_grad():
        theirs, ours, before = exported(tokens).logits, tuned(tokens), hf_model(tokens).logits
        theirs_tp2 = exported_tp2(tokens).logits
    assert (theirs - ours).abs().max() <= 1e-4
    assert (theirs_tp2 - ours).abs().max() <= 1e-4  # tp=2 training saved, exported and loaded the same model
    assert (theirs - before).abs().max() > 1e-3  # training changed the model
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert tokenizer.convert_tokens_to_ids("t7") == 7
    with safe_open(str(tmp_path / "exported/model.safetensors"), framework="pt") as f:
        assert "model.layers.1.self_attn.k_proj.weight" in f.keys()


@pytest.mark.parametrize("preset", ["llama3-test", "mistral-test", "falcon-test", "falcon40b-test"])
def test_export_of_a_checkpoint_trained_from_scratch(preset, tmp_path, capsys):
    """No Hugging Face config to start from: export builds one (Falcon picks its 7B or 40B layout)."""
    assert (
        run_cli(
            "train",
            "--model",
            preset,
            "--mock-data",
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--seq-length",
            "32",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "2",
            "--train-steps",
            "1",
            "--no-progress",
            "--eval-iters",
            "1",
            "--save",
            tmp_path / "ckpt",
        )
        == 0
    )
    assert run_cli("export-hf", tmp_path / "ckpt", tmp_path / "out") == 0
    config = json.loads((tmp_path / "out/config.json").read_text())
    if preset.startswith("falcon"):
        assert config["new_decoder_architecture"] == (preset == "falcon40b-test")
    assert run_cli("verify", tmp_path / "ckpt", "--hf", tmp_path / "out", "--batches", "1") == 0
    assert "PASS" in capsys.readouterr().out


def test_export_of_a_model_trained_here_carries_its_tokenizers_token_ids(tmp_path):
    """With no imported config.json the bos/eos ids come from the tokenizer: without them transformers falls back
    to its per-family defaults (Llama's eos 2 is an ordinary token of a vocabulary trained here)."""
    import transformers

    ckpt, _ = train_with_bpe_tokenizer(tmp_path)  # <|endoftext|> = 0, no BOS token
    assert run_cli("export-hf", ckpt, tmp_path / "out") == 0
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert config.eos_token_id == generation.eos_token_id == 0
    assert config.bos_token_id is None and generation.bos_token_id is None
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").eos_token_id == 0
    write_tokenizer(tmp_path / "named")  # a tokenizer that names both: --tokenizer's ids are written
    (tmp_path / "named/tokenizer_config.json").write_text(json.dumps({"bos_token": "t5", "eos_token": "t6"}))
    assert run_cli("export-hf", ckpt, tmp_path / "out2", "--tokenizer", tmp_path / "named") == 0
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out2")
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out2")
    assert (config.bos_token_id, config.eos_token_id) == (generation.bos_token_id, generation.eos_token_id) == (5, 6)
    # Imported: the source's ids stay, although this tokenizer names neither token.
    model = make_hf_model("llama")
    model.config.bos_token_id, model.config.eos_token_id = 7, 8
    model.save_pretrained(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf")
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "imported") == 0
    assert run_cli("export-hf", tmp_path / "imported", tmp_path / "out3") == 0
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out3")
    assert (config.bos_token_id, config.eos_token_id) == (7, 8)


def test_export_refuses_a_checkpoint_whose_tokenizer_is_gone(tmp_path, capsys):
    """The checkpoint names its tokenizer by absolute path: once it moved, exporting without it would publish a
    model nobody can tokenize for. Nothing is written; --tokenizer PATH is the fix."""
    ckpt, tok = train_with_bpe_tokenizer(tmp_path)
    tok.rename(tmp_path / "moved-tok")
    capsys.readouterr()
    assert run_cli("export-hf", ckpt, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"checkpoint's tokenizer {tok} (recorded in" in err and "pass --tokenizer PATH" in err
    assert not (tmp_path / "out").exists()
    assert run_cli("export-hf", ckpt, tmp_path / "out", "--tokenizer", tmp_path / "moved-tok") == 0
    assert (tmp_path / "out/tokenizer.json").is_file()


def test_export_without_a_recorded_tokenizer_says_what_to_do(tmp_path, capsys):
    make_hf_model("llama").save_pretrained(tmp_path / "hf")  # no tokenizer files: the import records none
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt") == 0
    assert run_cli("export-hf", tmp_path / "ckpt", tmp_path / "out") == 0
    assert (
        f"tokenizer: none: the checkpoint records no tokenizer, so {tmp_path / 'out'} has no tokenizer files; "
        f"pass --tokenizer PATH to ship one"
    ) in capsys.readouterr().out


def test_export_refuses_a_non_empty_directory(tmp_path, capsys):
    """Another model's config.json and tokenizer files would be overwritten or mixed in: export into a new (or
    empty) directory only."""
    save_hf("llama", tmp_path / "hf")
    run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt")
    (tmp_path / "out").mkdir()
    assert run_cli("export-hf", tmp_path / "ckpt", tmp_path / "out") == 0  # empty: fine
    write_tokenizer(tmp_path / "other")  # another model's files, no weights (those alone used to be refused)
    (tmp_path / "other/config.json").write_text('{"model_type": "gpt2"}')
    for existing in ("other", "out"):  # another model's directory, a redone export
        before = {p.name: p.read_bytes() for p in (tmp_path / existing).iterdir()}
        capsys.readouterr()
        assert run_cli("export-hf", tmp_path / "ckpt", tmp_path / existing) == 2
        assert (
            f"{tmp_path / existing} already exists and is not empty; export into a new directory (or delete "
            f"{tmp_path / existing} first)"
        ) in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in (tmp_path / existing).iterdir()} == before
