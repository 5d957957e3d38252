"""Turn jsonl (plain, .gz, .zst) or parquet records into Megatron ``.bin/.idx`` token files.

Pre-training: each record becomes one document per key in ``json_keys``,
written to ``{output_prefix}_{key}_document.bin/.idx`` (Megatron's naming).
Instruction tuning (``sft=True``): each record is a conversation, written as
tokens to ``{output_prefix}_sft`` plus a 0/1 loss mask to
``{output_prefix}_sft_mask`` (see ``sft.py``).

The work streams: records are read in chunks, encoded by a process pool, and
written in input order as results arrive. A bounded number of chunks is in
flight at any time, so memory stays flat however large the corpus.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from llamatron.data.indexed import IndexedDatasetWriter, best_token_dtype
from llamatron.data.readers import check_readable, expand_inputs, read_records, record_location, record_size
from llamatron.data.tokenizer import load_tokenizer
from llamatron.errors import DataError

LINES_PER_CHUNK = 1024
BYTES_PER_CHUNK = 1 << 20
CHUNKS_IN_FLIGHT_PER_WORKER = 4


class BadInputError(DataError):
    """A record of the input cannot be used (malformed JSON, missing key, empty document...)."""


class RecordError(ValueError):
    """Raised by an encoder for one record: ``kind`` groups the summary, the message says what is wrong."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class BadLine(NamedTuple):
    file_index: int
    line_number: int
    kind: str
    reason: str


class TextEncoder:
    """Pre-training records: the text under each key becomes one token document."""

    def __init__(self, tokenizer_path: str, json_keys: Sequence[str], append_eod: bool) -> None:
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.json_keys = tuple(json_keys)
        if not self.json_keys:
            raise ValueError("json_keys is empty; name at least one text key")
        if append_eod and self.tokenizer.eod_id is None:
            raise ValueError(f"{tokenizer_path}: tokenizer has no EOS token to append; use append_eod=False")
        self.eod = [self.tokenizer.eod_id] if append_eod else []
        self.dtype = best_token_dtype(self.tokenizer.vocab_size)
        self.token_outputs = self.json_keys  # outputs counted in the summary's "tokens"

    def outputs(self, output_prefix: str) -> dict[str, tuple[str, np.dtype]]:
        return {key: (output_prefix_for(output_prefix, key), self.dtype) for key in self.json_keys}

    def texts(self, record: dict) -> list[str]:
        texts = []
        for key in self.json_keys:
            text = record.get(key)
            if key not in record:
                raise RecordError("missing key", f"missing key {key!r}")
            if not isinstance(text, str):
                raise RecordError("not a string", f"key {key!r} is not a string but {type(text).__name__}")
            if not text:
                # Would be a document of nothing but EOD: almost always an extraction bug upstream.
                raise RecordError("empty document", f"empty document: key {key!r} is empty")
            texts.append(text)
        return texts

    def encode(self, records: list[dict]) -> list[list[np.ndarray] | RecordError]:
        """Per record: one token array per key, or why the record cannot be used."""
        texts: list[str] = []
        results: list[Any] = []
        for record in records:
            try:
                results.append(self.texts(record))
                texts.extend(results[-1])
            except RecordError as err:
                results.append(err)
        ids = iter(self.tokenizer.encode_batch(texts)) if texts else iter(())
        # Sent back as small arrays: pickling them is far cheaper than int lists.
        return [
            r if isinstance(r, RecordError) else [np.asarray(next(ids) + self.eod, dtype=self.dtype) for _ in r]
            for r in results
        ]


# A chunk is a list of (file index, record number, raw line bytes or a decoded parquet row).
Chunk = list[tuple[int, int, Any]]
# Per record: the arrays of each output, or why it could not be used; and the bytes read.
ChunkResult = tuple[list["list[np.ndarray] | BadLine"], int]

_worker: dict[str, Any] = {}


def _init_worker(make_encoder: tuple) -> None:
    factory, args = make_encoder
    _worker["encoder"] = factory(*args)


