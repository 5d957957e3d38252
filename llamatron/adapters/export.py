"""`llamatron export-hf --adapter`: a LoRA checkpoint's adapters as a PEFT adapter directory
(adapter_config.json + adapter_model.safetensors) that peft.PeftModel.from_pretrained loads onto the base model."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from ..errors import CheckpointError
from .merge import ADAPTER_SUFFIXES, MergedLoraReader, open_model_weights
from .peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, peft_tensors


def export_adapter(ckpt: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write the adapters of LoRA checkpoint `ckpt` in PEFT's format into the new directory `out_dir`."""
    reader = open_model_weights(ckpt)
    if not isinstance(reader, MergedLoraReader):
        raise CheckpointError(f"{reader.step_dir} holds no LoRA adapters; export it without --adapter")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not empty; export into a new directory")
    lora = reader.lora
    tensors = {}
    for t in lora.targets:
        a, b = (reader.adapter(f"{t.module}{s}") for s in ADAPTER_SUFFIXES)
        tensors.update(peft_tensors(t, a, b, lora.rank))
    saved = reader.run_meta["config"]["lora"]
    base = (reader.run_meta.get("hf") or {}).get("source") or str(reader.step_dir)
    config = adapter_config(list(lora.targets), lora.rank, lora.alpha, float(saved.get("lora_dropout", 0.0)), base)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:  # complete or absent: renamed into place once written
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS), {"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"step_dir": str(reader.step_dir), "files": [ADAPTER_CONFIG, ADAPTER_WEIGHTS], "base": base}


__all__ = ["export_adapter"]
