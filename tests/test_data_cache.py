"""Index caches: where they go (--data-cache-path, else beside the data), reuse, and which ones a directory keeps."""

import os
import re

import numpy as np
import pytest

from llamatron import cli
from llamatron.data.cache import KEEP_PER_KIND
from llamatron.data.indexed import IndexedDataset, IndexedDatasetWriter
from llamatron.data.samples import GPTSampleDataset

INDEX_NAMES = {"doc_order", "sample_starts", "sample_order"}


def _corpus(directory, num_docs=60) -> tuple[str, int]:
    """A dataset of `num_docs` documents with ids below llama-test's vocabulary; (prefix, its token count)."""
    directory.mkdir(parents=True, exist_ok=True)
    prefix = str(directory / "corpus")
    lengths = np.random.default_rng(0).integers(5, 40, size=num_docs)
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for length in lengths:
            writer.add_document(np.arange(length) % 200)
    return prefix, int(lengths.sum())


def _train(prefix: str, capsys, *extra: str) -> str:
    argv = ["train", "--model", "llama-test", "--data", prefix, "--device", "cpu", "--no-progress"]
    argv += ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "1"]
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--train-steps", "2", *extra])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _caches(directory) -> set[str]:
    return {n for n in os.listdir(directory) if n.endswith(".npy")}


def test_a_second_run_reuses_the_index_and_other_settings_add_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prefix, tokens = _corpus(tmp_path / "data")
    out = _train(prefix, capsys)
    first = _caches(tmp_path / "data")
    line = next(line for line in out.splitlines() if line.startswith("data "))
    # The data line: the dataset's size, then its split's, then the samples drawn.
    assert f"60 documents, {tokens:,} tokens (train split: " in line and "4 samples of 17 tokens drawn" in line
    assert "built in" in line

    again = _train(prefix, capsys)
    assert _caches(tmp_path / "data") == first and "loaded from cache" in again

    _train(prefix, capsys, "--train-steps", "3")  # more samples: a new train index; the valid one is the same
    added = _caches(tmp_path / "data") - first
    assert _caches(tmp_path / "data") >= first
    entries = {re.fullmatch(r"corpus_train_([0-9a-f]{16})_(\w+)\.npy", n).groups() for n in added}
    assert len({key for key, _ in entries}) == 1 and {name for _, name in entries} == INDEX_NAMES


def test_data_cache_path_takes_the_caches_instead_of_the_data_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prefix, _ = _corpus(tmp_path / "data")
    _train(prefix, capsys, "--data-cache-path", str(tmp_path / "cache"))
    assert sorted(os.listdir(tmp_path / "data")) == ["corpus.bin", "corpus.idx"]
    kinds = {re.fullmatch(r"corpus_([a-z-]+)_[0-9a-f]{16}_\w+\.npy", n)[1] for n in _caches(tmp_path / "cache")}
    assert kinds == {"train", "valid", "token-range"}


def _entries(directory, kind="train") -> set[str]:
    """The keys of the cached indexes of `kind` in `directory`."""
    return {m[1] for n in os.listdir(directory) if (m := re.fullmatch(rf"corpus_{kind}_(\w{{16}})_\w+\.npy", n))}


def test_a_directory_keeps_the_most_recently_used_indexes_of_each_kind(tmp_path):
    prefix, _ = _corpus(tmp_path)
    indexed, cache = IndexedDataset(prefix), str(tmp_path / "cache")
    documents = np.arange(len(indexed))

    def index(seed: int, split: str = "train") -> GPTSampleDataset:
        return GPTSampleDataset(indexed, documents, 16, 8, seed, cache, split)

    keys = []
    for seed in range(KEEP_PER_KIND):
        built = index(seed)
        keys.append(built._cache.key)
        for path in built._cache.paths:  # used long ago, oldest first
            os.utime(path, (1e9 + seed, 1e9 + seed))
    valid = index(0, "valid")._cache.key  # another kind: kept whatever happens to the train indexes
    legacy = tmp_path / "cache" / f"corpus_{'0' * 16}_doc_order.npy"  # the naming before kinds: no run reads it
    legacy.write_bytes(b"")
    left_over = tmp_path / "cache" / f"corpus_train_{'1' * 16}_doc_order.npy.tmp123"  # an interrupted write
    left_over.write_bytes(b"")
    os.utime(left_over, (1e9, 1e9))
    writing = tmp_path / "cache" / f"corpus_train_{'2' * 16}_doc_order.npy.tmp456"  # another run's, being written
    writing.write_bytes(b"")
    assert _entries(cache) == set(keys)

    assert index(1).loaded_from_cache  # a use: now the most recent
    newest = index(KEEP_PER_KIND)._cache.key  # one more than the directory keeps: the least recently used goes
    assert _entries(cache) == set(keys) - {keys[0]} | {newest}
    assert _entries(cache, "valid") == {valid}
    assert not legacy.exists() and not left_over.exists() and writing.exists()

    newer = index(KEEP_PER_KIND + 1)._cache.key
    assert _entries(cache) == set(keys) - {keys[0], keys[2]} | {newest, newer}  # keys[1] was used, keys[2] not
    assert len(os.listdir(cache)) == 3 * KEEP_PER_KIND + 3 + 1  # and the valid entry, and the write in progress
    os.utime(writing, (0, 0))
    index(KEEP_PER_KIND + 2)
    assert not writing.exists()  # once older than STALE_TMP_SECONDS it is a leftover too
    assert len(os.listdir(cache)) == 3 * KEEP_PER_KIND + 3