def _encode_chunk(chunk: Chunk) -> ChunkResult:
    """Parse and encode a chunk of records; return per-record results and the bytes read."""
    encoder = _worker["encoder"]
    parsed: list[dict] = []
    where: list[int] = []  # position in `results` of each parsed record
    results: list[Any] = []
    num_bytes = 0
    for file_index, number, payload in chunk:
        num_bytes += record_size(payload)
        if isinstance(payload, bytes):
            try:
                payload = json.loads(payload)
            except ValueError as err:  # includes invalid UTF-8
                results.append(BadLine(file_index, number, "malformed JSON", f"malformed JSON ({err})"))
                continue
        if not isinstance(payload, dict):
            kind = "not an object"
            results.append(BadLine(file_index, number, kind, f"expected a JSON object, got {type(payload).__name__}"))
            continue
        where.append(len(results))
        results.append((file_index, number))
        parsed.append(payload)
    for position, encoded in zip(where, encoder.encode(parsed)):
        if isinstance(encoded, RecordError):
            file_index, number = results[position]
            encoded = BadLine(file_index, number, encoded.kind, str(encoded))
        results[position] = encoded
    return results, num_bytes


def _read_chunks(paths: Sequence[str]) -> Iterator[Chunk]:
    chunk: Chunk = []
    chunk_bytes = 0
    for record in read_records(paths):
        chunk.append(record)
        chunk_bytes += record_size(record[2])
        if len(chunk) >= LINES_PER_CHUNK or chunk_bytes >= BYTES_PER_CHUNK:
            yield chunk
            chunk, chunk_bytes = [], 0
    if chunk:
        yield chunk


class _InFlightLimit:
    """Bounds how many chunks the pool has read ahead of the writer.

    ``Pool.imap`` drains its input iterator in a background thread with no
    back-pressure; this gate makes that thread wait until the writer has
    consumed a result. ``stop()`` lets the thread finish if we bail out early.
    """

    def __init__(self, limit: int) -> None:
        self._slots = threading.Semaphore(limit)
        self._stopped = False

    def gate(self, items: Iterable[Chunk]) -> Iterator[Chunk]:
        for item in items:
            while not self._slots.acquire(timeout=0.1):
                if self._stopped:
                    return
            if self._stopped:
                return
            yield item

    def consumed(self) -> None:
        self._slots.release()

    def stop(self) -> None:
        self._stopped = True


