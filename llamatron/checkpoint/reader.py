"""Reading checkpoints: any box of any stored tensor, from whichever pieces hold it.

A checkpoint step directory holds

    meta.json                   step, consumed_samples, resolved config, model config, layout it was saved under
    index.json                  every tensor: full shape, dtype, and its pieces (file, offsets, sizes);
                                each file's sha256, checked when the file is first read
    rank-NNNNN.safetensors      the pieces one rank wrote; the key of a piece is KIND/NAME@OFFSETS
    rng/rank-NNNNN.json         that rank's RNG states (JSON: nothing in a checkpoint is unpickled)

Every path read from a checkpoint (`latest`, the index's files) must name a file inside its directory,
symlinks resolved: a crafted checkpoint cannot make a load read anything else.

Tensors are grouped by kind: `model` (weights), `master` (fp32 master
weights, only when they differ from the weights), `step` (the optimizer's
step count, shape (1,)) and the kinds of state the optimizer declares
(llamatron/optim/: each the shape of its weight), each by the global
parameter name of the single-device model with its unpadded shape.

A directory without index.json is the full-tensor layout that `import-hf`
writes (model.safetensors, and optimizer.safetensors in older checkpoints):
every tensor there is a single piece covering it, so one reader serves both.
Reads use safetensors' lazy slicing: only the overlapping bytes are read.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..dtypes import TORCH_DTYPES
from ..errors import CheckpointError, ForeignCheckpointError
from .pieces import Box

META_FILE, INDEX_FILE = "meta.json", "index.json"
MODEL_FILE, OPTIM_FILE = "model.safetensors", "optimizer.safetensors"  # the full-tensor layout (imports)
FORMAT = "llamatron-pieces/1"


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
    return f"rng/rank-{rank:05d}.json"


def inside(directory: Path, name: str, what: str) -> Path:
    """directory/name, refused unless it resolves (symlinks followed) to a path inside `directory`."""
    if not isinstance(name, str) or not name or Path(name).is_absolute():
        raise CheckpointError(f"{what} names {name!r}, not a file of {directory}; refusing to read it")
    path = directory / name
    if not path.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(f"{what} names {name!r}, outside {directory}; refusing to read it")
    return path


def file_sha256(path: Path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


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
    owner: CheckpointReader | None = None  # the base checkpoint that stores it (None: this one)


def step_number(name: str) -> int | None:
    """N of a checkpoint directory's name step-N, else None."""
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """(N, path) of the step-N directories in a checkpoint root, by N; none when root is not a directory."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((n, d) for d in root.iterdir() if (n := step_number(d.name)) is not None and d.is_dir())


def is_complete(step_dir: Path) -> bool:
    """meta.json is written last of a step's files, then the directory is renamed: its presence means done."""
    return (step_dir / META_FILE).is_file()


def intact_copy(root: Path, name: str) -> Path | None:
    """A complete copy of step `name` left beside it by a save killed while replacing it (writer._publish moves
    the old copy to .old-NAME before the new one, a complete .tmp-NAME, takes its place): the new one first."""
    for candidate in (root / f".tmp-{name}", root / f".old-{name}"):
        if is_complete(candidate):
            return candidate
    return None


def latest_name(root: Path) -> str | None:
    """The step `root/latest` names (None without one); a name that is not a step directory is refused."""
    latest = root / "latest"
    if not latest.is_file():
        return None
    name = latest.read_text(errors="replace").strip()
    if step_number(name) is None:
        raise CheckpointError(f"{latest} names {name!r}, not a step-N directory of {root}; refusing to follow it")
    inside(root, name, str(latest))
    return name


_TOLD: set[Path] = set()


def resolve_checkpoint(path: str | Path) -> Path:
    """DIR (follows DIR/latest) or DIR/step-N -> the step directory."""
    p = Path(path)
    if is_complete(p):
        return p
    name = latest_name(p)
    if name is not None:
        step_dir = p / name
        if is_complete(step_dir):
            return step_dir
        copy = intact_copy(p, name)
        if copy is not None:
            if copy not in _TOLD:  # resolved more than once per load: say it once
                _TOLD.add(copy)
                print(
                    f"llamatron: {step_dir} is missing (a save was killed while replacing it); loading its intact "
                    f"copy {copy}",
                    file=sys.stderr,
                )
            return copy
        raise CheckpointError(f"{p / 'latest'} points to {step_dir}, which is not a complete checkpoint")
    complete = [d for _, d in step_dirs(p) if is_complete(d)]
    if complete:  # `latest` lost (copied without it, say): the complete checkpoints are there to name
        names = ", ".join(d.name for d in complete[-5:])
        raise CheckpointError(
            f"{path} has no `latest` file; load one of its checkpoints by name ({names}), e.g. --load {complete[-1]}"
        )
    foreign = _foreign_format(p)
    if foreign is not None:
        raise ForeignCheckpointError(str(path), *foreign)
    raise CheckpointError(f"no checkpoint at {path}: expected {path}/latest or {path}/{META_FILE}")


