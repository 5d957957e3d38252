"""The files of a Megatron-LM checkpoint in its legacy (torch) layout, found and unpickled safely.

    DIR/latest_checkpointed_iteration.txt        an iteration number, or "release"
    DIR/iter_0001000/mp_rank_TT/model_optim_rng.pt        tensor-parallel rank TT (no pipeline)
    DIR/iter_0001000/mp_rank_TT_PPP/model_optim_rng.pt    tensor rank TT, pipeline stage PPP

Each file is a pickle of a dict: "model" (or "model0", "model1", ... with virtual pipeline stages) holds the
weights of that rank, "args" the argparse.Namespace of the run. A pickle can name any Python callable, so
nothing is unpickled except tensors, containers and the few harmless classes in `_ALLOWED`: anything else is
refused with its name before loading (torch's weights_only unpickler enforces the same while loading).
"""

from __future__ import annotations

import argparse
import io
import pickle
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint.reader import inside
from ..errors import CheckpointError

try:  # numpy 2
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]

LATEST_FILE = "latest_checkpointed_iteration.txt"
SHARD_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")


class MegatronEnum:
    """What an enum member of Megatron's code in a checkpoint's args unpickles to: its value, nothing run.
    (An Enum pickles as a call of its class with the value; this class only stores it.)"""

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


def _enum_stand_in(qualified_name: str) -> tuple[type, str]:
    return type(qualified_name.rsplit(".", 1)[1], (MegatronEnum,), {}), qualified_name


# Megatron's enums that its runs store in `args` (the attention backend, the model type; Megatron-LLM's
# position embedding type), each read as a MegatronEnum.
_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.model.enums.ModelType",
    "megatron.model.enums.PositionEmbeddingType",
    "megatron.model.enums.AttnMaskType",
)
_NUMPY_NUMBERS = (
    *("Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64"),
    *("Float16", "Float32", "Float64", "Complex64", "Complex128"),
)
# numpy arrays (rng_state: numpy's generator state), BytesIO (TransformerEngine's _extra_state; an empty
# bytes pickles as a call of bytes()): data only.
_ALLOWED: list[Any] = [
    argparse.Namespace,
    io.BytesIO,
    bytes,
    np.ndarray,
    np.dtype,
    *(getattr(np.dtypes, f"{kind}DType") for kind in _NUMPY_NUMBERS),  # what numpy.dtype(...) builds
    (_reconstruct, "numpy.core.multiarray._reconstruct"),  # as numpy 1 saves it
    (_reconstruct, "numpy._core.multiarray._reconstruct"),  # numpy 2
    *(_enum_stand_in(name) for name in _ENUMS),
]
_ALLOWED_NAMES = {"argparse.Namespace", "_io.BytesIO", "builtins.bytes", "numpy.ndarray", "numpy.dtype"} | {
    entry[1] for entry in _ALLOWED if isinstance(entry, tuple)
}


def load_megatron_file(path: Path) -> dict[str, Any]:
    """The dict pickled in `path`, unpickling nothing but tensors, containers and `_ALLOWED`."""
    if zipfile.is_zipfile(path):  # torch >= 1.6 format: its pickle can be read without running it
        refused = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - _ALLOWED_NAMES)
        if refused:
            raise CheckpointError(_refusal(path, refused))
    try:
        with torch.serialization.safe_globals(_ALLOWED):
            try:
                state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped: read whole
                state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # the legacy format, scanned only while loading
        names = re.findall(r"GLOBAL ([\w.]+)", str(e))
        raise CheckpointError(_refusal(path, names) if names else f"{path} cannot be unpickled safely: {e}") from None
    except (OSError, EOFError, RuntimeError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}); is it a complete Megatron checkpoint file?") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a Megatron checkpoint dict, found {type(state).__name__}")
    return state


def _refusal(path: Path, names: list[str]) -> str:
    return (
        f"{path} holds {', '.join(names)}, which llamatron does not unpickle (a pickle's classes can run any "
        f"code; only tensors, argparse.Namespace, numpy arrays and Megatron's enums are read); if you trust the "
        f"file, re-save its 'model' and 'args' without it"
    )