@contextlib.contextmanager
def _tokenizers_parallelism_off() -> Iterator[None]:
    """Forked workers must not inherit the tokenizers thread pool (and its warning)."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


@contextlib.contextmanager
def _encoded_chunks(paths: Sequence[str], make_encoder: tuple, workers: int) -> Iterator[Iterator[ChunkResult]]:
    """Encoded chunks in input order, from this process or a pool of ``workers``."""
    if workers == 1:
        _init_worker(make_encoder)
        yield map(_encode_chunk, _read_chunks(paths))
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    limit = _InFlightLimit(workers * CHUNKS_IN_FLIGHT_PER_WORKER)
    with _tokenizers_parallelism_off():
        pool = multiprocessing.get_context(method).Pool(workers, initializer=_init_worker, initargs=(make_encoder,))
    try:
        results = pool.imap(_encode_chunk, limit.gate(_read_chunks(paths)), chunksize=1)

        def consume() -> Iterator[ChunkResult]:
            for result in results:
                limit.consumed()
                yield result

        yield consume()
        pool.close()
    finally:
        limit.stop()
        pool.terminate()
        pool.join()


def _no_documents_message(paths: Sequence[str], bad_kinds: collections.Counter, first_bad: str | None) -> str:
    files = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    if not bad_kinds:
        return f"{files}: no records to preprocess (empty input); nothing written"
    kinds = ", ".join(f"{n} {kind}" for kind, n in bad_kinds.items())
    return (
        f"{files}: no usable records, all {sum(bad_kinds.values())} were skipped ({kinds}; first: {first_bad}); "
        "nothing written. Check the keys (--json-keys, or --messages-key/--prompt-key/--response-key with --sft) "
        "against the records"
    )


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def run_encoder(
    inputs: str | Sequence[str],
    output_prefix: str,
    make_encoder: tuple,
    workers: int = 1,
    skip_bad_lines: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Encode every record of ``inputs`` with the encoder ``make_encoder[0](*make_encoder[1])``.

    Each encoder output goes to its own indexed dataset; record i of the input
    is document i of every output. A bad record raises ``BadInputError`` naming
    file and line, unless ``skip_bad_lines`` is set, in which case it is
    skipped and counted (by kind) in the summary.
    """
    paths = expand_inputs(inputs)
    check_readable(paths)
    if workers < 1:
        raise ValueError(f"workers={workers}; need at least 1")
    encoder = make_encoder[0](*make_encoder[1])  # validates settings here, before any worker starts
    outputs = encoder.outputs(output_prefix)

    start = time.perf_counter()
    num_documents = num_bytes = 0
    num_tokens = {name: 0 for name in outputs}
    bad_kinds: collections.Counter[str] = collections.Counter()
    first_bad: str | None = None
    with contextlib.ExitStack() as stack:
        writers = [stack.enter_context(IndexedDatasetWriter(prefix, dtype)) for prefix, dtype in outputs.values()]
        chunks = stack.enter_context(_encoded_chunks(paths, make_encoder, workers))
        bar = stack.enter_context(tqdm(desc="preprocess", unit=" docs", disable=not progress))
        for results, chunk_bytes in chunks:
            for result in results:
                if isinstance(result, BadLine):
                    location = record_location(paths, result.file_index, result.line_number)
                    if not skip_bad_lines:
                        raise BadInputError(f"{location}: {result.reason} (skip such records with --skip-bad-lines)")
                    bad_kinds[result.kind] += 1
                    first_bad = first_bad or f"{location}: {result.reason}"
                    continue
                for name, writer, array in zip(outputs, writers, result):
                    writer.add_document(array)
                    num_tokens[name] += array.size
                num_documents += 1
            num_bytes += chunk_bytes
            bar.update(len(results))
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{num_bytes / elapsed / 1e6:.1f} MB/s", refresh=False)
        if num_documents == 0:  # raised inside the writers' block, so no empty dataset is left behind
            raise BadInputError(_no_documents_message(paths, bad_kinds, first_bad))
    return {
        "documents": num_documents,
        "tokens": sum(num_tokens[name] for name in encoder.token_outputs),
        "tokens_per_output": num_tokens,
        "bad_lines": sum(bad_kinds.values()),
        "bad_line_kinds": dict(bad_kinds),
        "first_bad_line": first_bad,
        "files": len(paths),
        "bytes": num_bytes,
        "seconds": time.perf_counter() - start,
        "outputs": {name: prefix for name, (prefix, _) in outputs.items()},
    }


def preprocess(
    inputs: str | Sequence[str],
    output_prefix: str,
    tokenizer_path: str,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
    skip_bad_lines: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize pre-training text into ``{output_prefix}_{key}_document.bin/.idx``; return a summary.

    ``inputs``: files, globs or directories of .jsonl/.jsonl.gz/.jsonl.zst/.parquet.
    The summary holds documents, tokens (all keys; per key in tokens_per_output),
    bad_lines and their kinds, bytes, seconds and the output prefixes.
    """
    make_encoder = (TextEncoder, (tokenizer_path, tuple(json_keys), append_eod))
    return run_encoder(inputs, output_prefix, make_encoder, workers, skip_bad_lines, progress)


def format_summary(summary: dict[str, Any]) -> str:
    seconds = max(summary["seconds"], 1e-9)
    kinds = ", ".join(f"{n} {kind}" for kind, n in summary["bad_line_kinds"].items())
    lines = [
        f"preprocessed {summary['documents']} documents ({summary['tokens']} tokens) from {summary['files']} file(s), "
        f"{summary['bytes'] / 1e6:.1f} MB in {seconds:.1f}s: {summary['documents'] / seconds:.0f} docs/s, "
        f"{summary['bytes'] / seconds / 1e6:.2f} MB/s",
        f"{summary['bad_lines']} bad lines skipped"
        + (f" ({kinds}; first: {summary['first_bad_line']})" if summary["bad_lines"] else ""),
    ]
    lines += [f"{key}: {value}" for key, value in summary.get("notes", {}).items()]
    lines.append("outputs: " + ", ".join(summary["outputs"].values()))
    return "\n".join(lines)
