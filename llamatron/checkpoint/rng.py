"""Each rank's random-number-generator states in a checkpoint: JSON, so that loading one unpickles nothing.

Python's `random` state is a tuple of ints, NumPy's MT19937 state an array of 624 words plus three scalars, and
torch's CPU and CUDA states byte tensors (stored base64). A file that does not have exactly that shape is
refused as damaged; an older checkpoint's pickled `rng/rank-*.pt` is never opened (it could run code).
"""

from __future__ import annotations

import base64
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError


def _bytes(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This process's generator states, as JSON-ready values."""
    version, words, gauss = random.getstate()
    key, state, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "python": {"version": version, "state": list(words), "gauss": gauss},
        "numpy": {
            "key": key,
            "state": [int(x) for x in state],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": cached,
        },
        "torch": _bytes(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss"]))
    np.random.set_state(
        (
            str(npy["key"]),
            np.asarray(npy["state"], dtype=np.uint32),
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["cached"]),
        )
    )
    torch.set_rng_state(_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor(s) for s in state["cuda"]])


def write_rng(path: Path, state: dict[str, Any]) -> None:
    path.write_text(json.dumps(state, separators=(",", ":")))


def restore_rng(path: Path) -> None:
    """Set this process's generators from `path`; a missing file warns (the run goes on with fresh states)."""
    if not path.is_file():
        legacy = path.with_suffix(".pt")
        why = "pickled in an older format, which is never loaded" if legacy.is_file() else "missing"
        print(
            f"llamatron: warning: {path.name if why == 'missing' else legacy} is {why}: this rank's random "
            "states are not restored (training continues; random draws differ from the saving run)",
            file=sys.stderr,
        )
        return
    try:
        set_rng_state(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError, RuntimeError) as err:
        raise CheckpointError(
            f"{path} is truncated or corrupt ({type(err).__name__}: {err}); load another checkpoint "
            "(an earlier DIR/step-N) or delete this file to resume without its random states"
        ) from None
