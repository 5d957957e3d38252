"""Index arrays cached next to the data as .npy files, named by a hash of what they depend on.

Sample indices, blend indices, SFT packings and token-id ranges are pure
functions of their inputs; building them once (rank 0 first, see train.py) and
memory-mapping them everywhere else keeps start-up fast and memory small.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# Bump when any cached construction changes, so stale caches are not reused.
CACHE_FORMAT_VERSION = 1


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
    """The .npy files ``{cache_dir}/{stem}_{key}_{name}.npy`` for each of ``names``."""

    def __init__(self, cache_dir: str | None, stem: str, key: str, names: Sequence[str]) -> None:
        self.cache_dir = cache_dir
        self.names = tuple(names)
        self.paths = [os.path.join(cache_dir, f"{stem}_{key}_{name}.npy") for name in names] if cache_dir else []

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
        return arrays

    def save(self, arrays: Sequence[np.ndarray]) -> bool:
        """Write the arrays (each atomically); a read-only data directory only warns."""
        if not self.paths or self.cache_dir is None:
            return False
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            for path, array in zip(self.paths, arrays):
                _save_atomic(path, np.asarray(array))
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
