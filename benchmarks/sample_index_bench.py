"""Sample-index building at corpus scale, on a synthetic .idx (the .bin is a sparse file).

Builds the GPT sample index of a --tokens-billion corpus of --documents
documents (log-normal lengths), then a two-way blend of it, then scans the
.bin for its largest token id (the vocabulary check train.py runs), and
prints the time and the peak memory that numpy allocated (tracemalloc) for
each, plus the process's peak RSS.

    python benchmarks/sample_index_bench.py --documents 5000000 --tokens-billion 10

Target (issue 8): a 10-billion-token corpus indexes in under a minute.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time
import tracemalloc

import numpy as np

from llamatron.data.indexed import IndexedDataset, write_synthetic_index
from llamatron.data.samples import BlendedDataset, GPTSampleDataset, token_id_range


def measured(label: str, fn, trace: bool = True):
    """Time fn; with trace, also its peak allocations (tracemalloc slows pure-Python loops, so not for those)."""
    if trace:
        tracemalloc.start()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    memory = ""
    if trace:
        memory = f", peak numpy/python allocations {tracemalloc.get_traced_memory()[1] / 2**20:.0f} MiB"
        tracemalloc.stop()
    print(f"RESULT {label}: {seconds:.2f} s{memory}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=5_000_000)
    parser.add_argument("--tokens-billion", type=float, default=10.0)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--epochs", type=float, default=1.0, help="samples requested, in epochs of the corpus")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()

    work_dir = args.work_dir or tempfile.mkdtemp(prefix="sample_index_bench_")
    os.makedirs(work_dir, exist_ok=True)
    rng = np.random.RandomState(0)
    mean = args.tokens_billion * 1e9 / args.documents
    sizes = rng.lognormal(np.log(mean) - 0.5, 1.0, args.documents)
    sizes = np.maximum(1, np.round(sizes * (args.tokens_billion * 1e9 / sizes.sum()))).astype(np.int32)
    prefix = os.path.join(work_dir, "synthetic")
    write_synthetic_index(prefix, sizes)
    indexed = IndexedDataset(prefix)
    num_samples = int(indexed.num_tokens * args.epochs) // args.seq_length
    print(
        f"corpus: {indexed.num_documents} documents, {indexed.num_tokens / 1e9:.2f} B tokens, "
        f".idx {os.path.getsize(prefix + '.idx') / 2**20:.0f} MiB; {num_samples} samples of {args.seq_length}"
    )
    cache = os.path.join(work_dir, "cache")
    docs = np.arange(len(indexed))
    dataset = measured(
        "sample index build",
        lambda: GPTSampleDataset(indexed, docs, args.seq_length, num_samples, seed=1234, cache_dir=cache),
    )
    print(f"  index arrays {dataset.index_bytes / 2**20:.0f} MiB on disk / memory-mapped once cached")
    measured(
        "sample index load from cache",
        lambda: GPTSampleDataset(indexed, docs, args.seq_length, num_samples, seed=1234, cache_dir=cache),
    )
    half = len(indexed) // 2
    parts = [
        GPTSampleDataset(indexed, part, args.seq_length, num_samples, 1234, cache)
        for part in (docs[:half], docs[half:])
    ]
    blend = measured(
        "blend index build (0.7/0.3, all samples)",
        lambda: BlendedDataset(parts, [0.7, 0.3], num_samples, seed=1234, cache_dir=cache, names=["a", "b"]),
        trace=False,
    )
    print(f"  blend arrays {(blend.dataset_index.nbytes + blend.sample_index.nbytes) / 2**20:.0f} MiB")
    measured("token-id scan of the .bin", lambda: token_id_range(indexed, cache))
    print(f"RESULT peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if args.work_dir is None:
        shutil.rmtree(work_dir)


if __name__ == "__main__":
    main()
