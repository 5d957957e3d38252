"""Sample index, splits and blending over indexed datasets."""

import os
import pickle

import numpy as np
import pytest

from llamatron.data.indexed import IndexedDataset, IndexedDatasetWriter
from llamatron.data.samples import (
    BlendedDataset,
    GPTSampleDataset,
    blend_indices,
    build_datasets,
    parse_data_argument,
    split_documents,
)

SEQ_LENGTH = 16


def make_dataset(prefix, num_docs=120, seed=0, first_token=0):
    """Documents of random lengths (some empty) whose tokens are unique, consecutive ids."""
    lengths = np.random.default_rng(seed).integers(0, 40, size=num_docs)
    next_token = first_token
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for length in lengths:
            writer.add_document(np.arange(next_token, next_token + length))
            next_token += length
    return IndexedDataset(prefix)


@pytest.fixture
def indexed(tmp_path):
    return make_dataset(str(tmp_path / "corpus"))


def split_tokens(indexed, documents):
    return np.concatenate([indexed[int(d)] for d in documents]).astype(np.int64)


def test_split_documents():
    train, valid, test = split_documents(1000, "98,2,0")
    assert (train[0], train[-1], valid[0], valid[-1], test.size) == (0, 979, 980, 999, 0)
    parts = split_documents(1001, "949,50,1")
    assert np.array_equal(np.concatenate(parts), np.arange(1001))
    assert [p.size for p in split_documents(10, "1")] == [10, 0, 0]
    assert [p.size for p in split_documents(3, "50/50")] == [1, 2, 0]  # rounding excess comes off train
    for bad in ("a,b", "-1,2", "0,0", "1,2,3,4"):
        with pytest.raises(ValueError, match="split"):
            split_documents(10, bad)


def test_samples_are_windows_of_the_shuffled_stream(indexed):
    documents = np.arange(100)
    dataset = GPTSampleDataset(indexed, documents, SEQ_LENGTH, num_samples=300, seed=1)
    stream = np.concatenate([indexed[int(d)] for d in dataset.doc_order]).astype(np.int64)
    for i in range(len(dataset)):
        sample = dataset[i]
        assert sample.dtype == np.int64 and sample.shape == (SEQ_LENGTH + 1,)
        start = int(dataset.sample_order[i]) * SEQ_LENGTH
        np.testing.assert_array_equal(sample, stream[start : start + SEQ_LENGTH + 1])


def test_deterministic_from_seed(indexed):
    documents = np.arange(100)
    a = GPTSampleDataset(indexed, documents, SEQ_LENGTH, 50, seed=7)
    b = GPTSampleDataset(indexed, documents, SEQ_LENGTH, 50, seed=7)
    c = GPTSampleDataset(indexed, documents, SEQ_LENGTH, 50, seed=8)
    assert all(np.array_equal(a[i], b[i]) for i in range(50))
    assert not all(np.array_equal(a[i], c[i]) for i in range(50))