def iteration_dir(load: Path, iteration: int | None) -> Path:
    """DIR/iter_NNNNNNN (or DIR/release) of `iteration`, else of latest_checkpointed_iteration.txt."""
    if not load.is_dir():
        raise CheckpointError(f"--load {load} is not a directory")
    if iteration is None:
        latest = load / LATEST_FILE
        if not latest.is_file():
            raise CheckpointError(
                f"{load} has no {LATEST_FILE}; pass --iteration N for DIR/iter_NNNNNNN, or --load the directory "
                f"Megatron saved into"
            )
        text = latest.read_text(encoding="utf-8", errors="replace").strip()
        # ASCII digits only, and no more than an iteration can have: str.isdigit also takes '²' and other scripts'
        # digits, and int() refuses past 4300 digits (both ended in tracebacks)
        if text != "release" and not (text.isascii() and text.isdigit() and len(text) <= 18):
            raise CheckpointError(
                f"{latest} holds {text[:80]!r}, not an iteration number or 'release'; pass --iteration N"
            )
        name = "release" if text == "release" else f"iter_{int(text):07d}"
    else:
        name = f"iter_{iteration:07d}"
    path = inside(load, name, f"{load / LATEST_FILE if iteration is None else '--iteration'}")
    if not path.is_dir():
        have = sorted(
            p.name for p in load.iterdir() if p.is_dir() and (p.name.startswith("iter_") or p.name == "release")
        )
        raise CheckpointError(f"{path} does not exist; {load} has {', '.join(have) or 'no iteration directories'}")
    return path


@dataclass(frozen=True)
class ShardGrid:
    """The model_optim_rng.pt of every (tensor rank, pipeline stage) of one iteration."""

    tp: int
    pp: int
    files: dict[tuple[int, int], Path]

    def path(self, tp_rank: int, pp_rank: int) -> Path:
        return self.files[(tp_rank, pp_rank)]


def find_shards(iter_dir: Path) -> ShardGrid:
    """Every mp_rank_* directory of `iter_dir`, checked to form a full tp x pp grid."""
    found: dict[tuple[int, int], Path] = {}
    pipeline_named = set()
    for entry in sorted(iter_dir.iterdir()):
        m = _RANK_DIR.fullmatch(entry.name)
        if not m:
            continue
        if m.group(3) is not None:
            raise CheckpointError(
                f"{entry}: an expert-parallel shard (mixture of experts); llamatron imports dense models"
            )
        pipeline_named.add(m.group(2) is not None)
        found[(int(m.group(1)), int(m.group(2) or 0))] = inside(iter_dir, f"{entry.name}/{SHARD_FILE}", str(entry))
    if not found:
        raise CheckpointError(_no_shards(iter_dir))
    if len(pipeline_named) > 1:
        raise CheckpointError(f"{iter_dir} mixes mp_rank_TT and mp_rank_TT_PPP directories; it is not one checkpoint")
    tp, pp = 1 + max(t for t, _ in found), 1 + max(p for _, p in found)
    missing = [
        f"mp_rank_{t:02d}" + (f"_{p:03d}" if pipeline_named == {True} else "")
        for t in range(tp)
        for p in range(pp)
        if (t, p) not in found
    ]
    if missing:
        raise CheckpointError(
            f"{iter_dir} has {len(found)} of the {tp * pp} shards of tp {tp} x pp {pp}: missing {', '.join(missing)}"
        )
    absent = [str(p) for p in found.values() if not p.is_file()]
    if absent:
        raise CheckpointError(f"{absent[0]} does not exist ({len(absent)} shard file(s) missing)")
    return ShardGrid(tp, pp, found)


def _no_shards(iter_dir: Path) -> str:
    if any(iter_dir.glob("*.distcp")) or (iter_dir / "metadata.json").is_file():
        return (
            f"{iter_dir} is a torch_dist (distributed) checkpoint; llamatron reads the legacy layout: save it with "
            f"Megatron's --ckpt-format torch (or convert it with its tools/checkpoint/convert.py)"
        )
    return f"{iter_dir} has no mp_rank_* directories; is it an iteration directory of a Megatron checkpoint?"


def flat_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, leaf) of a nested state dict: {"a": {"b.c": t}} -> ("a.b.c", t)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from flat_tensors(value, f"{prefix}{key}." if prefix or key else "")
    else:
        yield prefix.removesuffix("."), tree


__all__ = ["MegatronEnum", "ShardGrid", "find_shards", "flat_tensors", "iteration_dir", "load_megatron_file"]