def _foreign_format(p: Path) -> tuple[str, str] | None:
    """(what the directory is, the command that converts it) for the formats llamatron imports; None otherwise."""
    if (p / "config.json").is_file():
        return "a Hugging Face model directory", f"`llamatron import-hf {p} OUT`"
    if (p / "params.json").is_file() and any(p.glob("consolidated.*.pth")):
        return "a Meta consolidated checkpoint", f"`llamatron import-hf {p} OUT`"
    if (p / "latest_checkpointed_iteration.txt").is_file():
        return "a Megatron-LM checkpoint", f"`llamatron import-megatron --load {p} --save OUT`"
    return None


def _checked_meta(path: Path) -> dict[str, Any]:
    """meta.json, refused (as damaged) unless it is an object holding the model's config."""
    meta = _read_json(path)
    if not isinstance(meta, dict) or not isinstance(meta.get("model_config"), dict):
        raise _damaged(path, ValueError("no model_config object in it"))
    return meta


def read_meta(path: str | Path) -> dict[str, Any]:
    return _checked_meta(resolve_checkpoint(path) / META_FILE)


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


def _index_from_json(data: Any, where: Path) -> dict[str, dict[str, StoredTensor]]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"{where}: unknown checkpoint format {found!r} (this version reads {FORMAT})")
    try:
        files = data["files"]
        out: dict[str, dict[str, StoredTensor]] = {}
        for kind, by_name in data["tensors"].items():
            out[kind] = {}
            for name, entry in by_name.items():
                pieces = []
                for file_id, offsets, sizes in entry["pieces"]:
                    box = Box(tuple(int(x) for x in offsets), tuple(int(x) for x in sizes))
                    pieces.append(StoredPiece(files[file_id], piece_key(kind, name, box), box))
                out[kind][name] = StoredTensor(tuple(entry["shape"]), TORCH_DTYPES[entry["dtype"]], pieces)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise _damaged(where, ValueError(f"malformed index: {type(err).__name__}: {err}")) from None
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
    """Lazy access to the tensors of one checkpoint; also a TensorSource of its weights (keys/get/meta).

    A checkpoint whose meta.json names a base checkpoint (BASE_KEY: a LoRA run's, which stores only what
    trains) reads the weights it does not store from that base, once the base's fingerprint is the recorded one."""

    merges_adapters = False  # a LoRA checkpoint's weights read as the plain model's (adapters/merge.py) when True

    def __init__(self, path: str | Path, _named_by: tuple[Path, ...] = ()):
        """`_named_by`: the checkpoints whose base chain led here (open_base), so that a cycle is refused."""
        self.step_dir = resolve_checkpoint(path)
        self.run_meta: dict[str, Any] = _checked_meta(self.step_dir / META_FILE)
        index = self.step_dir / INDEX_FILE
        self._handles: dict[str, Any] = {}
        self._checksums: dict[str, str] = {}  # absent in checkpoints written before checksums
        if index.is_file():
            data = _read_json(index)
            self.tensors = _index_from_json(data, index)
            sums = data.get("checksums", {})
        else:
            self.tensors = _index_of_full_tensor_files(self.step_dir)
            sums = self.run_meta.get("checksums", {})  # an import's model.safetensors (hf_io.py)
        self._checksums = sums if isinstance(sums, dict) else {}
        if BASE_KEY in self.run_meta:
            base = open_base(self.step_dir, self.run_meta[BASE_KEY], _named_by)
            for name, t in base.tensors["model"].items():
                if name not in self.tensors["model"]:
                    self.tensors["model"][name] = StoredTensor(t.shape, t.dtype, t.pieces, t.owner or base)

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
        if t.owner is not None:
            return t.owner.read(kind, name, box)
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
            path = inside(self.step_dir, fname, str(self.step_dir / INDEX_FILE))
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in {self.step_dir / INDEX_FILE} but missing")
            want = self._checksums.get(fname)
            if want is not None and file_sha256(path) != want:
                raise _damaged(path, ValueError("its sha256 differs from the one the index recorded"))
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


