"""Input files for preprocessing: jsonl (plain, .gz, .zst) and parquet, named directly or by glob.

Records stream out in file order as ``(file index, record number, payload)``
where the payload is a raw JSON line (bytes, parsed later by a worker) or, for
parquet, an already decoded row (dict). Record numbers count from 1 and, for
jsonl, are line numbers, so an error can name ``file:line``.
"""

from __future__ import annotations

import glob
import gzip
import io
import os
from typing import IO, Any, Iterator, Sequence

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = JSONL_SUFFIXES + PARQUET_SUFFIXES
PARQUET_ROWS_PER_BATCH = 1024

Record = tuple[int, int, "bytes | dict[str, Any]"]


def expand_inputs(patterns: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Files named by ``patterns``: paths, globs (``data/*.jsonl.zst``, ``**`` recursive) or directories.

    A directory stands for the supported files directly inside it. Globs and
    directories expand in sorted order, so the output order is reproducible.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    paths: list[str] = []
    for pattern in map(os.fspath, patterns):
        if os.path.isfile(pattern):
            matches = [pattern]
        elif os.path.isdir(pattern):
            matches = sorted(os.path.join(pattern, n) for n in os.listdir(pattern) if n.endswith(SUPPORTED))
            if not matches:
                raise FileNotFoundError(f"{pattern}: directory holds no input files ({', '.join(SUPPORTED)})")
        elif glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(f"{pattern}: no file matches this pattern")
        else:
            raise FileNotFoundError(f"{pattern}: input file not found")
        for path in matches:
            if not path.endswith(SUPPORTED):
                raise ValueError(f"{path}: unsupported input format (supported: {', '.join(SUPPORTED)})")
        paths.extend(matches)
    if not paths:
        raise ValueError("no input files given")
    return paths


def _zstandard():
    try:
        import zstandard
    except ImportError as err:
        raise ImportError(
            "reading .zst files needs the zstandard package: pip install zstandard (or pip install 'llamatron[data]')"
        ) from err
    return zstandard


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as parquet
    except ImportError as err:
        raise ImportError(
            "reading parquet files needs the pyarrow package: pip install pyarrow (or pip install 'llamatron[data]')"
        ) from err
    return parquet


def check_readable(paths: Sequence[str]) -> None:
    """Fail before any work starts when a format's optional package is missing."""
    if any(p.endswith(".zst") for p in paths):
        _zstandard()
    if any(p.endswith(PARQUET_SUFFIXES) for p in paths):
        _pyarrow_parquet()


def open_jsonl(path: str) -> IO[bytes]:
    """A binary line reader over a plain, gzip or zstandard jsonl file."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        # A frame may be written without its content size (streaming writers): read it as a stream.
        raw = open(path, "rb")
        reader = _zstandard().ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return open(path, "rb")


def _jsonl_records(file_index: int, path: str) -> Iterator[Record]:
    with open_jsonl(path) as f:
        for line_number, raw in enumerate(f, start=1):
            if raw.strip():  # blank lines (a trailing newline, say) are not records
                yield file_index, line_number, raw


def _parquet_records(file_index: int, path: str) -> Iterator[Record]:
    parquet = _pyarrow_parquet()
    try:
        table = parquet.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own error types for a corrupt file
        raise ValueError(f"{path}: not a readable parquet file ({err})") from err
    row = 0
    for batch in table.iter_batches(batch_size=PARQUET_ROWS_PER_BATCH):
        for record in batch.to_pylist():
            row += 1
            yield file_index, row, record


def read_records(paths: Sequence[str]) -> Iterator[Record]:
    """Every record of every file, in order."""
    for file_index, path in enumerate(paths):
        if path.endswith(PARQUET_SUFFIXES):
            yield from _parquet_records(file_index, path)
        else:
            yield from _jsonl_records(file_index, path)


def record_size(payload: Any) -> int:
    """Bytes a record stands for, for MB/s: the raw line, or roughly the text of a parquet row."""
    if isinstance(payload, (bytes, str)):
        return len(payload)
    if isinstance(payload, dict):
        return sum(record_size(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(record_size(v) for v in payload)
    return 8


def record_location(paths: Sequence[str], file_index: int, number: int) -> str:
    """``file:line`` for jsonl, ``file:row N`` for parquet."""
    path = paths[file_index]
    return f"{path}:row {number}" if path.endswith(PARQUET_SUFFIXES) else f"{path}:{number}"
