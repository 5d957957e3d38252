"""jsonl -> .bin/.idx: contents, bad input, gzip, parallel workers, CLI flags, tokenizers."""

import argparse
import filecmp
import gzip
import io
import json
import os
import re
import sys

import numpy as np
import pytest

from llamatron.commands.preprocess import add_preprocess_arguments, run_preprocess
from llamatron.data.indexed import IndexedDataset
from llamatron.data.preprocess import BadInputError, preprocess
from llamatron.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from llamatron.errors import ConfigError, DataError

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé text, emoji 🦙 and\ttabs.",
    "",
    "llamas and alpacas " * 20,
]
DOCUMENTS = [t for t in TEXTS if t]  # an empty text is a bad record for preprocess (see test_empty_document)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("tokenizer"))
    train_bpe_tokenizer(TEXTS * 3, vocab_size=300, out_dir=out_dir)
    return out_dir


def write_jsonl(path, records, compress=False):
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    opener = gzip.open if compress else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def read_documents(prefix):
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_tokenizer_round_trip_and_eod(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    assert tokenizer.vocab_size == 300
    assert tokenizer.eod_token == "<|endoftext|>"
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.eod_id not in ids  # nothing added behind our back
        assert tokenizer.decode(ids) == text
    same = load_tokenizer(os.path.join(tokenizer_dir, "tokenizer.json"))
    assert same.encode(TEXTS[1]) == tokenizer.encode(TEXTS[1]) and same.eod_id == tokenizer.eod_id


def test_tokenizer_save_and_transformers_compatibility(tokenizer_dir, tmp_path):
    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.save(str(tmp_path / "copy"))
    assert load_tokenizer(str(tmp_path / "copy")).encode(TEXTS[0]) == tokenizer.encode(TEXTS[0])
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "copy"))
    assert hf.eos_token_id == tokenizer.eod_id
    assert hf.encode(TEXTS[0], add_special_tokens=False) == tokenizer.encode(TEXTS[0])


def test_missing_tokenizer_and_sentencepiece_hint(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer.model"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05hello")  # starts as a SentencePiece protobuf does
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # as if it were not installed
    with pytest.raises(ImportError, match="pip install sentencepiece") as e:
        load_tokenizer(str(tmp_path))
    assert isinstance(e.value, ConfigError)  # one line and exit 2 from the command, not a traceback


@pytest.mark.parametrize(
    "content, words",
    [(b"", "(the file is empty)"), (bytes(range(7, 200)), "neither a SentencePiece"), (b"x" * 1_000_000, "neither")],
)
def test_a_tokenizer_model_that_is_neither_format_is_one_line(content, words, tmp_path, monkeypatch):
    """issue 39: an empty, random or one-huge-line tokenizer.model was taken for SentencePiece (an ImportError
    traceback without sentencepiece installed, though sentencepiece could not read it either)."""
    (tmp_path / "tokenizer.model").write_bytes(content)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(DataError, match=re.escape(words)):
        load_tokenizer(str(tmp_path))


def test_sentencepiece_model(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 10),
        model_writer=model,
        vocab_size=320,
        hard_vocab_limit=False,
        minloglevel=2,
        model_type="bpe",
        byte_fallback=True,
    )
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.kind == "sentencepiece" and tokenizer.eod_token == "</s>"
    text = "The quick brown fox, with an emoji 🦙."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and tokenizer.eod_id not in ids
    tokenizer.save(str(tmp_path / "copy"))
    assert load_tokenizer(str(tmp_path / "copy" / "tokenizer.model")).encode(text) == ids


def test_preprocess_contents(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(DOCUMENTS)])
    summary = preprocess([path], str(tmp_path / "out"), tokenizer_dir, progress=False)
    tokenizer = load_tokenizer(tokenizer_dir)
    expected = [tokenizer.encode(t) + [tokenizer.eod_id] for t in DOCUMENTS]
    assert read_documents(str(tmp_path / "out_text_document")) == expected
    assert summary["documents"] == len(DOCUMENTS)
    assert summary["tokens"] == sum(map(len, expected))
    assert summary["bad_lines"] == 0 and summary["seconds"] >= 0
    assert IndexedDataset(str(tmp_path / "out_text_document")).dtype == np.uint16


