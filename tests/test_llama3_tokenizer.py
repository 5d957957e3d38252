"""Meta's Llama 3 tokenizer.model (tiktoken BPE ranks): load, encode, preprocess, train, generate, export-hf."""

from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest
import tiktoken
from hf_fixtures import make_hf_model, train_with_tokenizer, write_meta_consolidated
from tiktoken_fixtures import TEXTS, write_tiktoken_model

from llamatron.cli import main
from llamatron.data.indexed import IndexedDataset
from llamatron.data.preprocess import preprocess
from llamatron.data.sft import ChatRenderer
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
    real_generate = generate.generate_batch
    monkeypatch.setattr(
        generate,
        "generate_batch",
        lambda model, ids, *a, **kw: prompts.extend(ids) or real_generate(model, ids, *a, **kw),
    )
    for prompt in ("The quick <|eot_id|>", ""):  # an empty prompt starts from <|begin_of_text|>
        with pytest.raises(SystemExit) as done:
            main(["generate", "--load", str(trained), "--prompt", prompt, "--max-new-tokens", "3", "--top-k", "1"])
        assert done.value.code == 0
    assert prompts == [load_tokenizer(str(tok_dir)).encode("The quick <|eot_id|>"), [RANKS]]
    assert prompts[0][-1] == RANKS + 9
    assert capsys.readouterr().out.startswith("The quick <|eot_id|>")


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """The trained checkpoint exported: the export directory."""
    out = tmp_path_factory.mktemp("llama3_export") / "hf"
    with pytest.raises(SystemExit) as done:
        main(["export-hf", str(trained), str(out)])
    assert done.value.code == 0
    return out


def test_export_hf_writes_a_tokenizer_transformers_loads_with_the_same_ids(tok_dir, exported):
    transformers = pytest.importorskip("transformers")
    hf_dir = exported
    assert not (hf_dir / "tokenizer.model").exists() and (hf_dir / "tokenizer.json").is_file()
    tok = load_tokenizer(str(tok_dir))
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert len(hf) == tok.vocab_size
    assert (hf.bos_token, hf.bos_token_id, hf.eos_token, hf.eos_token_id) == (
        "<|begin_of_text|>",
        RANKS,
        "<|end_of_text|>",
        RANKS + 1,
    )
    for text in STRINGS:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf(text)["input_ids"] == [RANKS] + ids  # BOS first, as Meta's Hugging Face release does
        assert hf.decode(ids) == text
    for text, offset in SPECIAL_OFFSETS.items():
        assert hf.convert_tokens_to_ids(text) == RANKS + offset
    # our own loader reads the export the same way
    assert load_tokenizer(str(hf_dir)).encode(STRINGS[4]) == tok.encode(STRINGS[4])
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    generation = transformers.GenerationConfig.from_pretrained(hf_dir)
    assert (config.bos_token_id, config.eos_token_id) == (RANKS, RANKS + 1)
    assert generation.eos_token_id == [RANKS + 1, RANKS + 9]  # <|end_of_text|>, <|eot_id|>: a chat reply ends


def test_export_hf_chat_template_renders_the_llama3_format(tok_dir, exported):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(exported)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": " Another one? "},
    ]
    ours = ChatRenderer(str(tok_dir))
    assert ours.format == "llama3"
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ours.prompt(messages)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>")
    assert text.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_import_of_a_meta_llama3_directory_exports_the_tokenizers_ids(tok_dir, tmp_path):
    """Meta's params.json has no token ids: the export takes them from the tokenizer.model (else transformers
    would fall back to Llama's 1 and 2, ordinary tokens of Llama 3's vocabulary)."""
    transformers = pytest.importorskip("transformers")
    model = make_hf_model("llama")
    model.resize_token_embeddings(RANKS + 256)
    write_meta_consolidated(model, tmp_path / "meta")
    shutil.copy(tok_dir / "tokenizer.model", tmp_path / "meta")
    for args in (["import-hf", tmp_path / "meta", tmp_path / "ck"], ["export-hf", tmp_path / "ck", tmp_path / "hf"]):
        with pytest.raises(SystemExit) as done:
            main([str(a) for a in args])
        assert done.value.code == 0
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert (config.bos_token_id, config.eos_token_id) == (RANKS, RANKS + 1)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    tok = load_tokenizer(str(tok_dir))
    for text in (STRINGS[2], STRINGS[4]):  # with special tokens too
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)


# Meta's split, as llama-models' Llama 3 tokenizer.py writes it (pat_str), copied here as the independent reference.
META_LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KNOWN_SPLITS = {
    "1234567": ["123", "456", "7"],  # digits in threes, from the left
    "I'm HERE'S": ["I", "'m", " HERE", "'S"],  # contractions of either case
    "hello  world": ["hello", " ", " world"],  # a space joins the word after it; the rest stands alone
    "a\n\n b": ["a", "\n\n", " b"],
    "x += 1;\n": ["x", " +=", " ", "1", ";\n"],  # punctuation takes one leading space and trailing newlines
    "東京2024年": ["東京", "202", "4", "年"],
}


def test_the_split_is_metas_literal_pattern_and_splits_known_texts_as_meta_does(tok_dir):
    """issue 39: the tests built their reference from the module's own pattern, so a changed pattern passed."""
    import regex

    assert LLAMA3_PATTERN == META_LLAMA3_PAT_STR
    for text, pieces in KNOWN_SPLITS.items():
        assert regex.findall(META_LLAMA3_PAT_STR, text) == pieces, text
    tok = load_tokenizer(str(tok_dir))
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in (tok_dir / "tokenizer.model").open())}
    meta = tiktoken.Encoding("meta", pat_str=META_LLAMA3_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    for text in [*KNOWN_SPLITS, *(t for t in STRINGS if "<|" not in t)]:
        assert tok.encode(text) == meta.encode(text), text
