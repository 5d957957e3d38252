"""Reading checkpoints: any box of any stored tensor, from whichever pieces hold it.

A checkpoint step directory holds

    meta.json                   step, consumed_samples, resolved config, model config, layout it was saved under
    index.json                  every tensor: full shape, dtype, and its pieces (file, offsets, sizes)
    rank-NNNNN.safetensors      the pieces one rank wrote; the key of a piece is KIND/NAME@OFFSETS
    rng/rank-NNNNN.pt           that rank's RNG states

Tensors are grouped by kind: `model` (weights), `master` (fp32 master
weights, only when they differ from the weights), `exp_avg`, `exp_avg_sq`
(AdamW moments) and `step` (AdamW step count, shape (1,)), each by the global
parameter name of the single-device model with its unpadded shape.

A directory without index.json is the full-tensor layout that `import-hf`
writes (model.safetensors, and optimizer.safetensors in older checkpoints):
every tensor there is a single piece covering it, so one reader serves both.
Reads use safetensors' lazy slicing: only the overlapping bytes are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..dtypes import TORCH_DTYPES
from ..errors import CheckpointError
from .pieces import Box

META_FILE, INDEX_FILE = "meta.json", "index.json"
MODEL_FILE, OPTIM_FILE = "model.safetensors", "optimizer.safetensors"  # the full-tensor layout (imports)
FORMAT = "llamatron-pieces/1"
STATE_KINDS = ("exp_avg", "exp_avg_sq", "master", "step")


_RELOAD = "load another checkpoint (an earlier DIR/step-N) or re-create it"


def _damaged(path: Path, err: Exception, remedy: str = _RELOAD) -> CheckpointError:
    return CheckpointError(f"{path} is truncated or corrupt ({err}); {remedy}")


def open_safetensors(path: Path, remedy: str = _RELOAD):
    """safe_open, with a damaged file reported as a CheckpointError that names it and `remedy`."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # safetensors raises its own SafetensorError (and OSError for I/O)
        raise _damaged(path, err, remedy) from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _damaged(path, err) from None


def piece_key(kind: str, name: str, box: Box) -> str:
    return f"{kind}/{name}@{','.join(map(str, box.offsets))}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng/rank-{rank:05d}.pt"


@dataclass(frozen=True)
class StoredPiece:
    file: str
    key: str
    box: Box


@dataclass
class StoredTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[StoredPiece]


