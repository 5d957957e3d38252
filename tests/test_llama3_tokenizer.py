"""Meta's Llama 3 tokenizer.model (tiktoken BPE ranks): load, encode, preprocess, train, generate."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import tiktoken
from hf_fixtures import train_with_tokenizer
from tiktoken_fixtures import TEXTS, write_tiktoken_model

from llamatron.cli import main
from llamatron.data.indexed import IndexedDataset
from llamatron.data.preprocess import preprocess
from llamatron.data.tokenizer import LLAMA3_PATTERN, TiktokenTokenizer, load_tokenizer
from llamatron.errors import DataError

RANKS = 360  # write_tiktoken_model's default vocabulary (before the special tokens)
# Llama 3's special tokens and their ids after the ranks (128000 + offset in Meta's tokenizer.model)
SPECIAL_OFFSETS = {
    "<|begin_of_text|>": 0,
    "<|end_of_text|>": 1,
    "<|reserved_special_token_0|>": 2,
    "<|reserved_special_token_1|>": 3,
    "<|finetune_right_pad_id|>": 4,
    "<|step_id|>": 5,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "<|eom_id|>": 8,
    "<|eot_id|>": 9,
    "<|python_tag|>": 10,
    "<|image|>": 11,
    "<|reserved_special_token_2|>": 12,
    "<|reserved_special_token_245|>": 255,
}
STRINGS = TEXTS + [
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>",
    "I'LL say it's done   \n\n\n  trailing spaces   ",
    "numbers 1234567 and 3.14159, url https://example.com/a?b=c ; spaced , punctuation . isn 't",
    "mixed 中文 русский العربية 🦙🦙🦙 emoji",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama3_tokenizer")
    write_tiktoken_model(directory, RANKS)
    return directory


def test_loads_with_llama3_special_tokens(tok_dir):
    tok = load_tokenizer(str(tok_dir))
    assert isinstance(tok, TiktokenTokenizer) and tok.kind == "tiktoken"
    assert tok.vocab_size == RANKS + 256 and len(tok.special_tokens) == 256
    for text, offset in SPECIAL_OFFSETS.items():
        assert tok.special_tokens[text] == RANKS + offset, text
        assert tok.encode(text) == [RANKS + offset]  # special-token text is the special token, as in transformers
    assert (tok.bos_id, tok.eod_id, tok.eod_token) == (RANKS, RANKS + 1, "<|end_of_text|>")
    same = load_tokenizer(str(tok_dir / "tokenizer.model"))  # the file itself, not its directory
    assert same.encode(STRINGS[0]) == tok.encode(STRINGS[0])


def test_encodes_as_tiktoken_with_llama3s_split_and_round_trips(tok_dir):
    tok = load_tokenizer(str(tok_dir))
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in (tok_dir / "tokenizer.model").open())}
    reference = tiktoken.Encoding("ref", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={})
    for text in STRINGS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        if "<|" not in text:
            assert ids == reference.encode(text)
    assert tok.encode_batch(STRINGS) == [tok.encode(t) for t in STRINGS]
    assert len(tok.encode("hello world")) < len("hello world")  # merges apply
    # tiktoken's regex fails on a whitespace run of ~1M characters: such a text is encoded in pieces
    long = "word " * 1000 + " " * 1_200_000 + "end"
    assert tok.decode(tok.encode(long)) == long


@pytest.mark.parametrize(
    "content, message",
    [
        (b"SGVsbG8= 0\nnot-base64! 1\n", r"tokenizer\.model:2: not a 'base64-token rank' line"),
        (b"".join(base64.b64encode(bytes([b])) + b" %d\n" % (b * 2) for b in range(256)), "not 0..255 once each"),
        (b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(200)), "lacks 56 of the 256 single"),
    ],
)
def test_broken_tiktoken_files_are_named(tmp_path, content, message):
    (tmp_path / "tokenizer.model").write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_tokenizer(str(tmp_path))


def test_preprocess_writes_llama3_token_ids(tok_dir, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in STRINGS if t))
    summary = preprocess([str(path)], str(tmp_path / "out"), str(tok_dir), progress=False)
    tok = load_tokenizer(str(tok_dir))
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset.dtype == np.uint16 and summary["documents"] == len(STRINGS) - 1
    assert [dataset[i].tolist() for i in range(len(dataset))] == [tok.encode(t) + [RANKS + 1] for t in STRINGS if t]


@pytest.fixture(scope="module")
def trained(tok_dir, tmp_path_factory):
    """A checkpoint trained here (one step) that records the tiktoken tokenizer."""
    return train_with_tokenizer(tmp_path_factory.mktemp("llama3_train"), tok_dir, vocab_size=RANKS + 256)


def test_generate_with_the_tiktoken_tokenizer(trained, tok_dir, monkeypatch, capsys):
    from llamatron.commands import generate

    prompts = []
    real_sample = generate.sample
    monkeypatch.setattr(generate, "sample", lambda model, ids, *a: prompts.append(ids) or real_sample(model, ids, *a))
    for prompt in ("The quick <|eot_id|>", ""):  # an empty prompt starts from <|begin_of_text|>
        with pytest.raises(SystemExit) as done:
            main(["generate", "--load", str(trained), "--prompt", prompt, "--max-new-tokens", "3", "--top-k", "1"])
        assert done.value.code == 0
    assert prompts == [load_tokenizer(str(tok_dir)).encode("The quick <|eot_id|>"), [RANKS]]
    assert prompts[0][-1] == RANKS + 9
    assert capsys.readouterr().out.startswith("The quick <|eot_id|>")
