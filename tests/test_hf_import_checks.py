"""import-hf's checks of the weights themselves: no NaN or non-float tensor reaches a checkpoint, and a tied config
whose weights hold a head of their own is read as transformers reads it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf_interop import run_cli, save_hf

BROKEN = "model.layers.1.mlp.up_proj.weight"


def _rewrite(hf_dir, **changes) -> None:
    """model.safetensors of `hf_dir` with the tensors of `changes` (name -> tensor) replaced or added."""
    path = str(hf_dir / "model.safetensors")
    state = load_file(path)
    state.update(changes)
    save_file(state, path, metadata={"format": "pt"})


def _nothing_written(out) -> bool:
    return not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(
    "value, dtype, flags, says",
    [
        (float("nan"), torch.float32, (), "holds a NaN or an infinity"),
        (float("inf"), torch.float32, (), "holds a NaN or an infinity"),
        (1e6, torch.float32, ("--dtype", "fp16"), "beyond the range of --dtype fp16"),
        (3, torch.int32, (), "is int32, not a floating-point tensor"),
        (1, torch.bool, (), "is bool, not a floating-point tensor"),
    ],
)
def test_import_refuses_non_finite_and_non_float_weights(value, dtype, flags, says, tmp_path, capsys):
    model = save_hf("llama", tmp_path / "hf")
    weight = model.state_dict()[BROKEN].clone()
    weight[3, 5] = value
    _rewrite(tmp_path / "hf", **{BROKEN: weight.to(dtype)})
    capsys.readouterr()
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and BROKEN in err and says in err, err
    assert _nothing_written(tmp_path / "ckpt")


@pytest.mark.parametrize("family", ["llama-tied-bias", "falcon-7b-layout"])  # tied in config.json (Falcon: by default)
def test_a_distinct_head_beside_a_tied_config_is_loaded_as_transformers_loads_it(family, tmp_path, capsys):
    from llamatron.inference.model_source import load_model
    from llamatron.inference.verify import load_transformers_model

    model = save_hf(family, tmp_path / "hf")
    assert model.config.tie_word_embeddings
    head = torch.randn_like(model.get_output_embeddings().weight)
    _rewrite(tmp_path / "hf", **{"lm_head.weight": head})
    theirs = load_transformers_model(str(tmp_path / "hf"), torch.float32)
    assert torch.equal(theirs.get_output_embeddings().weight, head)  # transformers keeps the file's head
    tokens = torch.randint(0, head.shape[0], (2, 12), generator=torch.Generator().manual_seed(0))
    expected = theirs(tokens).logits
    capsys.readouterr()
    assert run_cli("import-hf", tmp_path / "hf", tmp_path / "ckpt") == 0
    assert "distinct lm_head.weight: read untied" in capsys.readouterr().err
    assert run_cli("verify", tmp_path / "ckpt", "--hf", tmp_path / "hf", "--batches", "2") == 0
    with torch.no_grad():  # eval straight from the directory reads it the same way
        torch.testing.assert_close(load_model(str(tmp_path / "hf"))(tokens), expected, rtol=1e-4, atol=1e-4)
