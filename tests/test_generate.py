"""`llamatron generate`: its arguments are checked before the model loads; an empty prompt starts from BOS; it
stops at EOS, --stop strings and the chat format's end of turn; --tp 2 under gloo gives the one-process tokens."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from dist_utils import spawn
from hf_fixtures import train_with_bpe_tokenizer
from tokenizers import Tokenizer as RawTokenizer

from llamatron.cli import main
from llamatron.commands import generate
from llamatron.data.tokenizer import load_tokenizer
from llamatron.inference.generate import load_for_generation, sample

PROMPT, NEW = "def f(x):", 24


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
        (["--prompt", "x", "--system", "s"], "--system is a chat message: add --chat"),
        (["--prompt", "x", "--stop", ""], "--stop '': an empty stop string"),
        (["--prompt", "x", "--tp", "2"], "--tp 2 with 1 process(es): generate runs one process per tensor-parallel"),
        # issue 39: a command-line byte that is not UTF-8 arrives as a lone surrogate; it ended in a traceback
        (["--prompt", "def \udcff"], "--prompt holds bytes that are not UTF-8 (character 4); give UTF-8 text"),
        (["--prompt", "x", "--stop", "\udcfe"], "--stop holds bytes that are not UTF-8"),
        # issue 37: the sampling settings, the batch and the context
        (["--prompt", "x", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1] (1: no nucleus cut)"),
        (["--prompt", "x", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
        (["--prompt", "x", "--repetition-penalty", "0"], "--repetition-penalty 0.0: must be > 0 and finite"),
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (["--prompt", "x", "--batch-size", "0"], "--batch-size 0: must be >= 1"),
        (
            ["--prompt", "x", "--max-new-tokens", "200"],
            "--max-new-tokens 200 after a prompt of 1 tokens passes the "
            "model's context of 128 tokens; give at most 127",
        ),  # fmt: skip
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
    real_generate = generate.generate_batch
    monkeypatch.setattr(
        generate,
        "generate_batch",
        lambda model, ids, *a, **k: prompts.extend(ids) or real_generate(model, ids, *a, **k),
    )
    real_sample = generate.sample
    assert run("--load", ckpt, "--tokenizer", with_bos, "--max-new-tokens", "3") == 0
    assert prompts == [[0]]  # <|endoftext|>
    assert run("--load", ckpt, "--prompt", "def", "--max-new-tokens", "3", "--top-k", "1", "--temperature", "0") == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("def")
    with pytest.raises(ValueError, match="prompt_ids is empty"):  # the library function checks too
        real_sample(None, [])
    with pytest.raises(ValueError, match="top_k=0: must be >= 1"):
        real_sample(None, [1], top_k=0)


@pytest.fixture(scope="module")
def reference(trained):
    """The greedy continuation of PROMPT with no stopping rule: (checkpoint, tokenizer dir, its token ids)."""
    ckpt = trained[0]
    tok_dir = ckpt.parent / "tok"
    model, _ = load_for_generation(str(ckpt))
    ids = sample(model, load_tokenizer(str(tok_dir)).encode(PROMPT), NEW, temperature=0)
    assert len(set(ids)) > NEW // 2, ids  # a continuation that depends on its context
    assert 0 not in ids  # <|endoftext|>, the tokenizer's EOS: the command would stop there
    return ckpt, tok_dir, ids


def greedy(*args) -> int:
    return run(*args, "--temperature", "0", "--max-new-tokens", NEW)


def first_word_token(tok, ids: list[int], start: int, tail_new: bool = False) -> int:
    """The first index k >= start whose token is a word (letters and digits) first seen in the text at token k;
    tail_new: of two letters or more, its tail (all but its first letter) first seen there too."""
    for k in range(start, len(ids)):
        word, before = tok.decode(ids[k : k + 1]), tok.decode(ids[:k])
        if word.isalnum() and tok.encode(word) == [ids[k]] and word not in before + word[:-1]:
            if not tail_new or (len(word) > 1 and word[1:] not in before + word[1:-1]):
                return k
    raise AssertionError(f"no word token in {ids}")


def copy_tokenizer(tok_dir: Path, to: Path, **config) -> Path:
    shutil.copytree(tok_dir, to)
    path = to / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return to


def test_stops_at_the_tokenizers_eos(reference, tmp_path, capsys):
    ckpt, tok_dir, ids = reference
    tok = load_tokenizer(str(tok_dir))
    k = first_word_token(tok, ids, 2)
    eos = RawTokenizer.from_file(str(tok_dir / "tokenizer.json")).id_to_token(ids[k])
    assert (
        greedy(
            "--load", ckpt, "--prompt", PROMPT, "--tokenizer", copy_tokenizer(tok_dir, tmp_path / "t", eos_token=eos)
        )
        == 0
    )
    assert capsys.readouterr().out == PROMPT + tok.decode(ids[:k]) + "\n"


def test_stop_strings_end_sampling_and_cut_the_output(reference, monkeypatch, capsys):
    ckpt, tok_dir, ids = reference
    tok = load_tokenizer(str(tok_dir))
    k = first_word_token(tok, ids, 4, tail_new=True)
    stop, text = tok.decode(ids[k : k + 1]), tok.decode(ids)
    lengths = []
    real_generate = generate.generate_batch
    monkeypatch.setattr(
        generate, "generate_batch", lambda *a, **kw: lengths.append(len((out := real_generate(*a, **kw))[0])) or out
    )
    assert greedy("--load", ckpt, "--prompt", PROMPT, "--stop", "never in it", "--stop", stop) == 0
    assert capsys.readouterr().out == PROMPT + text[: text.index(stop)] + "\n"
    assert lengths == [k + 1]  # no token sampled after the one that completed the stop string
    # two strings that both occur, the one given first starting later (the word's tail): cut at the first match
    assert greedy("--load", ckpt, "--prompt", PROMPT, "--stop", stop[1:], "--stop", stop) == 0
    assert capsys.readouterr().out == PROMPT + text[: text.index(stop)] + "\n"


def test_chat_renders_chatml_with_a_generation_prompt(reference, tmp_path, monkeypatch, capsys):
    ckpt, tok_dir, _ = reference
    calls = []
    monkeypatch.setattr(generate, "generate_batch", lambda model, ids, *a, **kw: calls.append((ids[0], kw)) or [[]])
    assert run("--load", ckpt, "--chat", "--system", "be brief", "--prompt", "hi", "--max-new-tokens", 8) == 0
    ids, kwargs = calls[-1]
    tok = load_tokenizer(str(tok_dir))
    assert tok.decode(ids) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # issue 39: ChatML on a tokenizer without its markers was silent; it warns, as preprocess --sft does
    err = capsys.readouterr().err
    assert "has no special tokens for chatml's <|im_start|>, <|im_end|>" in err
    assert kwargs["stop_ids"] == {0} and kwargs["stop"].strings == ["<|im_end|>"]  # several tokens here
    # a tokenizer where <|im_end|> is one token stops at its id
    raw = RawTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    raw.add_special_tokens(["<|im_end|>"])
    shutil.copytree(tok_dir, tmp_path / "t")
    raw.save(str(tmp_path / "t" / "tokenizer.json"))
    assert run("--load", ckpt, "--chat", "--prompt", "hi", "--tokenizer", tmp_path / "t", "--max-new-tokens", 8) == 0
    assert calls[-1][1]["stop_ids"] == {0, raw.token_to_id("<|im_end|>")} and calls[-1][1]["stop"] is None


def test_chat_stops_at_the_templates_end_of_turn(reference, tmp_path, capsys):
    """A chat template whose end of turn is a word the model says: the reply ends before it."""
    pytest.importorskip("transformers")
    ckpt, tok_dir, _ = reference
    tok = load_tokenizer(str(tok_dir))
    model, _ = load_for_generation(str(ckpt))
    ids = sample(model, tok.encode("user: hi\nassistant:"), NEW, temperature=0)  # the template's rendering
    k = first_word_token(tok, ids, 1)
    end = tok.decode(ids[k : k + 1])
    template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% if m['role'] == 'assistant' %}"
        + end
        + "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    chat_tok = copy_tokenizer(tok_dir, tmp_path / "t", chat_template=template)
    assert greedy("--load", ckpt, "--chat", "--prompt", "hi", "--tokenizer", chat_tok) == 0
    assert capsys.readouterr().out == tok.decode(ids[:k]) + "\n"


def _generate_on_rank(rank: int, world: int, argv: list[str], out_dir: Path) -> None:
    """`llamatron generate --tp 2` on this gloo rank; writes what it printed and the shard it held."""
    real_load = generate.load_for_generation
    held = {}

    def load(*args):
        model, meta = real_load(*args)
        attn = model.layers["0"].attn
        held.update(qkv_rows=attn.qkv.weight.shape[0], kv_heads=attn.num_kv_heads)
        return model, meta

    generate.load_for_generation = load
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            main(argv)
        except SystemExit as e:
            assert not e.code, e.code
    (out_dir / f"rank-{rank}.json").write_text(json.dumps({"printed": printed.getvalue(), **held}))


def test_tensor_parallel_generation_matches_one_process(reference, tmp_path, capsys):
    """Two prompts of different lengths decoded together on each rank, with sampling (every rank draws the same
    tokens): the one-process output."""
    ckpt, _, _ = reference
    prompts = ["--prompt", PROMPT, "--prompt", "return x + 1 if x else"]
    flags = ["--temperature", "0.9", "--top-p", "0.9", "--max-new-tokens", str(NEW), "--seed", "5"]
    args = ["generate", "--load", str(ckpt), *prompts, *flags]
    assert run("--load", ckpt, *prompts, *flags) == 0
    single = capsys.readouterr().out
    assert len(single.splitlines()) == 2
    spawn(_generate_on_rank, 2, [*args, "--tp", "2", "--device", "cpu"], tmp_path)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["printed"] == single and ranks[1]["printed"] == ""
    # llama-test: 4 query heads of 16 dims, 2 KV heads; each rank holds 2 query heads and 1 KV head (and its cache)
    assert [(r["qkv_rows"], r["kv_heads"]) for r in ranks] == [((2 + 2 * 1) * 16, 1)] * 2


def test_a_chat_template_that_rejects_the_conversation_is_one_line(reference, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    ckpt, tok_dir, _ = reference
    monkeypatch.setattr(generate, "load_for_generation", lambda *a: pytest.fail("the model was loaded"))
    rejecting = copy_tokenizer(tok_dir, tmp_path / "t", chat_template="{{ raise_exception('no system role here') }}")
    assert run("--load", ckpt, "--chat", "--prompt", "hi", "--tokenizer", rejecting) == 2
    err = capsys.readouterr().err
    assert err.startswith("llamatron generate: data error: --chat with tokenizer") and "no system role here" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], "holds no prompts; give one JSON string per line"),
        (["", "  "], "holds no prompts"),
        (['"ok"', "not json"], 'line 2: not a JSON string or an object with a "prompt" string'),
        (['{"text": "x"}'], "line 1: not a JSON string or an object"),
    ],
)
def test_a_bad_prompts_file_is_one_line(trained, tmp_path, monkeypatch, capsys, lines, message):
    monkeypatch.setattr(generate, "load_for_generation", lambda *a: pytest.fail("the model was loaded"))
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines))
    assert run("--load", trained[0], "--prompts-file", path) == 2
    err = capsys.readouterr().err
    assert err.startswith("llamatron generate: data error: --prompts-file") and message in err
    assert len(err.splitlines()) == 1
    assert run("--load", trained[0], "--prompts-file", tmp_path / "missing.jsonl") == 2
    assert "cannot be read" in capsys.readouterr().err


def test_batched_prompts_print_each_ones_text_as_if_alone(reference, tmp_path, capsys):
    """--prompt (repeated) and --prompts-file decode together, in batches of --batch-size: each result is the
    text of that prompt run alone; the results are JSON lines in order."""
    ckpt = reference[0]
    prompts = [PROMPT, "return x", "def g(y):\n    return", "x"]
    alone = []
    for prompt in prompts:
        assert greedy("--load", ckpt, "--prompt", prompt) == 0
        alone.append(capsys.readouterr().out[len(prompt) : -1])
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": prompts[2]}) + "\n\n" + json.dumps(prompts[3]) + "\n")
    for batch in ("32", "3"):
        assert greedy("--load", ckpt, "--prompt", prompts[0], "--prompt", prompts[1], "--prompts-file", path,
                      "--batch-size", batch) == 0  # fmt: skip
        printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert printed == [{"prompt": p, "text": t} for p, t in zip(prompts, alone)]
    assert len(set(alone)) == len(alone)


def test_an_imported_generation_configs_eos_list_stops(reference, tmp_path, capsys):
    """A checkpoint imported from Hugging Face stops at every id of its generation_config.json's eos_token_id."""
    ckpt, tok_dir, ids = reference
    tok = load_tokenizer(str(tok_dir))
    k = first_word_token(tok, ids, 3)
    imported = tmp_path / "imported"
    shutil.copytree(ckpt, imported)
    step = next(imported.glob("step-*")) if list(imported.glob("step-*")) else imported
    meta = json.loads((step / "meta.json").read_text())
    meta["hf"] = {"config": {"eos_token_id": 1}, "generation_config": {"eos_token_id": [299, ids[k]]}}
    (step / "meta.json").write_text(json.dumps(meta))
    assert greedy("--load", imported, "--prompt", PROMPT) == 0
    assert capsys.readouterr().out == PROMPT + tok.decode(ids[:k]) + "\n"
