"""`llamatron export-hf --adapter`: a LoRA checkpoint's adapters as a PEFT adapter directory
(adapter_config.json + adapter_model.safetensors) that peft.PeftModel.from_pretrained loads onto the base model,
and whose base_model_name_or_path is the Hugging Face directory of that base (AutoPeftModelForCausalLM)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..checkpoint.reader import BASE_KEY, read_meta
from ..errors import CheckpointError
from ..interop.hf_io import HFWeights
from .merge import ADAPTER_SUFFIXES, MergedLoraReader, open_model_weights
from .peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, peft_tensors


def export_adapter(ckpt: str | Path, out_dir: str | Path, base_model: str | Path | None = None) -> dict[str, Any]:
    """Write the adapters of LoRA checkpoint `ckpt` in PEFT's format into the new directory `out_dir`, naming as
    their base `base_model` (a Hugging Face directory of the base, checked) or else the one found (base_for).
    The summary's "export_base" is the command that writes the base's directory where it is not yet."""
    reader = open_model_weights(ckpt)
    if not isinstance(reader, MergedLoraReader):
        raise CheckpointError(f"{reader.step_dir} holds no LoRA adapters; export it without --adapter")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not empty; export into a new directory")
    if base_model is not None:
        problem = base_dir_problem(reader, Path(base_model))
        if problem:
            raise CheckpointError(f"--base-model {base_model}: {problem}; give the base's Hugging Face directory")
    base, export_base = (str(Path(base_model).resolve()), None) if base_model is not None else base_for(reader, out)
    lora = reader.lora
    tensors = {}
    for t in lora.targets:
        a, b = (reader.adapter(f"{t.module}{s}") for s in ADAPTER_SUFFIXES)
        tensors.update(peft_tensors(t, a, b, lora.rank))
    saved = reader.run_meta["config"]["lora"]
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
    return {
        "step_dir": str(reader.step_dir),
        "files": [ADAPTER_CONFIG, ADAPTER_WEIGHTS],
        "base": base,
        "export_base": export_base,
    }


_VOCABULARY = ("embed.weight", "lm_head.weight")


def base_for(reader: MergedLoraReader, out: Path) -> tuple[str, str | None]:
    """The Hugging Face directory of the adapters' base, and the command that writes it where there is none yet:
    the directory the base checkpoint was imported from, else CHECKPOINT-step-N-hf beside the adapter (export-hf of
    the base checkpoint, or of this checkpoint --without-adapters where it holds its base itself)."""
    ref = reader.run_meta.get(BASE_KEY)
    base_ckpt = Path(ref["path"]) if isinstance(ref, dict) else None
    if base_ckpt is not None:
        meta = read_meta(base_ckpt)
        source = (meta.get("hf") or {}).get("source")
        # Only an import holds the source's weights: a fine-tune of it carries the source's name but not its weights.
        if meta.get("weights_only") and source and not base_dir_problem(reader, Path(source)):
            return source, None
    holder = base_ckpt or reader.step_dir  # the step directory holding the base's weights
    default = (out.parent / f"{holder.parent.name}-{holder.name}-hf").resolve()  # found by the next export beside
    if default.is_dir() and not base_dir_problem(reader, default):
        return str(default), None
    command = f"llamatron export-hf {holder} {default}"
    return str(default), command if base_ckpt else f"{command} --without-adapters"


def base_dir_problem(reader: MergedLoraReader, hf_dir: Path) -> str | None:
    """Why `hf_dir` is not the Hugging Face directory of the model the adapters were trained on (None: it is):
    every weight of the same shape, and the 1-D ones (norms, biases: cheap to read) of the same values, as
    `hf_dir`'s dtype holds them."""
    if not (hf_dir / "config.json").is_file():
        return "no config.json there"
    try:
        theirs = HFWeights(hf_dir)
    except CheckpointError as e:
        return str(e)
    ours = {n: reader.meta(n) for n in reader.keys()}
    if set(ours) != set(theirs.rules):
        return f"another architecture ({len(set(ours) ^ set(theirs.rules))} tensors differ)"
    for name, t in ours.items():
        rule = theirs.rules[name]
        shape = rule.fuse([theirs.source.meta(n) for n in rule.hf_names]).shape
        padded = name in _VOCABULARY and t.shape[0] > shape[0]  # rows for tensor parallelism, not exported
        if t.shape[1:] != shape[1:] or (t.shape[0] != shape[0] and not padded):
            return f"{name} is {tuple(shape)} there, {tuple(t.shape)} in the base"
        if t.dim() == 1:
            got = theirs.read("model", name)
            if not torch.equal(reader.read("model", name).to(got.dtype), got):
                return f"another model of the same shape ({name} differs)"
    return None


__all__ = ["export_adapter"]
