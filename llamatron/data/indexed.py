"""Megatron-compatible memory-mapped indexed dataset (``.bin`` + ``.idx``).

A dataset is a pair of files sharing a prefix. ``PREFIX.bin`` holds every
sequence's tokens back to back. ``PREFIX.idx`` describes them:

    magic        9 bytes   b"MMIDIDX\\x00\\x00"
    version      uint64    1
    dtype code   uint8     see TOKEN_DTYPES
    num_seqs     uint64
    num_docs     uint64    number of doc_idx entries (documents + 1)
    sizes        int32[num_seqs]    tokens per sequence
    pointers     int64[num_seqs]    byte offset of each sequence in .bin
    doc_idx      int64[num_docs]    sequence index where each document starts,
                                    from 0 up to and including num_seqs

All integers are little-endian. Corpora written by Megatron-LM load as they are.
"""

from __future__ import annotations

import glob
import os
import struct
from array import array
from collections.abc import Sequence

import numpy as np

from llamatron.errors import DataError, MissingDataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, num_seqs, num_docs

TOKEN_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
DTYPE_CODES: dict[np.dtype, int] = {dtype: code for code, dtype in TOKEN_DTYPES.items()}


def index_path(prefix: str) -> str:
    return prefix + ".idx"


def data_path(prefix: str) -> str:
    return prefix + ".bin"