def test_every_token_of_the_split_is_covered_each_epoch(indexed):
    documents = np.arange(20, 100)  # a split that is not the whole dataset
    tokens = split_tokens(indexed, documents)
    num_samples = 3 * -(-tokens.size // SEQ_LENGTH)
    dataset = GPTSampleDataset(indexed, documents, SEQ_LENGTH, num_samples, seed=3)
    for epoch in range(3):
        # each epoch is one fresh permutation of the split
        assert sorted(dataset.doc_order[epoch * documents.size : (epoch + 1) * documents.size]) == documents.tolist()
        # samples are shuffled within their epoch only: after the samples of
        # epochs 0..e, every token of the split has been seen e+1 times
        samples_so_far = -(-(epoch + 1) * tokens.size // SEQ_LENGTH)
        seen = np.concatenate([dataset[i] for i in range(samples_so_far)])
        counts = np.bincount(seen - tokens.min(), minlength=tokens.max() - tokens.min() + 1)
        assert counts[tokens - tokens.min()].min() >= epoch + 1
    everything = np.concatenate([dataset[i] for i in range(len(dataset))])
    assert set(everything.tolist()) == set(tokens.tolist())  # nothing from outside the split


def test_samples_span_documents(indexed):
    dataset = GPTSampleDataset(indexed, np.arange(100), SEQ_LENGTH, 100, seed=0)
    doc_of_token = np.repeat(np.arange(len(indexed)), indexed.sizes)
    spans = [len(set(doc_of_token[dataset[i]].tolist())) for i in range(len(dataset))]
    assert max(spans) >= 2


def test_tiny_split_needs_many_epochs(indexed):
    documents = np.array([d for d in range(len(indexed)) if indexed.sizes[d] > 0][:2])
    dataset = GPTSampleDataset(indexed, documents, SEQ_LENGTH, 40, seed=0)
    assert len(dataset) == 40 and all(dataset[i].shape == (SEQ_LENGTH + 1,) for i in range(40))


def test_cache_is_written_and_reused(indexed, tmp_path):
    cache = str(tmp_path / "cache")
    first = GPTSampleDataset(indexed, np.arange(100), SEQ_LENGTH, 80, seed=5, cache_dir=cache)
    assert not first.loaded_from_cache
    files = sorted(os.listdir(cache))
    assert len(files) == 3 and all(f.endswith(".npy") for f in files)
    second = GPTSampleDataset(indexed, np.arange(100), SEQ_LENGTH, 80, seed=5, cache_dir=cache)
    assert second.loaded_from_cache
    assert all(np.array_equal(first[i], second[i]) for i in range(80))
    other = GPTSampleDataset(indexed, np.arange(100), SEQ_LENGTH, 80, seed=6, cache_dir=cache)
    assert not other.loaded_from_cache and len(os.listdir(cache)) == 6
    payload = pickle.dumps(second)  # for DataLoader workers: re-mapped, not copied
    assert len(payload) < 5000 and np.array_equal(pickle.loads(payload)[3], second[3])


@pytest.mark.parametrize("num_datasets", [2, 3, 5, 8])
def test_blend_within_one_sample_for_every_prefix(num_datasets):
    rng = np.random.default_rng(num_datasets)
    for _ in range(10):
        weights = rng.random(num_datasets) ** 3 + 1e-3
        shares = weights / weights.sum()
        dataset_index, sample_index = blend_indices(list(weights), 2000, seed=0)
        chosen = np.zeros((2000, num_datasets))
        chosen[np.arange(2000), dataset_index] = 1
        counts = np.cumsum(chosen, axis=0)
        ideal = shares[None, :] * np.arange(1, 2001)[:, None]
        assert np.abs(counts - ideal).max() < 1
        for k in range(num_datasets):  # per-dataset samples are taken in order
            assert np.array_equal(sample_index[dataset_index == k], np.arange(int(counts[-1, k])))


def test_blended_dataset_draws_from_each_source(tmp_path):
    first = make_dataset(str(tmp_path / "a"), seed=1)
    second = make_dataset(str(tmp_path / "b"), seed=2, first_token=10**6)
    a = GPTSampleDataset(first, np.arange(len(first)), SEQ_LENGTH, 40, seed=0)
    b = GPTSampleDataset(second, np.arange(len(second)), SEQ_LENGTH, 40, seed=0)
    blended = BlendedDataset([a, b], [3, 1], num_samples=40, seed=0)
    from_b = sum(int(blended[i][0] >= 10**6) for i in range(40))
    assert from_b == 10
    with pytest.raises(ValueError, match="needs"):
        BlendedDataset([a, b], [1, 3], num_samples=80, seed=0)


def test_parse_data_argument():
    assert parse_data_argument("/data/x_text_document") == [(1.0, "/data/x_text_document")]
    assert parse_data_argument("0.7 a 0.3 b") == [(0.7, "a"), (0.3, "b")]
    for bad in ("0.7 a 0.3", "a b", ""):
        with pytest.raises(ValueError, match="data="):
            parse_data_argument(bad)
    # a weight that is not positive and finite used to drop its dataset from the blend silently
    for weight in ("-1", "0", "nan", "inf"):
        with pytest.raises(ValueError, match=rf"weight {weight} for data/a must be > 0 \(a positive finite number\)"):
            parse_data_argument(f"{weight} data/a 2 data/b")
    with pytest.raises(ValueError, match=r"2 prefixes without weights; .* e\.g\. '1 data/a 1 data/b'"):
        parse_data_argument("data/a data/b")
    with pytest.raises(ValueError, match=r"3 words; expected 'WEIGHT PREFIX' pairs \(a weight or a prefix is missing"):
        parse_data_argument("0.5 data/a 0.5")


def test_build_datasets_single_and_blend(tmp_path):
    make_dataset(str(tmp_path / "a"), seed=1)
    make_dataset(str(tmp_path / "b"), seed=2, first_token=10**6)
    train, valid = build_datasets(str(tmp_path / "a"), "90,10,0", SEQ_LENGTH, 64, 8, seed=1)
    assert len(train) == 64 and len(valid) == 8
    train_tokens = set(np.concatenate([train[i] for i in range(64)]).tolist())
    assert not train_tokens & set(np.concatenate([valid[i] for i in range(8)]).tolist())
    assert isinstance(train, GPTSampleDataset) and train.documents.max() < valid.documents.min()
    assert any(name.endswith(".npy") for name in os.listdir(tmp_path))  # cached next to the data

    blend = f"2 {tmp_path / 'a'} 1 {tmp_path / 'b'}"
    train, valid = build_datasets(blend, "90,10,0", SEQ_LENGTH, 90, 9, seed=1)
    assert isinstance(train, BlendedDataset) and len(train) == 90 and len(valid) == 9
    from_b = sum(int(train[i][0] >= 10**6) for i in range(90))
    assert from_b == 30
    _, no_valid = build_datasets(str(tmp_path / "a"), "100,0,0", SEQ_LENGTH, 8, 8, seed=1)
    assert no_valid is None


# --- Caches and the vocabulary check (issue 8) ---


def test_blend_indices_are_cached(tmp_path):
    first = make_dataset(str(tmp_path / "a"), seed=1)
    second = make_dataset(str(tmp_path / "b"), seed=2, first_token=10**6)
    parts = [GPTSampleDataset(ds, np.arange(len(ds)), SEQ_LENGTH, 40, seed=0) for ds in (first, second)]
    cache = str(tmp_path / "cache")
    built = BlendedDataset(parts, [3, 1], 40, seed=0, cache_dir=cache, names=["a", "b"])
    assert not built.loaded_from_cache and len(os.listdir(cache)) == 2
    again = BlendedDataset(parts, [3, 1], 40, seed=0, cache_dir=cache, names=["a", "b"])
    assert again.loaded_from_cache and np.array_equal(again.dataset_index, built.dataset_index)
    other = BlendedDataset(parts, [1, 1], 40, seed=0, cache_dir=cache, names=["a", "b"])
    assert not other.loaded_from_cache and len(os.listdir(cache)) == 4
    # build_datasets caches the blend next to the first dataset
    build_datasets(f"2 {tmp_path / 'a'} 1 {tmp_path / 'b'}", "100,0,0", SEQ_LENGTH, 30, 0, seed=1)
    assert any(name.startswith("blend_") for name in os.listdir(tmp_path))


def test_vocabulary_check_names_the_file_and_is_cached(tmp_path):
    from llamatron.data.indexed import DataError
    from llamatron.data.samples import check_token_ids, token_id_range

    indexed = make_dataset(str(tmp_path / "big"))  # token ids 0 .. num_tokens-1
    top = indexed.num_tokens - 1
    assert token_id_range(indexed, str(tmp_path)) == (0, top)
    check_token_ids(indexed, top + 1, str(tmp_path))
    with pytest.raises(
        DataError,
        match=rf"big\.bin: holds token id {top}, outside the model's vocabulary of {top}"
        r".*preprocess the data with the model's tokenizer",
    ):
        build_datasets(str(tmp_path / "big"), "90,10,0", SEQ_LENGTH, 8, 8, seed=1, vocab_size=top)
    cached = [n for n in os.listdir(tmp_path) if "token_range" in n]
    assert len(cached) == 1
    # a rewritten .bin is scanned again
    make_dataset(str(tmp_path / "big"), num_docs=10)
    assert token_id_range(IndexedDataset(str(tmp_path / "big")), str(tmp_path))[1] < top


def test_train_refuses_out_of_vocabulary_data_before_training(tmp_path):
    import subprocess
    import sys

    make_dataset(str(tmp_path / "corpus"))  # ids up to ~2400, llama-test has 256
    cmd = [
        sys.executable,
        "-m",
        "llamatron",
        "train",
        "--model",
        "llama-test",
        "--data",
        str(tmp_path / "corpus"),
        "--device",
        "cpu",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--train-steps",
        "1",
        "--no-progress",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "data error:" in done.stderr and "corpus.bin: holds token id" in done.stderr
    assert "outside the model's vocabulary of 256" in done.stderr and "Traceback" not in done.stderr
