"""import-megatron: Megatron-LM checkpoints (legacy layout, tp x pp) give back the model exactly; pickles that
name anything but data are refused unread; bad directories fail in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hf_fixtures import VOCAB, make_random_model, random_tokens
from megatron_fixtures import LLAMA, PADDED, megatron_args, write_megatron
from safetensors.torch import load_file
from test_hf_interop import run_cli

from llamatron.inference.generate import load_for_generation


def hf_llama(**changes):
    return make_random_model("Llama", dict(LLAMA, **changes))


def imported(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "step-0/model.safetensors"))


def reference(model, tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """What import-hf makes of the same transformers model: the weights and model config to match."""
    model.save_pretrained(tmp_path / "hf")
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ck-hf") == 0
    return imported(tmp_path / "ck-hf"), json.loads((tmp_path / "ck-hf/step-0/meta.json").read_text())["model_config"]


def import_megatron(load: Path, save: Path, *flags) -> int:
    return run_cli("import-megatron", "--load", load, "--save", save, *flags)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_tp2_pp2_gqa_checkpoint_imports_exactly(tmp_path, capsys):
    model = hf_llama()
    write_megatron(model, tmp_path / "mg", tp=2, pp=2)
    assert import_megatron(tmp_path / "mg", tmp_path / "ck", "--vocab-size", VOCAB) == 0
    assert "tp 2 x pp 2" in capsys.readouterr().out
    want, want_cfg = reference(model, tmp_path)
    assert_same(imported(tmp_path / "ck"), want)
    ours, meta = load_for_generation(str(tmp_path / "ck"))
    assert {k: v for k, v in meta["model_config"].items() if k != "max_seq_length"} == {
        k: v for k, v in want_cfg.items() if k != "max_seq_length"
    }
    tokens = random_tokens(2, 24)
    with torch.no_grad():
        assert (ours(tokens) - model(tokens).logits).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "flavour, tp, pp, vpp, changes, args",
    [
        ("mcore", 2, 2, 1, {}, {}),  # linear_qkv with fused norms, TransformerEngine's BytesIO state
        (
            "mcore",
            2,
            1,
            1,
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            },
            {"use_rope_scaling": True},
        ),  # fmt: skip
        ("megatron-llm", 2, 2, 1, {}, {}),  # pairs rotary, fc1 [up; gate], lm_head, its enum in args
        ("megatron-llama", 2, 2, 1, {"num_key_value_heads": 4}, {}),  # [q; k; v] per rank, replicated head
        ("legacy", 1, 2, 2, {}, {}),  # virtual pipeline stages: model0, model1
    ],
)
def test_each_megatron_layout_imports_exactly(flavour, tp, pp, vpp, changes, args, tmp_path):
    model = hf_llama(**changes)
    write_megatron(model, tmp_path / "mg", tp=tp, pp=pp, vpp=vpp, flavour=flavour,
                   args=megatron_args(model, tp, pp, flavour, vocab_size=VOCAB, **args))  # fmt: skip
    assert import_megatron(tmp_path / "mg", tmp_path / "ck") == 0
    want, want_cfg = reference(model, tmp_path)
    assert_same(imported(tmp_path / "ck"), want)
    got_cfg = json.loads((tmp_path / "ck/step-0/meta.json").read_text())["model_config"]
    assert got_cfg["rope_scaling"] == want_cfg["rope_scaling"] and got_cfg["num_kv_heads"] == want_cfg["num_kv_heads"]


def test_padding_is_kept_without_a_vocabulary_size_and_the_release_directory_is_read(tmp_path, capsys):
    model = hf_llama()
    iter_dir = write_megatron(model, tmp_path / "mg", tp=2, pp=1)
    iter_dir.rename(tmp_path / "mg/release")
    (tmp_path / "mg/latest_checkpointed_iteration.txt").write_text("release\n")
    assert import_megatron(tmp_path / "mg", tmp_path / "ck") == 0
    assert "every embedding row kept" in capsys.readouterr().out
    embed = imported(tmp_path / "ck")["embed.weight"]
    assert embed.shape == (PADDED, 64) and torch.equal(embed[:VOCAB], model.state_dict()["model.embed_tokens.weight"])


def test_architecture_from_a_config_when_the_checkpoint_stores_no_args(tmp_path, capsys):
    model = hf_llama()
    write_megatron(model, tmp_path / "mg", tp=2, pp=2, args=None)
    assert import_megatron(tmp_path / "mg", tmp_path / "ck0") == 2
    assert "stores no args: give the architecture with --model PRESET or --config FILE" in capsys.readouterr().err
    config = tmp_path / "shape.yaml"
    shape = "{num_layers: 4, ffn_hidden_size: 96, vocab_size: 96, rope_theta: 500000.0}"
    config.write_text(f"model: llama-test\nmodel_overrides: {shape}\n")
    assert import_megatron(tmp_path / "mg", tmp_path / "ck", "--config", config) == 0
    want = reference(model, tmp_path)[0]
    assert_same(imported(tmp_path / "ck"), want)
    flags = ["--model-override", "num_layers=4", "--model-override", "ffn_hidden_size=96"]  # the shape as flags
    flags += ["--model-override", "vocab_size=96", "--model-override", "rope_theta=500000.0"]
    assert import_megatron(tmp_path / "mg", tmp_path / "ck-flags", "--model", "llama-test", *flags) == 0
    assert_same(imported(tmp_path / "ck-flags"), want)


class WritesAMarker:
    """A pickle payload: unpickling it would call os.system (here only creating a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("zip_format", [True, False])
def test_a_pickle_naming_code_is_refused_unrun(zip_format, tmp_path, capsys):
    model = hf_llama()
    iter_dir = write_megatron(model, tmp_path / "mg", tp=1, pp=1)
    marker = tmp_path / "marker"
    shard = iter_dir / "mp_rank_00/model_optim_rng.pt"
    state = {"model": {}, "args": megatron_args(model, 1, 1, "legacy"), "evil": WritesAMarker(marker)}
    torch.save(state, shard, _use_new_zipfile_serialization=zip_format)
    assert import_megatron(tmp_path / "mg", tmp_path / "ck") == 2
    assert not marker.exists()  # nothing of the pickle ran
    err = capsys.readouterr().err.strip()
    assert f"{shard} holds posix.system, which llamatron does not unpickle" in err and "\n" not in err
    assert not (tmp_path / "ck").exists()


def _one_line_error(capsys, *expected: str) -> None:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("llamatron import-megatron: checkpoint error: "), err
    for text in expected:
        assert text in err, err


def test_bad_megatron_directories_fail_in_one_line(tmp_path, capsys):
    model = hf_llama()
    load = tmp_path / "mg"
    iter_dir = write_megatron(model, load, tp=2, pp=2)
    assert import_megatron(load, tmp_path / "ck", "--iteration", "5") == 2
    _one_line_error(capsys, f"{load / 'iter_0000005'} does not exist", "has iter_0001000")
    (load / "latest_checkpointed_iteration.txt").write_text("../../elsewhere")
    assert import_megatron(load, tmp_path / "ck") == 2
    _one_line_error(capsys, "holds '../../elsewhere', not an iteration number or 'release'")
    for text in ("\u0661\u0662\u0663", "\u00b2", "9" * 5000):  # other scripts' digits, '²', too many digits
        (load / "latest_checkpointed_iteration.txt").write_text(text, encoding="utf-8")
        assert import_megatron(load, tmp_path / "ck") == 2
        _one_line_error(capsys, "not an iteration number or 'release'")
    outside = tmp_path / "outside"
    (iter_dir / "mp_rank_01_001").rename(outside)
    (load / "latest_checkpointed_iteration.txt").write_text("1000")
    assert import_megatron(load, tmp_path / "ck") == 2
    _one_line_error(capsys, "has 3 of the 4 shards of tp 2 x pp 2: missing mp_rank_01_001")
    (iter_dir / "mp_rank_01_001").symlink_to(outside)  # a shard that lives outside the checkpoint
    assert import_megatron(load, tmp_path / "ck") == 2
    _one_line_error(capsys, "outside", "refusing to read it")
    assert not (tmp_path / "ck").exists()


def test_shards_that_disagree_with_their_args_fail_in_one_line(tmp_path, capsys):
    model = hf_llama()
    write_megatron(model, tmp_path / "a", tp=2, pp=1, args=megatron_args(model, 4, 1, "legacy"))
    assert import_megatron(tmp_path / "a", tmp_path / "ck") == 2
    _one_line_error(capsys, "tensor_model_parallel_size=4 in the args, but 2 shards on disk")
    write_megatron(model, tmp_path / "b", tp=1, pp=1, args=megatron_args(model, 1, 1, "legacy", swiglu=False))
    assert import_megatron(tmp_path / "b", tmp_path / "ck") == 2
    _one_line_error(capsys, "the MLP is not SwiGLU")
    write_megatron(model, tmp_path / "c", tp=1, pp=1, args=megatron_args(model, 1, 1, "legacy", num_layers=3))
    assert import_megatron(tmp_path / "c", tmp_path / "ck") == 2
    _one_line_error(capsys, "the shards hold 4 layers, the args say num_layers=3")
    assert not (tmp_path / "ck").exists()


def test_args_without_the_sizes_fail_in_one_line(tmp_path, capsys):
    model = hf_llama()
    write_megatron(model, tmp_path / "a", tp=1, pp=1, args=megatron_args(model, 1, 1, "legacy", hidden_size="64x"))
    assert import_megatron(tmp_path / "a", tmp_path / "ck") == 2
    _one_line_error(capsys, "its args do not give the model's sizes")


def test_export_of_an_import_carries_the_tokenizers_ids_not_transformers_defaults(tmp_path):
    from test_hf_interop import write_tokenizer

    model = hf_llama()
    write_megatron(model, tmp_path / "mg", tp=2, pp=1)
    write_tokenizer(tmp_path / "tok")
    config_file = tmp_path / "tok/tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "bos_token": "t1", "eos_token": "t2"}))
    for tokenizer, ck, ids in ((None, "plain", (None, None)), (tmp_path / "tok", "with-tok", (1, 2))):
        flags = ("--tokenizer", tokenizer) if tokenizer else ()
        assert import_megatron(tmp_path / "mg", tmp_path / ck, "--vocab-size", VOCAB, *flags) == 0
        assert run_cli("export-hf", tmp_path / ck, tmp_path / f"{ck}-hf") == 0
        config = json.loads((tmp_path / f"{ck}-hf/config.json").read_text())
        assert (config["bos_token_id"], config["eos_token_id"]) == ids, ck
    assert (tmp_path / "with-tok-hf/tokenizer.json").read_bytes() == (tmp_path / "tok/tokenizer.json").read_bytes()