def step_number(name: str) -> int | None:
    """N of a checkpoint directory's name step-N, else None."""
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """(N, path) of the step-N directories in a checkpoint root, by N; none when root is not a directory."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((n, d) for d in root.iterdir() if (n := step_number(d.name)) is not None and d.is_dir())


def resolve_checkpoint(path: str | Path) -> Path:
    """DIR (follows DIR/latest) or DIR/step-N -> the step directory."""
    p = Path(path)
    if (p / META_FILE).is_file():
        return p
    latest = p / "latest"
    if latest.is_file():
        step_dir = p / latest.read_text().strip()
        if (step_dir / META_FILE).is_file():
            return step_dir
        raise CheckpointError(f"{latest} points to {step_dir}, which is not a complete checkpoint")
    complete = [d for _, d in step_dirs(p) if (d / META_FILE).is_file()]
    if complete:  # `latest` lost (copied without it, say): the complete checkpoints are there to name
        names = ", ".join(d.name for d in complete[-5:])
        raise CheckpointError(
            f"{path} has no `latest` file; load one of its checkpoints by name ({names}), e.g. --load {complete[-1]}"
        )
    raise CheckpointError(f"no checkpoint at {path}: expected {path}/latest or {path}/{META_FILE}")


def read_meta(path: str | Path) -> dict[str, Any]:
    return _read_json(resolve_checkpoint(path) / META_FILE)


def index_to_json(files: list[str], tensors: dict[str, dict[str, StoredTensor]]) -> dict[str, Any]:
    file_ids = {f: i for i, f in enumerate(files)}
    return {
        "format": FORMAT,
        "files": files,
        "tensors": {
            kind: {
                name: {
                    "shape": list(t.shape),
                    "dtype": _dtype_name(t.dtype),
                    "pieces": [[file_ids[p.file], list(p.box.offsets), list(p.box.sizes)] for p in t.pieces],
                }
                for name, t in sorted(by_name.items())
            }
            for kind, by_name in tensors.items()
        },
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in TORCH_DTYPES.items()}[dtype]


def _index_from_json(data: dict[str, Any], where: Path) -> dict[str, dict[str, StoredTensor]]:
    if data.get("format") != FORMAT:
        raise CheckpointError(
            f"{where}: unknown checkpoint format {data.get('format')!r} (this version reads {FORMAT})"
        )
    files = data["files"]
    out: dict[str, dict[str, StoredTensor]] = {}
    for kind, by_name in data["tensors"].items():
        out[kind] = {}
        for name, entry in by_name.items():
            pieces = []
            for file_id, offsets, sizes in entry["pieces"]:
                box = Box(tuple(offsets), tuple(sizes))
                pieces.append(StoredPiece(files[file_id], piece_key(kind, name, box), box))
            out[kind][name] = StoredTensor(tuple(entry["shape"]), TORCH_DTYPES[entry["dtype"]], pieces)
    return out


def _index_of_full_tensor_files(step_dir: Path) -> dict[str, dict[str, StoredTensor]]:
    """model.safetensors (NAME) and optimizer.safetensors (NAME.KIND): one piece per tensor."""
    out: dict[str, dict[str, StoredTensor]] = {"model": {}}
    for fname in (MODEL_FILE, OPTIM_FILE):
        if not (step_dir / fname).is_file():
            continue
        with open_safetensors(step_dir / fname) as f:
            for key in f.keys():
                kind, name = "model", key
                if fname == OPTIM_FILE:
                    name, kind = key.rsplit(".", 1)
                s = f.get_slice(key)
                shape = tuple(s.get_shape())
                out.setdefault(kind, {})[name] = StoredTensor(
                    shape, TORCH_DTYPES[s.get_dtype()], [StoredPiece(fname, key, Box.whole(shape))]
                )
    if not out["model"]:
        raise CheckpointError(f"{step_dir}: neither {INDEX_FILE} nor {MODEL_FILE}; not a checkpoint")
    return out


class CheckpointReader:
    """Lazy access to the tensors of one checkpoint; also a TensorSource of its weights (keys/get/meta)."""

    def __init__(self, path: str | Path):
        self.step_dir = resolve_checkpoint(path)
        self.run_meta: dict[str, Any] = _read_json(self.step_dir / META_FILE)
        index = self.step_dir / INDEX_FILE
        self.tensors = (
            _index_from_json(_read_json(index), index)
            if index.is_file()
            else _index_of_full_tensor_files(self.step_dir)
        )
        self._handles: dict[str, Any] = {}

    def has(self, kind: str, name: str | None = None) -> bool:
        return kind in self.tensors and (name is None or name in self.tensors[kind])

    def names(self, kind: str = "model") -> set[str]:
        return set(self.tensors.get(kind, {}))

    def stored(self, kind: str, name: str) -> StoredTensor:
        try:
            return self.tensors[kind][name]
        except KeyError:
            raise CheckpointError(f"{self.step_dir} holds no {kind} tensor {name}") from None

    def read(self, kind: str, name: str, box: Box | None = None) -> torch.Tensor:
        """The block `box` (default: all) of the full tensor, in the stored dtype."""
        t = self.stored(kind, name)
        box = box or Box.whole(t.shape)
        out = torch.empty(box.sizes, dtype=t.dtype)
        covered = 0
        for piece in t.pieces:
            part = piece.box.intersect(box)
            if part is None:
                continue
            try:
                block = self._handle(piece.file).get_slice(piece.key)[part.slices_within(piece.box)]
            except CheckpointError:
                raise
            except Exception as err:  # a header that promises more bytes than the file holds
                raise _damaged(self.step_dir / piece.file, err) from None
            out[part.slices_within(box)] = block
            covered += part.numel()
        if covered != box.numel():  # pieces never overlap, so this counts exactly the elements found
            raise CheckpointError(
                f"{self.step_dir}: {kind} {name} offsets {box.offsets} sizes {box.sizes}: only "
                f"{covered} of {box.numel()} elements are stored"
            )
        return out

    def _handle(self, fname: str):
        if fname not in self._handles:
            path = self.step_dir / fname
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in {self.step_dir / INDEX_FILE} but missing")
            self._handles[fname] = open_safetensors(path)
        return self._handles[fname]

    # The TensorSource interface (tensor_io.py) over the weights, for export-hf.
    def keys(self) -> set[str]:
        return self.names("model")

    def get(self, name: str) -> torch.Tensor:
        return self.read("model", name)

    def meta(self, name: str) -> torch.Tensor:
        t = self.stored("model", name)
        return torch.empty(t.shape, dtype=t.dtype, device="meta")


def open_weights(path: str | Path) -> CheckpointReader:
    """The weights of a checkpoint saved under any layout, full tensors by global name."""
    return CheckpointReader(path)


def load_full_tensors(path: str | Path, kind: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor of one kind as a full tensor (small models: tests, generation)."""
    reader = CheckpointReader(path)
    return {name: reader.read(kind, name) for name in sorted(reader.names(kind))}


__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "META_FILE",
    "MODEL_FILE",
    "OPTIM_FILE",
    "STATE_KINDS",
    "CheckpointReader",
    "StoredPiece",
    "StoredTensor",
    "index_to_json",
    "load_full_tensors",
    "open_weights",
    "piece_key",
    "rank_file",
    "read_meta",
    "resolve_checkpoint",
    "rng_file",
    "step_dirs",
    "step_number",
]
