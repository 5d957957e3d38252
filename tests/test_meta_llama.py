"""import-hf of Meta's original checkpoints (consolidated.NN.pth + params.json): Llama 2 and Llama 3.1."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from hf_fixtures import FAMILIES, VOCAB, make_random_model, random_tokens, write_meta_consolidated
from safetensors.torch import load_file
from test_hf_interop import run_cli, save_hf, write_tokenizer

from llamatron.inference.generate import load_for_generation

# A Llama 3.1-shaped model, tiny: GQA, rope theta 500000, Meta's 3.1 rope scaling (use_scaled_rope), and an
# FFN width that Meta's rule gives from multiple_of and ffn_dim_multiplier (int(1.3 * 170) = 221 -> 224).
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA31 = dict(
    FAMILIES["llama"][1],
    intermediate_size=224,
    num_key_value_heads=2,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rope_scaling=LLAMA31_SCALING,
)
LLAMA31_PARAMS = {"multiple_of": 32, "ffn_dim_multiplier": 1.3, "rope_theta": 500000.0, "use_scaled_rope": True}


def assert_same_weights(a: Path, b: Path) -> None:
    want, got = (load_file(str(d / "step-0/model.safetensors")) for d in (a, b))
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_import_meta_consolidated_llama2(tmp_path):
    model = save_hf("llama2-gqa", tmp_path / "hf")
    # 2/3 of 4 * 64 = 170, * 0.5 = 85, up to a multiple of 32: the fixture's 96
    write_meta_consolidated(model, tmp_path / "meta", {"multiple_of": 32, "ffn_dim_multiplier": 0.5, "vocab_size": -1})
    write_tokenizer(tmp_path / "meta")
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ck-hf") == 0
    assert run_cli("import-hf", tmp_path / "meta", tmp_path / "ck-meta") == 0
    assert_same_weights(tmp_path / "ck-hf", tmp_path / "ck-meta")
    ours, meta = load_for_generation(str(tmp_path / "ck-meta"))
    assert meta["model_config"]["rope_scaling"] is None
    tokens = random_tokens(2, 24)
    with torch.no_grad():
        assert (ours(tokens) - model(tokens).logits).abs().max() <= 1e-4
    assert (tmp_path / "ck-meta/tokenizer/tokenizer.json").exists()


def test_import_meta_consolidated_llama31_with_scaled_rope(tmp_path):
    import transformers

    model = make_random_model("Llama", LLAMA31)
    model.save_pretrained(tmp_path / "hf")
    write_meta_consolidated(model, tmp_path / "meta", {**LLAMA31_PARAMS, "vocab_size": VOCAB}, embed_split=0)
    assert run_cli("import-hf", tmp_path / "meta", tmp_path / "ck-meta") == 0
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ck-hf") == 0
    assert_same_weights(tmp_path / "ck-hf", tmp_path / "ck-meta")
    ours, meta = load_for_generation(str(tmp_path / "ck-meta"))
    cfg = meta["model_config"]
    llama3 = {
        "kind": "llama3",
        "factor": 8.0,
        "original_max_position": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    assert {k: cfg["rope_scaling"][k] for k in llama3} == llama3  # (yarn's fields at their defaults beside them)
    assert (cfg["rope_theta"], cfg["num_kv_heads"], cfg["ffn_hidden_size"]) == (500000.0, 2, 224)
    # Positions up to 63 turn the scaled frequency band by up to ~0.05 rad: the scaling shows in the logits.
    tokens = random_tokens(2, 64)
    unscaled = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(LLAMA31, rope_scaling=None)))
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        logits, want = ours(tokens), model(tokens).logits
        assert (logits - want).abs().max() <= 1e-4
        assert (unscaled.eval()(tokens).logits - want).abs().max() > 1e-3


@pytest.mark.parametrize(
    "params, message",
    [
        ({**LLAMA31_PARAMS, "ffn_dim_multiplier": 1.5}, "give a feed-forward width of 256, the weights have 224"),
        ({**LLAMA31_PARAMS, "vocab_size": 128256}, "vocab_size=128256, the output layer has 96 rows"),
        ({**LLAMA31_PARAMS, "n_heads": "4"}, 'n_heads must be a positive integer, not "4"'),
        # params.json's own fields, of the wrong type or out of range: each a traceback or accepted before
        ({**LLAMA31_PARAMS, "rope_theta": "500000"}, 'rope_theta must be a positive finite number, not "500000"'),
        ({**LLAMA31_PARAMS, "vocab_size": "96"}, 'vocab_size must be -1 or a positive integer, not "96"'),
        ({**LLAMA31_PARAMS, "max_seq_len": "4096"}, 'max_seq_len must be a positive integer, not "4096"'),
        ({**LLAMA31_PARAMS, "ffn_dim_multiplier": "1.3"}, "ffn_dim_multiplier must be a positive finite number"),
        ({**LLAMA31_PARAMS, "max_seq_len": -1}, "max_seq_len must be a positive integer, not -1"),
        ({**LLAMA31_PARAMS, "norm_eps": -1e-5}, "norm_eps must be a positive finite number, not -1e-05"),
        ({**LLAMA31_PARAMS, "norm_eps": float("nan")}, "norm_eps must be a positive finite number, not NaN"),
        ({**LLAMA31_PARAMS, "rope_theta": float("inf")}, "rope_theta must be a positive finite number"),
        ({**LLAMA31_PARAMS, "use_scaled_rope": "yes"}, 'use_scaled_rope must be true or false, not "yes"'),
        ({**LLAMA31_PARAMS, "multiple_of": 0}, "multiple_of must be a positive integer, not 0"),
        ({**LLAMA31_PARAMS, "n_kv_heads": 3}, "n_heads=4, n_kv_heads=3 do not split into even heads and groups"),
        ({**LLAMA31_PARAMS, "dim": 4 * 17}, "dim=68, n_heads=4"),
    ],
)
def test_meta_params_that_do_not_fit_the_weights_fail_in_one_line(params, message, tmp_path, capsys):
    model = make_random_model("Llama", LLAMA31)
    write_meta_consolidated(model, tmp_path / "meta", params, embed_split=0)
    assert run_cli("import-hf", tmp_path / "meta", tmp_path / "ck") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and str(tmp_path / "meta" / "params.json") in err
    assert not (tmp_path / "ck").exists()


def test_a_broken_tiktoken_tokenizer_beside_meta_weights_is_refused_in_one_line(tmp_path, capsys):
    """Meta's Llama 3 tokenizer.model is a tiktoken vocabulary, read as one (tests/test_llama3_tokenizer.py); one
    that is not whole (single bytes missing) stops the import in one line before anything is written."""
    model = make_random_model("Llama", LLAMA31)
    write_meta_consolidated(model, tmp_path / "meta", {**LLAMA31_PARAMS, "vocab_size": VOCAB}, embed_split=0)
    (tmp_path / "meta/tokenizer.model").write_text("IQ== 0\nIg== 1\nIw== 2\n")  # tiktoken: base64 token, rank
    assert run_cli("import-hf", tmp_path / "meta", tmp_path / "ck") == 2
    err = capsys.readouterr().err.strip()
    assert "tokenizer.model" in err and "\n" not in err, err
    assert not (tmp_path / "ck").exists()
    (tmp_path / "meta/tokenizer.model").unlink()
    write_tokenizer(tmp_path / "meta")  # with a Hugging Face tokenizer.json instead, it imports
    assert run_cli("import-hf", tmp_path / "meta", tmp_path / "ck") == 0
    assert (tmp_path / "ck/tokenizer/tokenizer.json").exists()


def _one_line_refusal(capsys, tmp_path, *parts: str) -> None:
    assert run_cli("import-hf", tmp_path / "meta", tmp_path / "ck") == 2
    err = capsys.readouterr().err.strip()
    assert all(p in err for p in parts) and "\n" not in err, err
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    "text, message",
    [
        (b"{not json", "is not valid JSON"),
        (b"\xff\xfe{}", "is not valid JSON"),
        (b"[1, 2]", "must hold a JSON object, not list"),
        (b"{}", "dim must be a positive integer, not null"),
    ],
)
def test_a_params_json_that_is_not_settings_is_refused_in_one_line(text, message, tmp_path, capsys):
    write_meta_consolidated(make_random_model("Llama", LLAMA31), tmp_path / "meta", LLAMA31_PARAMS, embed_split=0)
    (tmp_path / "meta/params.json").write_bytes(text)
    _one_line_refusal(capsys, tmp_path, "params.json", message)


class _RunsCode:
    """A pickle that would run a shell command when loaded: weights_only must refuse it without running it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_consolidated_files_that_are_not_whole_tensor_dicts_are_refused_in_one_line(tmp_path, capsys):
    write_meta_consolidated(make_random_model("Llama", LLAMA31), tmp_path / "meta", LLAMA31_PARAMS, embed_split=0)
    shard = tmp_path / "meta/consolidated.01.pth"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])  # truncated mid-download
    _one_line_refusal(capsys, tmp_path, "consolidated.01.pth is not a whole file of tensors", "re-download it")
    marker = tmp_path / "ran"
    state = torch.load(io.BytesIO(whole), weights_only=True)
    torch.save({**state, "norm.weight": _RunsCode(marker)}, shard)  # a malicious file: code inside
    _one_line_refusal(capsys, tmp_path, "consolidated.01.pth is not a whole file of tensors")
    assert not marker.exists()  # refused, never run
    torch.save([state], shard)
    _one_line_refusal(capsys, tmp_path, "consolidated.01.pth: expected a state dict of tensors, found list")
    torch.save({**state, "norm.weight": 3}, shard)
    _one_line_refusal(capsys, tmp_path, "expected a state dict of tensors, found other values beside tensors")
    torch.save({**state, "norm.weight": state["norm.weight"][None]}, shard)
    _one_line_refusal(capsys, tmp_path, "norm.weight is not a 1-D tensor in every consolidated.*.pth")
    torch.save({**state, "output.weight": state["output.weight"][:, :-1]}, shard)
    _one_line_refusal(capsys, tmp_path, "slices of output.weight differ in shape")
    shard.write_bytes(whole)
    assert run_cli("import-hf", tmp_path / "meta", tmp_path / "ck") == 0  # the same directory, whole, imports
