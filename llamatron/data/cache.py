"""Index arrays cached as .npy files (beside the data, or in --data-cache-path), named by a hash of their inputs.

Sample indices, blend indices, SFT packings and token-id ranges are pure
functions of their inputs; building them once (rank 0 first, see train.py) and
memory-mapping them everywhere else keeps start-up fast and memory small.

An entry is the files ``{stem}_{kind}_{key}_{name}.npy``: the dataset, what the
index is for (``train``, ``valid``, ``token-range``, ...), the hash of every
input, one file per array. A run with the same settings finds its entry and
reuses it; one with other settings adds one entry. So that a directory does not
fill up over many runs, it keeps the ``KEEP_PER_KIND`` most recently used
entries of each dataset and kind: writing another removes the least recently
used (loading one counts as a use), and with it files left by an interrupted
write and those of the naming before kinds (``{stem}_{key}_{name}.npy``),
which no run reads any more. A removed entry is rebuilt, identically, when a
run needs it again.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# Bump when any cached construction changes, so stale caches are not reused.
CACHE_FORMAT_VERSION = 1
# Entries kept per dataset and kind: a few settings alternated between (e.g. --train-steps) stay cached.
KEEP_PER_KIND = 4
# A temporary file this old is what an interrupted write left, not one being written now.
STALE_TMP_SECONDS = 24 * 3600


def cache_key(*parts: Any) -> str:
    """A short hex digest of values and arrays (arrays by their bytes)."""
    digest = hashlib.sha256(f"v{CACHE_FORMAT_VERSION};".encode())
    for part in parts:
        if isinstance(part, np.ndarray):
            digest.update(f"array{part.dtype}{part.shape};".encode())
            digest.update(np.ascontiguousarray(part).tobytes())
        else:
            digest.update(f"{part!r};".encode())
    return digest.hexdigest()[:16]


def file_signature(path: str) -> tuple[int, int]:
    """(size, modification time): a rewritten file gets a new cache entry."""
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def _save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


class ArrayCache:
    """The .npy files ``{cache_dir}/{stem}_{kind}_{key}_{name}.npy`` for each of ``names``."""

    def __init__(self, cache_dir: str | None, stem: str, kind: str, key: str, names: Sequence[str]) -> None:
        self.cache_dir, self.stem, self.kind, self.key = cache_dir, stem, kind, key
        self.names = tuple(names)
        self.paths = [os.path.join(cache_dir, f"{stem}_{kind}_{key}_{name}.npy") for name in names] if cache_dir else []

    def load(self) -> list[np.ndarray] | None:
        """The cached arrays, memory-mapped, or None when any is missing or unreadable (then they are rebuilt)."""
        if not self.paths or not all(os.path.isfile(p) for p in self.paths):
            return None
        arrays = []
        for path in self.paths:
            try:
                arrays.append(np.load(path, mmap_mode="r"))
            except (ValueError, OSError, EOFError) as err:
                # Truncated or overwritten (a copy cut short, a full disk, an edit): a cache only saves time, so
                # build it again rather than stop the run; saving replaces the bad file atomically.
                warnings.warn(f"index cache {path} cannot be read ({err}); rebuilding it", stacklevel=3)
                return None
        for path in self.paths:  # a use: the entry is now the most recent of its kind
            try:
                os.utime(path)
            except OSError:  # a read-only cache still serves
                pass
        return arrays

    def save(self, arrays: Sequence[np.ndarray]) -> bool:
        """Write the arrays (each atomically), then drop the entries of this kind beyond KEEP_PER_KIND; a
        read-only data directory only warns."""
        if not self.paths or self.cache_dir is None:
            return False
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            for path, array in zip(self.paths, arrays):
                _save_atomic(path, np.asarray(array))
            self._remove_unused()
            return True
        except OSError as err:  # a read-only data directory must not stop training
            warnings.warn(f"could not cache index arrays in {self.cache_dir}: {err}", stacklevel=3)
            return False

    def get_or_build(self, build: Callable[[], Sequence[np.ndarray]]) -> tuple[list[np.ndarray], bool]:
        """(arrays, loaded_from_cache): load them, or build and save them."""
        arrays = self.load()
        if arrays is not None:
            return arrays, True
        arrays = list(build())
        self.save(arrays)
        return arrays, False

    def _remove_unused(self) -> None:
        """Keep this entry and the KEEP_PER_KIND - 1 other most recently used ones of its stem and kind; remove
        the rest, this kind's leftovers of interrupted writes, and this stem's files of the naming before kinds."""
        assert self.cache_dir is not None
        names = "|".join(re.escape(n) for n in self.names)
        entry = re.compile(rf"{re.escape(f'{self.stem}_{self.kind}_')}([0-9a-f]{{16}})_(?:{names})\.npy")
        legacy = re.compile(rf"{re.escape(self.stem)}_[0-9a-f]{{16}}_(?:{names})\.npy")
        last_used: dict[str, float] = {}
        doomed = []
        for name in os.listdir(self.cache_dir):
            path = os.path.join(self.cache_dir, name)
            written, tmp, _ = name.partition(".npy.tmp")
            if legacy.fullmatch(name):
                doomed.append(path)
            elif tmp and entry.fullmatch(written + ".npy"):
                if time.time() - _mtime(path) > STALE_TMP_SECONDS:
                    doomed.append(path)
            elif (match := entry.fullmatch(name)) and match[1] != self.key:
                last_used[match[1]] = max(last_used.get(match[1], 0.0), _mtime(path))
        unused = sorted(last_used, key=last_used.__getitem__, reverse=True)[KEEP_PER_KIND - 1 :]
        doomed += [
            os.path.join(self.cache_dir, f"{self.stem}_{self.kind}_{k}_{n}.npy") for k in unused for n in self.names
        ]
        for path in doomed:
            try:
                os.remove(path)
            except FileNotFoundError:  # another rank or run removed it first
                pass


def _mtime(path: str) -> float:
    """When the file was last written or used (now, when it has just been removed by another process)."""
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return time.time()