def best_token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds every token id (Megatron's rule)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _prefix_hint(prefix: str) -> str:
    """`preprocess --output-prefix P` writes P_<key>_document (P_sft with --sft): name those if the user gave P."""
    for ext in (".bin", ".idx"):  # the prefix names both files, without an extension
        if prefix.endswith(ext) and os.path.isfile(prefix[: -len(ext)] + ".idx"):
            return f"; give the prefix without {ext}: {prefix[: -len(ext)]!r}"
    # preprocess --sft --output-prefix P writes P_sft (for --sft-data)
    found = sorted(
        p[: -len(".idx")]
        for pattern in ("_*_document.idx", "_sft.idx")
        for p in glob.glob(glob.escape(prefix) + pattern)
    )
    return f"; did you mean {' or '.join(repr(f) for f in found)}?" if found else ""


class IndexedDatasetWriter:
    """Streams sequences to ``PREFIX.bin`` and writes ``PREFIX.idx`` on finalize.

    Both files are written under temporary names and renamed into place by
    ``finalize()``, so a crash never leaves a half-written dataset that looks
    complete. Used as a context manager, it finalizes on success and discards
    the temporary files on error.
    """

    def __init__(self, prefix: str, dtype: np.dtype | type = np.uint16) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            supported = ", ".join(str(d) for d in DTYPE_CODES)
            raise ValueError(f"unsupported token dtype {self.dtype}; use one of {supported}")
        # array() keeps per-sequence bookkeeping compact for corpora of many
        # millions of documents, where Python int lists would cost ~10x more.
        self._sizes = array("i")
        self._doc_idx = array("q", [0])
        self._finalized = False
        self._tmp_bin = data_path(self.prefix) + ".tmp"
        self._tmp_idx = index_path(self.prefix) + ".tmp"
        parent = os.path.dirname(self.prefix)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._bin_file = open(self._tmp_bin, "wb")

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence to the current document."""
        self._check_open()
        values = self._as_token_array(tokens)
        self._bin_file.write(values.tobytes(order="C"))
        self._sizes.append(values.size)

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self._check_open()
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append a document made of a single sequence."""
        self.add_item(tokens)
        self.end_document()

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._check_open()
        if self._doc_idx[-1] != len(self._sizes):
            self.end_document()  # sequences after the last end_document form a final document
        self._bin_file.flush()
        os.fsync(self._bin_file.fileno())
        self._bin_file.close()

        sizes = np.frombuffer(self._sizes, dtype=np.int32) if len(self._sizes) else np.zeros(0, np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.frombuffer(self._doc_idx, dtype=np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, DTYPE_CODES[self.dtype], len(sizes), len(doc_idx)))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        # .bin first: a reader only trusts a .bin through its .idx.
        os.replace(self._tmp_bin, data_path(self.prefix))
        os.replace(self._tmp_idx, index_path(self.prefix))
        self._finalized = True

    def discard(self) -> None:
        """Drop everything written so far; the final files are left untouched."""
        if not self._bin_file.closed:
            self._bin_file.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)
        self._finalized = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._finalized:
            return
        if exc_type is None:
            self.finalize()
        else:
            self.discard()

    def _check_open(self) -> None:
        if self._finalized:
            raise RuntimeError(f"writer for {self.prefix} is already finalized")

    def _as_token_array(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        values = np.asarray(tokens)
        if values.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {values.shape}")
        if values.size and self.dtype.kind in "iu" and values.dtype != self.dtype:
            info = np.iinfo(self.dtype)
            low, high = int(values.min()), int(values.max())
            if low < info.min or high > info.max:
                raise ValueError(
                    f"token ids in [{low}, {high}] do not fit {self.dtype} "
                    f"(range [{info.min}, {info.max}]) while writing {self.prefix}"
                )
        return values.astype(self.dtype.newbyteorder("<"), copy=False)


def write_synthetic_index(prefix: str, sizes: np.ndarray, dtype: np.dtype | type = np.uint16) -> None:
    """A dataset of one-sequence documents with these sizes whose .bin is a sparse file of zeros.

    For scale tests and benchmarks of index building: a 10-billion-token corpus
    costs its .idx (20 bytes per document) and no disk space for tokens.
    """
    sizes = np.asarray(sizes, dtype="<i4")
    dtype = np.dtype(dtype)
    pointers = np.zeros(sizes.size, dtype="<i8")
    np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(index_path(prefix), "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, DTYPE_CODES[dtype], sizes.size, sizes.size + 1))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(sizes.size + 1, dtype="<i8").tobytes())
    with open(data_path(prefix), "wb") as f:
        f.truncate(int(sizes.sum(dtype=np.int64)) * dtype.itemsize)


class IndexedDataset:
    """Read-only view of a ``.bin/.idx`` pair through ``np.memmap``.

    Item ``i`` is sequence ``i`` as a NumPy array that shares memory with the
    mapped file (no copy). Opening validates the index against the data file,
    so a truncated or mismatched corpus fails here and not mid-training.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = os.fspath(prefix)
        self._open()

    def _open(self) -> None:
        idx_file, bin_file = index_path(self.prefix), data_path(self.prefix)
        for path in (idx_file, bin_file):
            if not os.path.isfile(path):
                raise MissingDataError(
                    f"{path}: file not found (indexed dataset prefix {self.prefix!r})" + _prefix_hint(self.prefix)
                )

        idx_bytes = os.path.getsize(idx_file)
        with open(idx_file, "rb") as f:
            header = f.read(HEADER.size)
        if header[: len(MAGIC)] != MAGIC:
            raise DataError(
                f"{idx_file}: not a Megatron indexed dataset index (magic {header[: len(MAGIC)]!r}, expected {MAGIC!r})"
            )
        if len(header) < HEADER.size:
            raise DataError(f"{idx_file}: header truncated ({idx_bytes} bytes, need {HEADER.size})")
        _, version, dtype_code, num_seqs, num_docs = HEADER.unpack(header)
        if version != VERSION:
            raise DataError(f"{idx_file}: unsupported index version {version} (only {VERSION} is supported)")
        if dtype_code not in TOKEN_DTYPES:
            raise DataError(f"{idx_file}: unknown dtype code {dtype_code} (known: {sorted(TOKEN_DTYPES)})")
        self.dtype: np.dtype = TOKEN_DTYPES[dtype_code]

        expected_idx_bytes = HEADER.size + num_seqs * 4 + num_seqs * 8 + num_docs * 8
        if idx_bytes != expected_idx_bytes:
            raise DataError(
                f"{idx_file}: size is {idx_bytes} bytes but its header ({num_seqs} sequences, "
                f"{num_docs} document entries) needs {expected_idx_bytes} (truncated or corrupt index)"
            )
        self._idx_map = np.memmap(idx_file, dtype=np.uint8, mode="r")
        offset = HEADER.size
        self.sizes: np.ndarray = np.frombuffer(self._idx_map, dtype="<i4", count=num_seqs, offset=offset)
        offset += self.sizes.nbytes
        self.pointers: np.ndarray = np.frombuffer(self._idx_map, dtype="<i8", count=num_seqs, offset=offset)
        offset += self.pointers.nbytes
        self.doc_idx: np.ndarray = np.frombuffer(self._idx_map, dtype="<i8", count=num_docs, offset=offset)
        self._validate_index(idx_file)

        data_bytes = int(self.sizes.sum(dtype=np.int64)) * self.dtype.itemsize
        bin_bytes = os.path.getsize(bin_file)
        if bin_bytes != data_bytes:
            raise DataError(
                f"{bin_file}: size is {bin_bytes} bytes but {idx_file} describes {data_bytes} bytes "
                f"({'truncated' if bin_bytes < data_bytes else 'trailing data in'} .bin, or files from different runs)"
            )
        # np.memmap cannot map an empty file; an empty dataset needs no mapping.
        self._bin_map = np.memmap(bin_file, dtype=np.uint8, mode="r") if bin_bytes else np.zeros(0, np.uint8)

    def _validate_index(self, idx_file: str) -> None:
        sizes, pointers, doc_idx = self.sizes, self.pointers, self.doc_idx
        if sizes.size and int(sizes.min()) < 0:
            bad = int(np.argmax(sizes < 0))
            raise DataError(f"{idx_file}: negative size {int(sizes[bad])} for sequence {bad}")
        if pointers.size:
            expected = np.zeros(pointers.size, dtype=np.int64)
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=expected[1:])
            wrong = np.flatnonzero(pointers != expected)
            if wrong.size:
                i = int(wrong[0])
                raise DataError(
                    f"{idx_file}: inconsistent pointers: sequence {i} points to byte {int(pointers[i])}, "
                    f"expected {int(expected[i])} (sequences must be stored back to back)"
                )
        if doc_idx.size == 0 or doc_idx[0] != 0 or doc_idx[-1] != sizes.size:
            raise DataError(
                f"{idx_file}: document index must start at 0 and end at the number of sequences "
                f"({sizes.size}), got {doc_idx[:1].tolist()}...{doc_idx[-1:].tolist()}"
            )
        if doc_idx.size > 1 and np.any(np.diff(doc_idx) < 0):
            raise DataError(f"{idx_file}: document index is not sorted")

    @property
    def num_documents(self) -> int:
        return self.doc_idx.size - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def __len__(self) -> int:
        return self.sizes.size

    def token_id_range(self, chunk_bytes: int = 64 << 20) -> tuple[int, int]:
        """(smallest, largest) token id in the .bin; (0, -1) when it holds no token. For
        unsigned dtypes the smallest is reported as 0 without reading (ids cannot be negative).

        Reads the file in chunks into one reused buffer rather than through the
        memory map: memory stays at ``chunk_bytes`` for a corpus of any size,
        and a reused buffer avoids faulting in fresh pages for every chunk.
        """
        buffer = np.empty(max(chunk_bytes // self.dtype.itemsize, 1), dtype=self.dtype)
        raw = buffer.data.cast("B")
        signed = self.dtype.kind != "u"  # unsigned ids cannot be negative: one pass instead of two
        low, high = None, None
        with open(data_path(self.prefix), "rb", buffering=0) as f:
            while True:
                filled = f.readinto(raw)
                while 0 < filled < len(raw) and (got := f.readinto(raw[filled:])):  # a short read
                    filled += got
                if filled == 0:
                    break
                chunk = buffer[: filled // self.dtype.itemsize]
                chunk_low = int(chunk.min()) if signed else 0
                low = chunk_low if low is None else min(low, chunk_low)
                high = int(chunk.max()) if high is None else max(high, int(chunk.max()))
                if filled < len(raw):
                    break
        return (0, -1) if low is None or high is None else (low, high)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``index`` (to its end if no length)."""
        num_seqs = self.sizes.size
        if not -num_seqs <= index < num_seqs:
            raise IndexError(f"sequence {index} out of range for {num_seqs} sequences in {self.prefix}")
        index = index % num_seqs
        size = int(self.sizes[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {index} of size {size}")
        start = int(self.pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, dtype=self.dtype, count=length, offset=start)

    # Pickle by prefix so DataLoader workers re-map the files instead of
    # copying whole memory maps through a pipe.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, sequences={len(self)}, dtype={self.dtype})"