def test_multiple_keys_and_no_eod(tokenizer_dir, tmp_path):
    records = [{"question": "why?", "answer": "because."}, {"question": "how?", "answer": "so."}]
    path = write_jsonl(tmp_path / "qa.jsonl", records)
    keys = ("question", "answer")
    preprocess(path, str(tmp_path / "qa"), tokenizer_dir, json_keys=keys, append_eod=False, progress=False)
    tokenizer = load_tokenizer(tokenizer_dir)
    for key in ("question", "answer"):
        assert read_documents(str(tmp_path / f"qa_{key}_document")) == [tokenizer.encode(r[key]) for r in records]


def test_bad_line_names_file_and_line(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"text": "also fine"}, '{"text": "broken'])
    with pytest.raises(BadInputError, match=r"bad\.jsonl:3: malformed JSON"):
        preprocess(path, str(tmp_path / "out"), tokenizer_dir, progress=False)
    assert not any(name.startswith("out") for name in os.listdir(tmp_path))  # nothing half-written


def test_missing_key_names_file_and_line(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "nokey.jsonl", [{"text": "fine"}, {"body": "no text key"}])
    with pytest.raises(BadInputError, match=r"nokey\.jsonl:2: missing key 'text'"):
        preprocess(path, str(tmp_path / "out"), tokenizer_dir, progress=False)


def test_skip_bad_lines_counts_them(tokenizer_dir, tmp_path):
    records = [{"text": "one"}, "{oops", {"body": "x"}, {"text": 5}, "[1, 2]", {"text": "two"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    summary = preprocess(path, str(tmp_path / "out"), tokenizer_dir, skip_bad_lines=True, progress=False)
    assert summary["bad_lines"] == 4 and summary["documents"] == 2
    tokenizer = load_tokenizer(tokenizer_dir)
    documents = read_documents(str(tmp_path / "out_text_document"))
    assert [tokenizer.decode(d[:-1]) for d in documents] == ["one", "two"]


def test_gzip_input_matches_plain(tokenizer_dir, tmp_path):
    records = [{"text": t} for t in DOCUMENTS]
    plain = write_jsonl(tmp_path / "a.jsonl", records)
    packed = write_jsonl(tmp_path / "b.jsonl.gz", records, compress=True)
    preprocess(plain, str(tmp_path / "plain"), tokenizer_dir, progress=False)
    summary = preprocess([packed, plain], str(tmp_path / "both"), tokenizer_dir, progress=False)
    assert summary["documents"] == 2 * len(DOCUMENTS)
    once = read_documents(str(tmp_path / "plain_text_document"))
    assert read_documents(str(tmp_path / "both_text_document")) == once + once


def test_two_workers_give_identical_output(tokenizer_dir, tmp_path, monkeypatch):
    import llamatron.data.preprocess as preprocess_module

    monkeypatch.setattr(preprocess_module, "LINES_PER_CHUNK", 7)  # many chunks, to exercise ordering
    records = [{"text": f"{TEXTS[i % len(TEXTS)]} number {i}"} for i in range(500)]
    paths = [write_jsonl(tmp_path / "p1.jsonl", records[:300]), write_jsonl(tmp_path / "p2.jsonl", records[300:])]
    one = preprocess(paths, str(tmp_path / "w1"), tokenizer_dir, workers=1, progress=False)
    two = preprocess(paths, str(tmp_path / "w2"), tokenizer_dir, workers=2, progress=False)
    assert one["documents"] == two["documents"] == 500 and one["tokens"] == two["tokens"]
    for suffix in (".bin", ".idx"):
        one_file, two_file = (str(tmp_path / f"{name}_text_document") + suffix for name in ("w1", "w2"))
        assert filecmp.cmp(one_file, two_file, shallow=False)


def test_bad_line_with_workers(tokenizer_dir, tmp_path):
    records = [{"text": f"line {i}"} for i in range(2000)] + ["not json"] + [{"text": "after"}] * 100
    path = write_jsonl(tmp_path / "big.jsonl", records)
    with pytest.raises(BadInputError, match=r"big\.jsonl:2001:"):
        preprocess(path, str(tmp_path / "out"), tokenizer_dir, workers=2, progress=False)


def test_cli_arguments(tokenizer_dir, tmp_path, capsys):
    path = write_jsonl(tmp_path / "cli.jsonl", [{"text": "hello"}, "bad"])
    parser = add_preprocess_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--input",
            path,
            "--output-prefix",
            str(tmp_path / "cli"),
            "--tokenizer",
            tokenizer_dir,
            "--json-keys",
            "text",
            "--workers",
            "1",
            "--skip-bad-lines",
            "--no-progress",
        ]
    )
    assert args.append_eod is True
    summary = run_preprocess(args)
    assert summary["documents"] == 1 and summary["bad_lines"] == 1
    assert "1 documents" in capsys.readouterr().err
    no_eod = parser.parse_args(["--input", path, "--output-prefix", "p", "--tokenizer", "t", "--no-append-eod"])
    assert no_eod.append_eod is False