BASE_KEY = "base_checkpoint"  # meta.json: {"path": its step directory, "sha256": its fingerprint}


def fingerprint(step_dir: Path) -> str:
    """What identifies a checkpoint's content: the sha256 of its index.json, which records every file's sha256
    (checked on read), or of an import's meta.json, which records its model.safetensors' sha256."""
    index = step_dir / INDEX_FILE
    return file_sha256(index if index.is_file() else step_dir / META_FILE)


def base_reference(path: str | Path) -> dict[str, str]:
    """The meta.json entry naming checkpoint `path` as the base of a run that saves only what it trains."""
    step_dir = resolve_checkpoint(path).resolve()
    return {"path": str(step_dir), "sha256": fingerprint(step_dir)}


def open_base(step_dir: Path, ref: Any, named_by: tuple[Path, ...] = ()) -> CheckpointReader:
    """The base checkpoint a checkpoint names, refused unless it is there and is the one it was trained on, and
    unless it is `step_dir` itself or one of the checkpoints `named_by` whose bases led here (a cycle)."""
    if not isinstance(ref, dict) or not isinstance(ref.get("path"), str) or not isinstance(ref.get("sha256"), str):
        raise _damaged(step_dir / META_FILE, ValueError(f"malformed {BASE_KEY}"))
    base = Path(ref["path"])
    if not is_complete(base):
        raise CheckpointError(
            f"{step_dir} stores only what its run trained; its base checkpoint {base} is gone: put that checkpoint "
            "back at that path"
        )
    if fingerprint(base) != ref["sha256"]:
        raise CheckpointError(
            f"{step_dir} was trained on the base checkpoint {base}, which has changed since (its sha256 differs): "
            "put the original back at that path"
        )
    chain, resolved = (*named_by, step_dir.resolve()), resolve_checkpoint(base).resolve()
    if resolved in chain:
        what = "itself" if resolved == chain[-1] else f"{base}, closing a cycle of base checkpoints"
        raise CheckpointError(
            f"{step_dir / META_FILE}: its {BASE_KEY} names {what}, so no checkpoint holds the frozen base weights; "
            f"it was edited: put back the meta.json its run wrote, which names the checkpoint it was trained from"
        )
    return CheckpointReader(base, chain)


def open_weights(path: str | Path) -> CheckpointReader:
    """The weights of a checkpoint saved under any layout, full tensors by global name."""
    reader = CheckpointReader(path)
    refuse_adapters(reader)
    return reader


def saved_lora_settings(meta: dict[str, Any]) -> dict[str, Any]:
    """The --lora-* settings a checkpoint's run trained with (empty, or lora_rank 0, without LoRA)."""
    return (meta.get("config") or {}).get("lora") or {}


def refuse_adapters(reader: CheckpointReader) -> None:
    """A LoRA run's checkpoint holds the base weights and the adapters apart: read as a plain model without
    merging them it would silently lose the adapters."""
    if not reader.merges_adapters and saved_lora_settings(reader.run_meta).get("lora_rank"):
        raise CheckpointError(
            f"{reader.step_dir} is a LoRA checkpoint (frozen base + adapters) read without merging its adapters; "
            "export it with llamatron export-hf (which merges them) and use the exported model"
        )


def load_full_tensors(path: str | Path, kind: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor of one kind as a full tensor (small models: tests, generation)."""
    reader = CheckpointReader(path)
    return {name: reader.read(kind, name) for name in sorted(reader.names(kind))}


__all__ = [
    "BASE_KEY",
    "FORMAT",
    "INDEX_FILE",
    "META_FILE",
    "MODEL_FILE",
    "OPTIM_FILE",
    "CheckpointReader",
    "StoredPiece",
    "StoredTensor",
    "base_reference",
    "fingerprint",
    "index_to_json",
    "load_full_tensors",
    "open_weights",
    "piece_key",
    "rank_file",
    "read_meta",
    "refuse_adapters",
    "resolve_checkpoint",
    "rng_file",
    "saved_lora_settings",
    "step_dirs",
    "step_number",
]
