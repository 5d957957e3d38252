"""Reading and writing weights one tensor at a time, so host memory stays near the largest tensor.

`TensorSource` gives lazy access to the tensors of a set of files (safetensors
through `safe_open`, PyTorch pickles through memory-mapped `torch.load`).
`StreamingSafetensorsWriter` writes a `.safetensors` file whose header (names,
dtypes, shapes) is known up front, then the tensors in order; the format is
the documented one (8-byte little-endian header length, JSON header, raw
little-endian data), readable by `safetensors.safe_open` and transformers.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from ..dtypes import SAFETENSORS_DTYPES, TORCH_DTYPES
from ..errors import CheckpointError
from .reader import open_safetensors

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]


class WeightSource(Protocol):
    """Full tensors by name: a TensorSource (files) or a CheckpointReader (a checkpoint of any layout)."""

    def keys(self) -> set[str]: ...

    def get(self, name: str) -> torch.Tensor: ...

    def meta(self, name: str) -> torch.Tensor: ...


class TensorSource:
    """Lazy tensors from safetensors or PyTorch files, by name."""

    def __init__(self, files: Iterable[str | Path]):
        self._where: dict[str, Any] = {}  # name -> open safetensors handle or memory-mapped state dict
        self._handles = []
        for path in files:
            path = Path(path)
            if not path.is_file():
                raise CheckpointError(f"{path}: weight file not found")
            if path.suffix == ".safetensors":
                handle = open_safetensors(path, remedy="re-download or re-create it")
                self._handles.append(handle)
                for name in handle.keys():
                    self._where[name] = handle
            else:
                state = load_pickled(path)
                for name in state:
                    self._where[name] = state

    def keys(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        owner = self._where[name]
        return owner.get_tensor(name) if hasattr(owner, "get_tensor") else owner[name]

    def meta(self, name: str) -> torch.Tensor:
        """A `meta` tensor of the right shape and dtype, without reading the data."""
        owner = self._where[name]
        if hasattr(owner, "get_slice"):
            s = owner.get_slice(name)
            return torch.empty(s.get_shape(), dtype=TORCH_DTYPES[s.get_dtype()], device="meta")
        t = owner[name]
        return torch.empty(t.shape, dtype=t.dtype, device="meta")


class PrefixedSource:
    """The tensors of `source` under `prefix`, named without it (a multimodal checkpoint's text model)."""

    def __init__(self, source: WeightSource, prefix: str):
        self.source, self.prefix = source, prefix

    def keys(self) -> set[str]:
        return {n[len(self.prefix) :] for n in self.source.keys() if n.startswith(self.prefix)}

    def get(self, name: str) -> torch.Tensor:
        return self.source.get(self.prefix + name)

    def meta(self, name: str) -> torch.Tensor:
        return self.source.meta(self.prefix + name)


def load_pickled(path: Path) -> dict[str, torch.Tensor]:
    try:
        try:  # zip-format files (torch >= 1.6) map lazily: a tensor is read when it is used
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # the legacy format cannot be memory-mapped: that file is read whole
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        # weights_only: a pickle that would build anything but tensors (code, objects) is refused, never run
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} is not a whole file of tensors (truncated, or it holds more than tensors: {first}); re-download it"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        found = type(state).__name__ if not isinstance(state, dict) else "other values beside tensors"
        raise CheckpointError(f"{path}: expected a state dict of tensors, found {found}; re-download it")
    return state


class StreamingSafetensorsWriter:
    """Writes `specs` (name, dtype, shape) to `path`; then `write` each tensor in that order."""

    def __init__(self, path: str | Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        header: dict[str, object] = {}
        offset = 0
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        header["__metadata__"] = {"format": "pt", **(metadata or {})}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors itself writes it
        self.path, self._specs, self._next = Path(path), specs, 0
        self.sha256 = hashlib.sha256()  # of every byte written: the checkpoint index records it
        self._file = open(self.path, "wb")
        self._write(struct.pack("<Q", len(blob)) + blob)

    def _write(self, data) -> None:
        self._file.write(data)
        self.sha256.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, dtype, shape = self._specs[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: expected {want_name} {dtype} {tuple(shape)}, "
                f"got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._write(data.numpy().data)
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._specs):
            raise CheckpointError(f"{self.path}: only {self._next} of {len(self._specs)} tensors were written")

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2**20, '1000' -> 1000 (the units of Hugging Face's max_shard_size)."""
    units = {
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "B": 1,
    }
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit):
            t, factor = t[: -len(unit)], scale
            break
    else:
        factor = 1
    try:
        value = float(t) * factor
    except ValueError:
        raise CheckpointError(f"size {text!r} not understood; use e.g. 5GB, 500MB, 2GiB or a byte count") from None
    if value <= 0:
        raise CheckpointError(f"size {text!r} must be positive")
    return int(value)


__all__ = [
    "PrefixedSource",
    "StreamingSafetensorsWriter",
    "TensorSource",
    "WeightSource",
    "TensorSpec",
    "load_pickled",
    "parse_size",
]