def test_missing_input_file(tokenizer_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        preprocess(str(tmp_path / "nope.jsonl"), str(tmp_path / "out"), tokenizer_dir, progress=False)


# --- Input formats, globs, empty documents, summaries (issue 8) ---


def write_zst(path, records):
    zstandard = pytest.importorskip("zstandard")
    data = ("\n".join(json.dumps(r) for r in records) + "\n").encode()
    # a streaming frame (no content size in the header), as `zstd` on a pipe writes
    with open(path, "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as writer:
        writer.write(data)
    return str(path)


def write_parquet(path, records):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), str(path), row_group_size=2)
    return str(path)


def test_zst_and_parquet_inputs_match_jsonl(tokenizer_dir, tmp_path):
    records = [{"text": t, "n": i} for i, t in enumerate(DOCUMENTS)]
    plain = write_jsonl(tmp_path / "a.jsonl", records)
    preprocess(plain, str(tmp_path / "plain"), tokenizer_dir, progress=False)
    expected = read_documents(str(tmp_path / "plain_text_document"))
    for name, path in (
        ("zst", write_zst(tmp_path / "b.jsonl.zst", records)),
        ("parquet", write_parquet(tmp_path / "c.parquet", records)),
    ):
        summary = preprocess(path, str(tmp_path / name), tokenizer_dir, progress=False, workers=2)
        assert summary["documents"] == len(DOCUMENTS) and summary["bytes"] > 0
        assert read_documents(str(tmp_path / f"{name}_text_document")) == expected, name


def test_parquet_bad_row_is_named(tokenizer_dir, tmp_path):
    path = write_parquet(tmp_path / "rows.parquet", [{"text": "fine"}, {"text": None}, {"text": "also fine"}])
    with pytest.raises(BadInputError, match=r"rows\.parquet:row 2: key 'text' is not a string"):
        preprocess(path, str(tmp_path / "out"), tokenizer_dir, progress=False)


def test_globs_and_directories(tokenizer_dir, tmp_path):
    from llamatron.data.readers import expand_inputs

    (tmp_path / "shards").mkdir()
    for i in (2, 0, 1):
        write_jsonl(tmp_path / "shards" / f"part{i}.jsonl", [{"text": f"shard {i} doc {j}"} for j in range(3)])
    (tmp_path / "shards" / "notes.txt").write_text("not input")
    by_glob = expand_inputs(str(tmp_path / "shards" / "part*.jsonl"))
    assert [os.path.basename(p) for p in by_glob] == ["part0.jsonl", "part1.jsonl", "part2.jsonl"]
    assert expand_inputs(str(tmp_path / "shards")) == by_glob
    summary = preprocess(str(tmp_path / "shards" / "*.jsonl"), str(tmp_path / "out"), tokenizer_dir, progress=False)
    assert summary["files"] == 3 and summary["documents"] == 9
    tokenizer = load_tokenizer(tokenizer_dir)
    assert tokenizer.decode(read_documents(str(tmp_path / "out_text_document"))[3][:-1]) == "shard 1 doc 0"
    with pytest.raises(FileNotFoundError, match=r"nothing\*\.jsonl: no file matches"):
        expand_inputs(str(tmp_path / "nothing*.jsonl"))
    with pytest.raises(ValueError, match=r"notes\.txt: unsupported input format"):
        expand_inputs(str(tmp_path / "shards" / "notes.txt"))


def test_missing_optional_packages_are_named(tokenizer_dir, tmp_path, monkeypatch):
    (tmp_path / "x.jsonl.zst").write_bytes(b"")
    (tmp_path / "x.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install zstandard"):
        preprocess(str(tmp_path / "x.jsonl.zst"), str(tmp_path / "out"), tokenizer_dir, progress=False)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        preprocess(str(tmp_path / "x.parquet"), str(tmp_path / "out"), tokenizer_dir, progress=False)


def test_empty_document_is_an_error_or_counted(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "empty.jsonl", [{"text": "one"}, {"text": ""}, {"text": "two"}])
    with pytest.raises(BadInputError, match=r"empty\.jsonl:2: empty document: key 'text' is empty"):
        preprocess(path, str(tmp_path / "out"), tokenizer_dir, progress=False)
    summary = preprocess(path, str(tmp_path / "out"), tokenizer_dir, skip_bad_lines=True, progress=False)
    assert summary["documents"] == 2 and summary["bad_line_kinds"] == {"empty document": 1}
    assert summary["first_bad_line"].endswith("empty.jsonl:2: empty document: key 'text' is empty")


