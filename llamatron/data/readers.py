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
import sys
import zlib
from collections.abc import Iterator, Sequence
from typing import IO, Any, cast

from llamatron.errors import DataError, MissingPackageError

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = JSONL_SUFFIXES + PARQUET_SUFFIXES
PARQUET_ROWS_PER_BATCH = 1024

Record = tuple[int, int, "bytes | dict[str, Any]"]


def expand_inputs(patterns: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Files named by ``patterns``: paths, globs (``data/*.jsonl.zst``, ``**`` recursive) or directories.

    A directory stands for the supported files directly inside it (a warning
    counts those in its subdirectories, which are not read). Globs and
    directories expand in sorted order, so the output order is reproducible.
    A file named more than once is read once, with a warning.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    paths: list[str] = []
    for pattern in [str(os.fspath(p)) for p in patterns]:
        if os.path.isfile(pattern):
            matches = [pattern]
        elif os.path.isdir(pattern):
            matches = sorted(os.path.join(pattern, n) for n in os.listdir(pattern) if n.endswith(SUPPORTED))
            nested = _nested_inputs(pattern)
            hint = ""
            if nested:
                example = os.path.join(pattern, "**", "*" + _suffix(nested[0]))
                hint = (
                    f"{len(nested)} input file(s) in its subdirectories are not read (a directory stands for the "
                    f"files directly inside it); to read them give a recursive glob, quoted: '{example}'"
                )
            if not matches:
                raise FileNotFoundError(
                    f"{pattern}: directory holds no input files ({', '.join(SUPPORTED)})"
                    + (f"; {hint}" if hint else "")
                )
            if hint:
                print(f"warning: {pattern}: {hint}", file=sys.stderr, flush=True)
        elif glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(f"{pattern}: no file matches this pattern")
        else:
            raise FileNotFoundError(f"{pattern}: input file not found")
        for path in matches:
            if not path.endswith(SUPPORTED):
                raise DataError(f"{path}: unsupported input format (supported: {', '.join(SUPPORTED)})")
        paths.extend(matches)
    if not paths:
        raise DataError("no input files given")
    return _without_repeats(paths)


def _nested_inputs(directory: str) -> list[str]:
    """Supported files below the top level of ``directory``."""
    return sorted(
        os.path.join(root, n)
        for root, _, names in os.walk(directory)
        if root != directory
        for n in names
        if n.endswith(SUPPORTED)
    )


def _suffix(path: str) -> str:
    return next(s for s in sorted(SUPPORTED, key=len, reverse=True) if path.endswith(s))


def _without_repeats(paths: list[str]) -> list[str]:
    """Each file once (first place kept): a file read twice would silently double its documents."""
    seen: dict[str, str] = {}
    unique, repeated = [], []
    for path in paths:
        key = os.path.realpath(path)
        if key in seen:
            repeated.append(path if path == seen[key] else f"{path} (= {seen[key]})")
        else:
            seen[key] = path
            unique.append(path)
    if repeated:
        print(
            f"warning: {len(repeated)} input file(s) named more than once are read once: {', '.join(repeated[:3])}"
            + (f" and {len(repeated) - 3} more" if len(repeated) > 3 else ""),
            file=sys.stderr,
            flush=True,
        )
    return unique


def _zstandard():
    try:
        import zstandard
    except ImportError as err:
        raise MissingPackageError(
            "reading .zst files needs the zstandard package: pip install zstandard (or pip install 'llamatron[data]')"
        ) from err
    return zstandard


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as parquet
    except ImportError as err:
        raise MissingPackageError(
            "reading parquet files needs the pyarrow package: pip install pyarrow (or pip install 'llamatron[data]')"
        ) from err
    return parquet


def check_readable(paths: Sequence[str]) -> None:
    """Fail before any work starts when a format's optional package is missing."""
    if any(p.endswith(".zst") for p in paths):
        _zstandard()
    if any(p.endswith(PARQUET_SUFFIXES) for p in paths):
        _pyarrow_parquet()


class _ZstdStream(io.RawIOBase):
    """Every frame of a .zst file, decompressed; raises TruncatedError if the file ends inside a frame.

    (zstandard's stream_reader just stops there, so a cut-off file would read as a short one.)
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "rb")
        self._zstd = _zstandard()
        self._frame = self._zstd.ZstdDecompressor().decompressobj()
        self._in_frame = False  # input was fed to the current frame and its end not yet seen
        self._pending, self._offset = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._offset == len(self._pending):
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._in_frame:
                    raise TruncatedError()
                return 0
            self._pending, self._offset = self._decompress(chunk), 0
        n = min(len(buffer), len(self._pending) - self._offset)
        buffer[:n] = self._pending[self._offset : self._offset + n]
        self._offset += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self._frame.decompress(data))
            self._in_frame = not self._frame.eof
            if not self._frame.eof:
                break
            data = self._frame.unused_data  # the next frame, if the file has several
            self._frame = self._zstd.ZstdDecompressor().decompressobj()
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


class TruncatedError(EOFError):
    """A compressed input that ends inside its stream."""


def open_jsonl(path: str) -> IO[bytes]:
    """A binary line reader over a plain, gzip or zstandard jsonl file."""
    if path.endswith(".gz"):
        return cast(IO[bytes], gzip.open(path, "rb"))
    if path.endswith(".zst"):
        # A frame may be written without its content size (streaming writers): read it as a stream.
        return io.BufferedReader(_ZstdStream(path), buffer_size=1 << 20)
    return open(path, "rb")


def _jsonl_records(file_index: int, path: str) -> Iterator[Record]:
    zstd_error = _zstandard().ZstdError if path.endswith(".zst") else EOFError
    try:
        with open_jsonl(path) as f:
            for line_number, raw in enumerate(f, start=1):
                if raw.strip():  # blank lines (a trailing newline, say) are not records
                    yield file_index, line_number, raw
    except EOFError as err:  # gzip's and ours: the file was cut off (an interrupted download or copy)
        # Not a bad line (no --skip-bad-lines): the rest of the file is lost, and with it most of the data.
        raise DataError(f"{path}: compressed stream ends early (truncated file); re-download or re-create it") from err
    except (OSError, zlib.error, zstd_error) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise DataError(
            f"{path}: not a readable {os.path.splitext(path)[1]} file ({err}); re-download or re-create it"
        ) from err


def _parquet_records(file_index: int, path: str) -> Iterator[Record]:
    parquet = _pyarrow_parquet()
    row = 0
    try:
        table = parquet.ParquetFile(path)
        for batch in table.iter_batches(batch_size=PARQUET_ROWS_PER_BATCH):
            for record in batch.to_pylist():
                row += 1
                yield file_index, row, record
    except Exception as err:  # pyarrow raises its own error types for a corrupt or truncated file
        where = f" after row {row}" if row else ""
        raise DataError(
            f"{path}: not a readable parquet file{where} ({err}); the file is truncated or corrupt: "
            "re-download or re-export it"
        ) from err


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
