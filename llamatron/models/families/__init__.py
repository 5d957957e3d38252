"""The registry of model families: each family is a folder here (its layers, presets, Hugging Face format) and one
line below. Everything else finds a family through these functions, by the name a ModelConfig carries or by a
config.json's model_type; nothing outside this folder branches on a family's name."""

from __future__ import annotations

from collections.abc import Callable

from ...errors import did_you_mean
from ..config import ModelConfig
from ..family import Family, MegatronFormat, MetaFormat
from . import falcon, llama, llama4, qwen

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (llama.FAMILY, falcon.FAMILY, qwen.FAMILY, llama4.FAMILY)  # one entry a family
}

_PRESETS: dict[str, Callable[[], ModelConfig]] = {n: p for f in FAMILIES.values() for n, p in f.presets.items()}
PRESET_NAMES = sorted(_PRESETS)
DEFAULT_PRESET = "llama-tiny"  # the demo's model, and --model's default


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is not one of {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def family_of(cfg: ModelConfig) -> Family:
    return get_family(cfg.family)


def family_for_model_type(model_type: object) -> Family | None:
    """The family whose Hugging Face format reads config.json's `model_type` (None: no family does)."""
    return next((f for f in FAMILIES.values() if model_type in f.hf.model_types), None)


def meta_format() -> MetaFormat | None:
    """How Meta's consolidated checkpoints map to Hugging Face names (the family that has them; None: none)."""
    return next((f.meta_format for f in FAMILIES.values() if f.meta_format is not None), None)


def megatron_format() -> MegatronFormat | None:
    """How Megatron-LM runs map to Hugging Face names (the family that has them; None: none)."""
    return next((f.megatron_format for f in FAMILIES.values() if f.megatron_format is not None), None)


def hf_model_types() -> list[str]:
    return [t for f in FAMILIES.values() for t in f.hf.model_types]


def get_preset(name: str) -> ModelConfig:
    if name not in _PRESETS:
        near = did_you_mean(name, PRESET_NAMES)
        raise ValueError(f"unknown model preset {name!r}{near}; choose one of: {', '.join(PRESET_NAMES)}")
    return _PRESETS[name]()


def model_problems(cfg: ModelConfig) -> list[str]:
    """Why `cfg` cannot be built (empty when it can): its shape's rules (ModelConfig.problems), its family, the
    options its family has, and the family's own rules."""
    out = cfg.problems()
    if out:
        return out
    if cfg.family not in FAMILIES:
        return [f"family {cfg.family!r} is not one of {', '.join(sorted(FAMILIES))}"]
    family = FAMILIES[cfg.family]
    for option in cfg.changed_options():
        if option not in family.options:
            having = sorted(f.name for f in FAMILIES.values() if option in f.options)
            out.append(
                f"{option}={getattr(cfg, option)!r}: the {family.name} family's layers have no such option"
                + (f" (families with it: {', '.join(having)})" if having else "")
            )
    return out + family.problems(cfg)


__all__ = [
    "DEFAULT_PRESET",
    "FAMILIES",
    "PRESET_NAMES",
    "family_for_model_type",
    "family_of",
    "get_family",
    "get_preset",
    "hf_model_types",
    "megatron_format",
    "meta_format",
    "model_problems",
]