def test_summary_counts_bad_lines_by_kind_and_keys(tokenizer_dir, tmp_path):
    records = [{"q": "a", "r": "b"}, "{broken", {"q": "c"}, {"q": "", "r": "d"}, {"q": "e", "r": "f"}]
    path = write_jsonl(tmp_path / "two.jsonl", records)
    summary = preprocess(
        path, str(tmp_path / "two"), tokenizer_dir, json_keys=("q", "r"), skip_bad_lines=True, progress=False
    )
    assert summary["bad_line_kinds"] == {"malformed JSON": 1, "missing key": 1, "empty document": 1}
    # a line is used whole or not at all, so document i of every output comes from the same record
    outputs = [IndexedDataset(str(tmp_path / f"two_{key}_document")) for key in ("q", "r")]
    assert len(outputs[0]) == len(outputs[1]) == 2
    assert summary["tokens"] == sum(summary["tokens_per_output"].values())
    from llamatron.data.preprocess import format_summary

    text = format_summary(summary)
    assert "3 bad lines skipped (1 malformed JSON, 1 missing key, 1 empty document; first: " in text
    assert "docs/s" in text and "MB/s" in text


def test_command_line_exit_codes(tokenizer_dir, tmp_path):
    import subprocess

    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "hello"}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "hello"}, "{nope"])
    base = [sys.executable, "-m", "llamatron", "preprocess", "--tokenizer", tokenizer_dir, "--no-progress"]
    done = subprocess.run(
        base + ["--input", good, "--output-prefix", str(tmp_path / "g")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "preprocessed 1 documents" in done.stderr
    done = subprocess.run(
        base + ["--input", bad, "--output-prefix", str(tmp_path / "b")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "data error:" in done.stderr and "bad.jsonl:2: malformed JSON" in done.stderr
    assert "Traceback" not in done.stderr


# --- Broken inputs and settings end in a message naming the file or flag, exit 2 (new-user review) ---


def cli(argv, capsys):
    """`llamatron ARGV` in this process: (exit status, stderr)."""
    from llamatron.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


MANY = [{"text": f"document {i}: " + "llamas and alpacas " * 5} for i in range(400)]


def truncated(path):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    return path


@pytest.mark.parametrize("name", ["cut.jsonl.gz", "cut.jsonl.zst"])
def test_truncated_compressed_input_is_an_error_even_when_skipping_bad_lines(name, tokenizer_dir, tmp_path, capsys):
    path = str(tmp_path / name)
    write_zst(path, MANY) if name.endswith(".zst") else write_jsonl(path, MANY, compress=True)
    truncated(path)
    for workers in ("1", "2"):
        code, err = cli(
            [
                "preprocess",
                "--input",
                path,
                "--output-prefix",
                str(tmp_path / "out"),
                "--tokenizer",
                tokenizer_dir,
                "--skip-bad-lines",
                "--workers",
                workers,
                "--no-progress",
            ],
            capsys,
        )
        assert code == 2 and f"data error: {path}: compressed stream ends early (truncated file)" in err, err
    assert not os.path.exists(tmp_path / "out_text_document.idx")  # nothing half-written


def test_zst_of_several_frames_is_read_whole(tokenizer_dir, tmp_path):
    zstandard = pytest.importorskip("zstandard")
    lines = [json.dumps(r).encode() + b"\n" for r in MANY]
    with open(tmp_path / "frames.jsonl.zst", "wb") as f:  # as `cat a.zst b.zst` or pzstd write
        for part in (lines[:150], lines[150:]):
            f.write(zstandard.ZstdCompressor().compress(b"".join(part)))
    summary = preprocess(str(tmp_path / "frames.jsonl.zst"), str(tmp_path / "out"), tokenizer_dir, progress=False)
    assert summary["documents"] == len(MANY)


def test_corrupt_inputs_tokenizers_and_settings_name_the_problem(tokenizer_dir, tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "hello"}])
    parquet = truncated(write_parquet(tmp_path / "cut.parquet", MANY))
    (tmp_path / "garbage.jsonl.gz").write_text("garbage\n")
    (tmp_path / "badtok.json").write_text("garbage\n")
    base = ["preprocess", "--output-prefix", str(tmp_path / "out"), "--no-progress"]
    for flags, message in [
        (["--input", parquet, "--tokenizer", tokenizer_dir], f"data error: {parquet}: not a readable parquet file"),
        (
            ["--input", str(tmp_path / "garbage.jsonl.gz"), "--tokenizer", tokenizer_dir],
            "garbage.jsonl.gz: not a readable .gz file (Not a gzipped file",
        ),
        (
            ["--input", good, "--tokenizer", tokenizer_dir, "--workers", "0"],
            "configuration error: --workers 0: need at least 1 tokenizer process",
        ),
        (
            ["--input", good, "--tokenizer", str(tmp_path / "badtok.json")],
            f"data error: {tmp_path / 'badtok.json'}: not a valid Hugging Face tokenizer.json (expected value",
        ),
    ]:
        code, err = cli(base + flags, capsys)
        assert code == 2 and message in err, (flags, err)
    # train loads the tokenizer the same way (before it opens --data)
    code, err = cli(
        [
            "train",
            "--model",
            "llama-test",
            "--device",
            "cpu",
            "--data",
            str(tmp_path / "none"),
            "--tokenizer",
            str(tmp_path / "badtok.json"),
            "--no-progress",
        ],
        capsys,
    )
    assert code == 2 and "badtok.json: not a valid Hugging Face tokenizer.json" in err, err
    # a directory whose tokenizer_config.json is broken
    load_tokenizer(tokenizer_dir).save(str(tmp_path / "tok"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{oops")
    from llamatron.data.indexed import DataError

    with pytest.raises(DataError, match=r"tokenizer_config\.json: not valid JSON"):
        load_tokenizer(str(tmp_path / "tok"))


def test_no_documents_at_all_is_an_error(tokenizer_dir, tmp_path, capsys):
    path = write_jsonl(tmp_path / "keys.jsonl", [{"text": "a"}, {"content": "b"}, {"text": "c"}])
    code, err = cli(
        [
            "preprocess",
            "--input",
            path,
            "--output-prefix",
            str(tmp_path / "out"),
            "--tokenizer",
            tokenizer_dir,
            "--json-keys",
            "text",
            "content",
            "--skip-bad-lines",
            "--no-progress",
        ],
        capsys,
    )
    assert code == 2 and f"data error: {path}: no usable records, all 3 were skipped (3 missing key; first: " in err
    assert "Check the keys (--json-keys" in err and "preprocessed 0 documents" not in err, err
    assert not os.path.exists(tmp_path / "out_text_document.idx")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(BadInputError, match=r"empty\.jsonl: no records to preprocess \(empty input\)"):
        preprocess(str(tmp_path / "empty.jsonl"), str(tmp_path / "out"), tokenizer_dir, progress=False)


def test_directory_warns_about_subdirectories_and_repeated_files_are_read_once(tokenizer_dir, tmp_path, capsys):
    from llamatron.data.readers import expand_inputs

    (tmp_path / "corpus" / "more" / "deeper").mkdir(parents=True)
    top = write_jsonl(tmp_path / "corpus" / "top.jsonl", [{"text": "top doc"}])
    write_jsonl(tmp_path / "corpus" / "more" / "a.jsonl", [{"text": "nested doc"}])
    write_jsonl(tmp_path / "corpus" / "more" / "deeper" / "b.jsonl", [{"text": "nested doc"}])
    (tmp_path / "corpus" / "more" / "notes.txt").write_text("not input")
    assert expand_inputs(str(tmp_path / "corpus")) == [top]
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / 'corpus'}: 2 input file(s) in its subdirectories are not read" in err
    assert f"'{tmp_path / 'corpus' / '**' / '*.jsonl'}'" in err
    assert len(expand_inputs(str(tmp_path / "corpus" / "**" / "*.jsonl"))) == 3  # the glob the warning suggests
    (tmp_path / "outer" / "inner").mkdir(parents=True)
    write_jsonl(tmp_path / "outer" / "inner" / "c.jsonl", [{"text": "nested doc"}])
    with pytest.raises(
        FileNotFoundError,
        match=r"outer: directory holds no input files .*; 1 input file\(s\) in its "
        r"subdirectories are not read",
    ):
        expand_inputs(str(tmp_path / "outer"))
    # the same file twice (also through a directory or another spelling) is read once, with a warning
    capsys.readouterr()
    summary = preprocess(
        [top, str(tmp_path / "corpus"), str(tmp_path / "corpus" / "." / "top.jsonl")],
        str(tmp_path / "out"),
        tokenizer_dir,
        progress=False,
    )
    assert summary["files"] == 1 and summary["documents"] == 1
    err = capsys.readouterr().err
    assert "warning: 2 input file(s) named more than once are read once: " in err and top in err
