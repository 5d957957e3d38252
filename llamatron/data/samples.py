"""GPT pre-training samples over an indexed dataset: splits, sample index, blending.

A sample is ``seq_length + 1`` consecutive tokens (inputs and shifted labels)
of a stream made by concatenating the split's documents, shuffled anew each
epoch. Samples cross document boundaries, and consecutive samples share one
token, so every token of an epoch is trained on. Everything is a pure function
of (documents, sizes, seq_length, num_samples, seed): each rank can build or
load the same index independently.

As in Megatron, a "document" here is one sequence of the indexed dataset
(``indexed.sizes``), which is what ``preprocess`` writes per JSON line.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

import numpy as np

from llamatron.data.cache import ArrayCache, cache_key, file_signature
from llamatron.data.indexed import IndexedDataset, data_path, index_path
from llamatron.errors import DataError


def split_documents(num_docs: int, split: str = "98,2,0") -> list[np.ndarray]:
    """Contiguous train/valid/test document ranges from weights like ``"98,2,0"``.

    Each part gets round(weight / total * num_docs) documents; any rounding
    excess or shortfall is taken from the train part, as Megatron does.
    """
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError as err:
        raise ValueError(f"split={split!r}: expected comma-separated numbers like '98,2,0'") from err
    # `not w >= 0` also refuses NaN, which no comparison would catch.
    if not 1 <= len(weights) <= 3 or any(not 0 <= w < math.inf for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"split={split!r}: need 1 to 3 finite non-negative weights with a positive sum, "
            "like '98,2,0' (train, valid, test)"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight / total * num_docs)))
    excess = bounds[-1] - num_docs
    bounds = [0] + [min(max(b - excess, 0), num_docs) for b in bounds[1:]]
    return [np.arange(bounds[i], bounds[i + 1], dtype=np.int64) for i in range(3)]


def build_sample_index(
    sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The three arrays that define the samples, and the number of epochs used.

    - ``doc_order[k]``: the k-th document of the stream (epochs concatenated,
      each a fresh permutation of ``documents``).
    - ``sample_starts[s] = (k, offset)``: sample s (in stream order) starts at
      token ``offset`` of ``doc_order[k]``; it ends, inclusively, where sample
      s+1 starts.
    - ``sample_order[i]``: which stream sample is sample i. Samples are shuffled
      within their epoch only, so each epoch is seen whole before the next.
    """
    if seq_length < 1 or num_samples < 0:
        raise ValueError(f"need seq_length >= 1 and num_samples >= 0, got {seq_length} and {num_samples}")
    documents = np.asarray(documents, dtype=np.int64)
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError(f"the split has no tokens ({documents.size} documents); cannot build {num_samples} samples")
    # Smallest epoch count whose stream holds num_samples samples plus the final label token.
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    rng = np.random.RandomState(seed)  # RandomState streams are frozen across numpy versions
    doc_order = np.concatenate([rng.permutation(documents) for _ in range(num_epochs)])

    doc_ends = np.cumsum(sizes[doc_order], dtype=np.int64)
    doc_starts = doc_ends - sizes[doc_order]
    num_stream_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    positions = np.arange(num_stream_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents: a position lands in the document holding it.
    doc_positions = np.searchsorted(doc_ends, positions, side="right")
    sample_starts = np.stack([doc_positions, positions - doc_starts[doc_positions]], axis=1)

    # Epoch e owns the samples that start inside it: indices [ceil(e*T/L), ceil((e+1)*T/L)).
    epoch_bounds = [min(-(-e * tokens_per_epoch // seq_length), num_stream_samples) for e in range(num_epochs + 1)]
    sample_order = np.concatenate(
        [rng.permutation(np.arange(lo, hi, dtype=np.int64)) for lo, hi in zip(epoch_bounds, epoch_bounds[1:])]
    )[:num_samples]
    return doc_order, sample_starts, sample_order, num_epochs


class GPTSampleDataset:
    """Samples of ``seq_length + 1`` tokens (int64) over ``documents`` of ``indexed``.

    With ``cache_dir`` set, the index arrays are saved there as .npy files
    named by the split and a hash of everything they depend on, and loaded
    (memory-mapped) when present instead of being rebuilt (cache.py: which
    entries a directory keeps). ``build_seconds`` and ``index_bytes`` tell what
    building (or loading) the index cost.
    """

    CACHE_NAMES = ("doc_order", "sample_starts", "sample_order")

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        seq_length: int,
        num_samples: int,
        seed: int,
        cache_dir: str | None = None,
        split_name: str = "train",
    ) -> None:
        self.indexed = indexed
        self.split_name = split_name
        self.documents = np.asarray(documents, dtype=np.int64)
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = seed
        if self.documents.size and (self.documents.min() < 0 or self.documents.max() >= len(indexed)):
            raise ValueError(f"document ids out of range for {len(indexed)} sequences in {indexed.prefix}")
        start = time.perf_counter()
        self._cache = self._make_cache(cache_dir)
        self.loaded_from_cache = self._index_arrays()
        self.build_seconds = time.perf_counter() - start
        self.index_bytes = sum(a.nbytes for a in (self.doc_order, self.sample_starts, self.sample_order))

    def _index_arrays(self) -> bool:
        """Load the index from the cache, or build (and cache) it; True when it was loaded."""
        arrays, loaded = self._cache.get_or_build(
            lambda: build_sample_index(
                self.indexed.sizes, self.documents, self.seq_length, self.num_samples, self.seed
            )[:3]
        )
        self.doc_order, self.sample_starts, self.sample_order = arrays
        return loaded

    def describe(self) -> str:
        """The data line a run prints: the dataset's size, its split's, and the samples drawn from it."""
        origin = "loaded from cache" if self.loaded_from_cache else f"built in {self.build_seconds:.1f}s"
        split_tokens = int(self.indexed.sizes[self.documents].sum(dtype=np.int64))
        epochs = self.num_samples * self.seq_length / max(split_tokens, 1)
        return (
            f"data {self.indexed.prefix}: {len(self.indexed):,} documents, {self.indexed.num_tokens:,} tokens "
            f"({self.split_name} split: {self.documents.size:,} documents, {split_tokens:,} tokens); "
            f"{self.num_samples:,} samples of {self.seq_length + 1} tokens drawn, {epochs:.3g} epochs; "
            f"sample index {self.index_bytes / 2**20:.1f} MiB, {origin}"
        )

    def _make_cache(self, cache_dir: str | None) -> ArrayCache:
        if cache_dir is None:
            return ArrayCache(None, "", "", "", self.CACHE_NAMES)
        key = cache_key(
            "gpt",
            self.seq_length,
            self.num_samples,
            self.seed,
            len(self.indexed),
            self.documents,
            np.asarray(self.indexed.sizes[self.documents]),
        )
        return ArrayCache(cache_dir, os.path.basename(self.indexed.prefix), self.split_name, key, self.CACHE_NAMES)

    def _cached_on_disk(self) -> bool:
        return bool(self._cache.paths) and all(os.path.isfile(p) for p in self._cache.paths)

    # When the index is cached, pickles (DataLoader workers) re-map the files
    # instead of carrying copies of arrays that can reach gigabytes.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._cached_on_disk():
            for name in self.CACHE_NAMES:
                state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if not hasattr(self, "doc_order"):
            self._index_arrays()  # rebuilt, the same, if the entry has been removed since (cache.py)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        stream_index = int(self.sample_order[index])
        first_doc, first_offset = (int(v) for v in self.sample_starts[stream_index])
        last_doc, last_offset = (int(v) for v in self.sample_starts[stream_index + 1])
        get = self.indexed.get
        if first_doc == last_doc:
            pieces = [get(int(self.doc_order[first_doc]), first_offset, last_offset - first_offset + 1)]
        else:
            pieces = [get(int(self.doc_order[first_doc]), first_offset)]
            pieces += [get(int(self.doc_order[k])) for k in range(first_doc + 1, last_doc)]
            pieces.append(get(int(self.doc_order[last_doc]), 0, last_offset + 1))
        return np.concatenate(pieces).astype(np.int64)


def blend_indices(weights: Sequence[float], num_samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample: which dataset, and which sample of that dataset.

    Every prefix of n samples holds ``share * n`` samples of each dataset to
    within ``1 - 1/(2K-2)`` (K datasets), so always within one sample. The
    plain "largest deficit ``share * (n + 1) - count``" greedy (Megatron's)
    misses that bound for four or more datasets, undershooting a small
    dataset by more than one; this uses Tijdeman's rule for the chairman
    assignment problem instead: the m-th sample of dataset k may be placed
    once ``share * n >= m - bound`` and is due when ``share * n`` reaches
    ``m - 1 + bound``; each step places the earliest-due placeable one.
    ``seed`` only orders datasets for breaking exact ties.
    """
    total = float(sum(weights))
    if not weights or any(w < 0 for w in weights) or total <= 0:
        raise ValueError(f"blend weights {list(weights)} must be non-negative with a positive sum")
    shares = [w / total for w in weights]
    bound = 1.0 - 1.0 / (2 * len(shares) - 2) if len(shares) > 1 else 0.0
    tie_order = [int(k) for k in np.random.RandomState(seed).permutation(len(shares)) if shares[k] > 0]
    counts = [0] * len(shares)
    dataset_index = np.empty(num_samples, dtype=np.int64)
    sample_index = np.empty(num_samples, dtype=np.int64)
    # A plain Python loop: each step depends on the last, and lists beat numpy for a few datasets.
    for n in range(1, num_samples + 1):
        best, best_due = -1, float("inf")
        for k in tie_order:
            if counts[k] + 1 - bound <= shares[k] * n + 1e-9:
                due = (counts[k] + bound) / shares[k]
                if due < best_due:
                    best, best_due = k, due
        if best < 0:  # cannot happen by Tijdeman's theorem; guard against rounding
            best = max(tie_order, key=lambda k: shares[k] * n - counts[k])
        dataset_index[n - 1] = best
        sample_index[n - 1] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """Samples drawn from several datasets in proportion to ``weights``.

    With ``cache_dir`` the blend indices are cached like a sample index (the
    construction is a sequential loop, seconds for tens of millions of samples).
    """

    CACHE_NAMES = ("dataset_index", "sample_index")

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        num_samples: int,
        seed: int,
        cache_dir: str | None = None,
        names: Sequence[str] | None = None,
        split_name: str = "train",
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = [float(w) / sum(weights) for w in weights]
        self.num_samples = num_samples
        key = cache_key("blend", [float(w) for w in weights], num_samples, seed, list(names or []))
        cache = ArrayCache(cache_dir, "blend", split_name, key, self.CACHE_NAMES)
        (self.dataset_index, self.sample_index), self.loaded_from_cache = cache.get_or_build(
            lambda: blend_indices(weights, num_samples, seed)
        )
        needed = np.bincount(self.dataset_index, minlength=len(datasets))
        for k, (dataset, count) in enumerate(zip(self.datasets, needed)):
            if len(dataset) < count:
                raise ValueError(f"blended dataset {k} has {len(dataset)} samples but the blend needs {count}")

    def describe(self) -> str:
        parts = "\n".join(
            f"  {w:.3f} x {d.describe() if hasattr(d, 'describe') else d}" for w, d in zip(self.weights, self.datasets)
        )
        return f"blend of {len(self.datasets)} datasets, {self.num_samples} samples:\n{parts}"

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        return self.datasets[int(self.dataset_index[index])][int(self.sample_index[index])]


def token_id_range(indexed: IndexedDataset, cache_dir: str | None = None) -> tuple[int, int]:
    """(smallest, largest) token id of a dataset's .bin, cached by the files' size and mtime."""
    files = (data_path(indexed.prefix), index_path(indexed.prefix))
    key = cache_key("token_range", *(part for path in files for part in file_signature(path)))
    cache = ArrayCache(cache_dir, os.path.basename(indexed.prefix), "token-range", key, ("token_range",))
    (limits,), _ = cache.get_or_build(lambda: [np.array(indexed.token_id_range(), dtype=np.int64)])
    return int(limits[0]), int(limits[1])


def check_token_ids(indexed: IndexedDataset, vocab_size: int, cache_dir: str | None = None) -> None:
    """Raise DataError, naming the file and the fix, if the tokens are no integers (Megatron's format also has
    float dtypes) or a token id lies outside [0, vocab_size)."""
    if indexed.dtype.kind not in "iu":  # 1.5 would train as token 1, NaN would not convert at all
        raise DataError(
            f"{index_path(indexed.prefix)}: its tokens are {indexed.dtype} values, not integer token ids; "
            "this is not a token dataset: preprocess the text with `llamatron preprocess`"
        )
    low, high = token_id_range(indexed, cache_dir)
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise DataError(
            f"{data_path(indexed.prefix)}: holds token id {bad}, outside the model's vocabulary of {vocab_size} "
            f"ids (tokens span [{low}, {high}]); preprocess the data with the model's tokenizer, or choose a "
            f"model (or model_overrides: vocab_size) whose vocabulary covers {high + 1} ids"
        )


def check_mask_values(mask: IndexedDataset, written_by: str, cache_dir: str | None = None) -> None:
    """Raise DataError, naming the file, if a loss mask holds values other than 0 and 1 (token ids, say: any
    non-zero value would train silently as 1). written_by: the command that writes such masks."""
    low, high = token_id_range(mask, cache_dir) if mask.dtype.kind in "iu" else (0, 2)
    if mask.dtype.kind not in "iu" or low < 0 or high > 1:
        held = f"{mask.dtype} values" if mask.dtype.kind not in "iu" else f"the value {high if high > 1 else low}"
        raise DataError(
            f"{data_path(mask.prefix)}: a loss mask holds only 0 and 1, but this file holds {held} (is it token "
            f"ids?); write the mask with {written_by} again"
        )


def parse_data_argument(data: str) -> list[tuple[float, str]]:
    """``"PREFIX"`` or ``"W1 P1 W2 P2 ..."`` -> [(weight, prefix), ...]; ValueError saying what is wrong."""
    words = data.split()
    if len(words) == 1:
        return [(1.0, words[0])]
    if not words:
        raise ValueError(f"data={data!r}: empty; give a dataset prefix, or 'WEIGHT PREFIX' pairs to blend")
    if not any(_is_number(w) for w in words):  # Megatron users list prefixes alone
        raise ValueError(
            f"data={data!r}: {len(words)} prefixes without weights; to blend them give each a "
            f"weight, e.g. '{' '.join(f'1 {w}' for w in words)}'"
        )
    if len(words) % 2:
        raise ValueError(
            f"data={data!r}: {len(words)} words; expected 'WEIGHT PREFIX' pairs (a weight or a prefix "
            "is missing), e.g. '0.7 data/a_text_document 0.3 data/b_text_document'"
        )
    pairs = []
    for weight, prefix in zip(words[::2], words[1::2]):
        if not _is_number(weight):
            raise ValueError(f"data={data!r}: {weight!r} is not a weight; expected 'WEIGHT PREFIX' pairs")
        value = float(weight)
        if not 0 < value < math.inf:  # a weight <= 0 or NaN would silently drop the dataset from the blend
            raise ValueError(f"data={data!r}: weight {weight} for {prefix} must be > 0 (a positive finite number)")
        pairs.append((value, prefix))
    return pairs


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def index_cache_dir(prefix: str, cache_path: str | None) -> str:
    """Where a dataset's index caches go: --data-cache-path, else beside the data."""
    return cache_path if cache_path is not None else os.path.dirname(os.path.abspath(prefix))


def _build_split(
    sources: list[tuple[float, IndexedDataset, np.ndarray]],
    split_name: str,
    seq_length: int,
    num_samples: int,
    seed: int,
    cache_path: str | None,
) -> GPTSampleDataset | BlendedDataset | None:
    sources = [(w, ds, docs) for w, ds, docs in sources if docs.size and w > 0 and ds.sizes[docs].sum() > 0]
    if not sources or num_samples <= 0:
        return None

    def one(indexed: IndexedDataset, docs: np.ndarray, count: int) -> GPTSampleDataset:
        cache_dir = index_cache_dir(indexed.prefix, cache_path)
        return GPTSampleDataset(indexed, docs, seq_length, count, seed, cache_dir, split_name)

    if len(sources) == 1:
        return one(sources[0][1], sources[0][2], num_samples)
    total = sum(w for w, _, _ in sources)
    # The blend never gives a dataset more than floor(share * n) + 1 samples.
    datasets = [one(ds, docs, int(w / total * num_samples) + 1) for w, ds, docs in sources]
    # Named by each part's own cache key: the blend changes whenever a part does.
    names = [os.path.basename(d._cache.paths[0]) if d._cache.paths else d.indexed.prefix for d in datasets]
    weights = [w for w, _, _ in sources]
    cache_dir = index_cache_dir(sources[0][1].prefix, cache_path)
    return BlendedDataset(datasets, weights, num_samples, seed, cache_dir, names, split_name)


def build_datasets(
    data: str,
    split: str,
    seq_length: int,
    train_samples: int,
    valid_samples: int,
    seed: int,
    vocab_size: int | None = None,
    cache_path: str | None = None,
) -> tuple[GPTSampleDataset | BlendedDataset, GPTSampleDataset | BlendedDataset | None]:
    """Train and validation datasets for ``--data`` (one prefix, or weighted pairs to blend).

    Every prefix is split into contiguous train/valid/test document ranges by
    ``split``; the valid dataset is None when no source has validation data.
    With ``vocab_size``, every .bin is checked to hold only ids below it.
    Index caches go to ``cache_path`` (--data-cache-path), else beside each dataset.
    """
    sources = []
    for weight, prefix in parse_data_argument(data):
        indexed = IndexedDataset(prefix)
        if vocab_size is not None:
            check_token_ids(indexed, vocab_size, index_cache_dir(prefix, cache_path))
        train_docs, valid_docs, _ = split_documents(len(indexed), split)
        sources.append((weight, indexed, train_docs, valid_docs))
    train = _build_split([(w, ds, t) for w, ds, t, _ in sources], "train", seq_length, train_samples, seed, cache_path)
    if train is None:
        raise DataError(f"data={data!r} split={split!r}: the train split has no tokens (or train_samples=0)")
    valid = _build_split([(w, ds, v) for w, ds, _, v in sources], "valid", seq_length, valid_samples, seed, cache_path)
    return train, valid


def data_settings_problems(
    data: str | None,
    split: str,
    mock_data: bool = False,
    sft_data: str | None = None,
    tokenizer: str | None = None,
    document_flags: Sequence[str] = (),
) -> list[str]:
    """What is wrong with the data flags (training/validate.py asks before anything is built): the same parsing the
    data loading does, and the flags that do not go together. document_flags: those of --reset-position-ids,
    --reset-attention-mask and --eod-mask-loss that are on."""
    try:
        if data is not None:
            parse_data_argument(data)
        split_documents(0, split)
    except ValueError as e:
        return [str(e)]
    boundaries = list(document_flags)
    if sft_data is not None and (data is not None or mock_data):
        return ["--sft-data replaces --data / --mock-data; give only one of them"]
    if boundaries and (mock_data or sft_data is not None):
        return [
            f"{', '.join(boundaries)} apply to --data corpora with EOD tokens; --mock-data has none and "
            "--sft-data already keeps attention and positions inside each conversation"
        ]
    if boundaries and data is not None and tokenizer is None:
        return [
            f"{', '.join(boundaries)} need the end-of-document token id: pass --tokenizer (the one "
            "the data was preprocessed with)"
        ]
    return []
