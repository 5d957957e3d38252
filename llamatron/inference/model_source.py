"""A model to evaluate from a llamatron checkpoint (any layout, a LoRA one merged) or a Hugging Face directory
(converted tensor by tensor as it loads, as import-hf would, with nothing written), and the tokenizer it names."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import read_meta, read_model_config
from ..checkpoint.loading import read_weights
from ..interop.hf import config_from_hf
from ..interop.hf_io import HFWeights, open_hf_dir
from ..interop.meta_consolidated import is_meta_checkpoint
from ..models import ModelConfig, Transformer, build_model
from ..models.init import to_empty
from ..parallel.param_spec import param_specs
from .generate import load_for_generation


def is_hf_dir(path: str) -> bool:
    """A Hugging Face directory (config.json) or Meta's consolidated.*.pth; else a llamatron checkpoint."""
    d = Path(path)
    return d.is_dir() and ((d / "config.json").is_file() or is_meta_checkpoint(d))


def recorded_tokenizer(path: str) -> str | None:
    """The tokenizer a checkpoint records (or a Hugging Face directory ships); None where there is none. Reads
    only metadata: the model is not loaded."""
    if is_hf_dir(path):
        open_hf_dir(path)  # config.json and weights are there: checked before any tokenizer question
        names = ("tokenizer.json", "tokenizer.model")
        return path if any((Path(path) / n).is_file() for n in names) else None
    meta = read_meta(path)
    return meta.get("tokenizer") or (meta.get("config") or {}).get("data", {}).get("tokenizer")


def model_config(path: str) -> ModelConfig:
    """The model's config, read before any weight."""
    return config_from_hf(open_hf_dir(path)[0]) if is_hf_dir(path) else read_model_config(path)


def load_model(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Transformer:
    """The whole model of `path` on one device, in `dtype`, in eval mode."""
    if not is_hf_dir(path):
        return load_for_generation(str(path), str(device), dtype)[0]
    reader = HFWeights(path)
    model = build_model(reader.cfg, device="meta")
    specs = param_specs(model)
    model.to(dtype=dtype)  # still on meta: free
    to_empty(model, device)
    read_weights(reader, ((p, specs[name]) for name, p in model.named_parameters()))
    return model.eval()
