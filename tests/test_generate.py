"""`llamatron generate`: its arguments are checked before the model loads; an empty prompt starts from BOS."""

from __future__ import annotations

import json
import shutil

import pytest
from hf_fixtures import train_with_bpe_tokenizer

from llamatron.cli import main
from llamatron.commands import generate


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint whose tokenizer has no BOS token, and a copy of that tokenizer naming <|endoftext|> as BOS."""
    workdir = tmp_path_factory.mktemp("generate")
    ckpt, tok = train_with_bpe_tokenizer(workdir)
    with_bos = workdir / "tok-with-bos"
    shutil.copytree(tok, with_bos)
    config = json.loads((with_bos / "tokenizer_config.json").read_text())
    (with_bos / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|endoftext|>"}))
    return ckpt, with_bos


def run(*args) -> int:
    try:
        main(["generate", *map(str, args)])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "--prompt is empty and tokenizer"),
        (["--prompt", ""], "has no beginning-of-sequence token to start from; give --prompt TEXT"),
        (["--prompt", "x", "--top-k", "0"], "--top-k 0: must be >= 1"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature -1.0: must be >= 0 (0: greedy)"),
        (["--prompt", "x", "--max-new-tokens", "-5"], "--max-new-tokens -5: must be >= 1"),
    ],
)
def test_bad_arguments_fail_before_the_model_loads(trained, monkeypatch, capsys, args, message):
    monkeypatch.setattr(generate, "load_for_generation", lambda *a: pytest.fail("the model was loaded"))
    assert run("--load", trained[0], *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("llamatron generate: configuration error:") and message in err


def test_empty_prompt_starts_from_bos_and_edge_values_sample(trained, monkeypatch, capsys):
    ckpt, with_bos = trained
    prompts = []
    real_sample = generate.sample
    monkeypatch.setattr(
        generate, "sample", lambda model, ids, *a, **k: prompts.append(ids) or real_sample(model, ids, *a, **k)
    )
    assert run("--load", ckpt, "--tokenizer", with_bos, "--max-new-tokens", "3") == 0
    assert prompts == [[0]]  # <|endoftext|>
    assert run("--load", ckpt, "--prompt", "def", "--max-new-tokens", "3", "--top-k", "1", "--temperature", "0") == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("def")
    with pytest.raises(ValueError, match="prompt_ids is empty"):  # the library function checks too
        real_sample(None, [])
    with pytest.raises(ValueError, match="top_k=0: must be >= 1"):
        real_sample(None, [1], top_k=0)
