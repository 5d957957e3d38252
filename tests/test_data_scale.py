"""The sample index at corpus scale, on a synthetic .idx whose .bin is a sparse file.

The suite runs a 1-billion-token corpus (500k documents); benchmarks/sample_index_bench.py
runs the full 10-billion-token case (5M documents) and prints its time and memory.
"""

import time
import tracemalloc

import numpy as np

from llamatron.data.indexed import IndexedDataset, write_synthetic_index
from llamatron.data.samples import GPTSampleDataset

SEQ_LENGTH = 4096


def test_sample_index_for_a_billion_token_corpus(tmp_path):
    rng = np.random.RandomState(0)
    sizes = np.maximum(1, rng.lognormal(np.log(2000) - 0.5, 1.0, 500_000)).astype(np.int32)
    prefix = str(tmp_path / "corpus")
    write_synthetic_index(prefix, sizes)
    indexed = IndexedDataset(prefix)
    assert indexed.num_tokens > 0.9e9
    num_samples = indexed.num_tokens // SEQ_LENGTH
    documents = np.arange(len(indexed))

    tracemalloc.start()
    start = time.perf_counter()
    dataset = GPTSampleDataset(indexed, documents, SEQ_LENGTH, num_samples, seed=1, cache_dir=str(tmp_path))
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(
        f"\n1B-token sample index: {seconds:.2f} s, peak allocations {peak / 2**20:.0f} MiB, "
        f"index {dataset.index_bytes / 2**20:.0f} MiB"
    )
    assert seconds < 10  # ~0.3 s here; the 10B benchmark takes ~3 s
    # the temporaries stay a small multiple of the index itself (~60 bytes per document)
    assert peak < 100 * len(indexed) and dataset.index_bytes < 50 * len(indexed)

    # every sample starts exactly seq_length tokens after the previous one in the shuffled stream
    doc_starts = np.concatenate([[0], np.cumsum(sizes[dataset.doc_order], dtype=np.int64)])
    starts = doc_starts[dataset.sample_starts[:, 0]] + dataset.sample_starts[:, 1]
    assert np.array_equal(starts, np.arange(starts.size, dtype=np.int64) * SEQ_LENGTH)
    assert (dataset.sample_starts[:, 1] < sizes[dataset.doc_order[dataset.sample_starts[:, 0]]]).all()
    assert np.array_equal(np.sort(dataset.sample_order), np.arange(num_samples))  # one epoch: each sample once
    assert dataset[num_samples - 1].shape == (SEQ_LENGTH + 1,)

    start = time.perf_counter()
    cached = GPTSampleDataset(indexed, documents, SEQ_LENGTH, num_samples, seed=1, cache_dir=str(tmp_path))
    assert cached.loaded_from_cache and time.perf_counter() - start < seconds + 1
    assert isinstance(cached.sample_order, np.memmap)  # mapped, not read into memory
    assert np.array_equal(cached.sample_starts[-100:], dataset.sample_starts[-100:])
