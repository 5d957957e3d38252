"""The registry of model families: each family is a folder here (its layers, presets, Hugging Face format) and one
line below. Everything else finds a family through these functions, by the name a ModelConfig carries or by a
config.json's model_type; nothing outside this folder branches on a family's name."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import fields
from typing import Any

from ...errors import did_you_mean
from ..config import ModelConfig
from ..family import Family, MegatronFormat, MetaFormat
from . import deepseek_v3, falcon, llama, llama4, qwen

FAMILIES: dict[str, Family[Any]] = {
    f.name: f
    for f in (llama.FAMILY, falcon.FAMILY, qwen.FAMILY, llama4.FAMILY, deepseek_v3.FAMILY)  # one entry a family
}

_PRESETS: dict[str, Callable[[], ModelConfig]] = {n: p for f in FAMILIES.values() for n, p in f.presets.items()}
PRESET_NAMES = sorted(_PRESETS)
DEFAULT_PRESET = "llama-tiny"  # the demo's model, and --model's default


def get_family(name: str) -> Family[Any]:
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is not one of {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def family_of(cfg: ModelConfig) -> Family[Any]:
    return get_family(cfg.family)


def family_for_model_type(model_type: object) -> Family[Any] | None:
    """The family whose Hugging Face format reads config.json's `model_type` (None: no family does)."""
    return next((f for f in FAMILIES.values() if model_type in f.hf.model_types), None)


# Every field some family's config has, and the config class that declares it (the --model-override flags are
# read before the preset, whose class then checks them again)
CONFIG_FIELDS: dict[str, type[ModelConfig]] = {
    **{name: family.config_class for family in FAMILIES.values() for name in family.config_class.own_fields()},
    **{f.name: ModelConfig for f in fields(ModelConfig)},
}


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """A model config from its fields (a checkpoint's meta.json), of its family's config class; ValueError for an
    unknown family or field."""
    if not isinstance(d, dict):
        raise ValueError(f"a model config is a mapping of its fields, not {type(d).__name__}")
    family = d.get("family")
    if family not in FAMILIES:
        raise ValueError(f"model family {family!r} is not one of {', '.join(sorted(FAMILIES))}")
    cls = FAMILIES[family].config_class
    # Checkpoints written while every option was a field of one config carry other families' options at their
    # defaults: they said nothing, and are dropped (an option set to anything else is still refused).
    foreign = {k for k, v in d.items() if k not in cls.__dataclass_fields__ and k in CONFIG_FIELDS and v == _default(k)}
    return cls.from_dict({k: v for k, v in d.items() if k not in foreign})


def _default(name: str) -> Any:
    return CONFIG_FIELDS[name].__dataclass_fields__[name].default


def families_with_field(name: str) -> list[str]:
    """The families whose config class has field `name` (every family for a ModelConfig field)."""
    return [f.name for f in FAMILIES.values() if name in f.config_class.__dataclass_fields__]


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


def model_problems(cfg: ModelConfig, given: Collection[str] = ()) -> list[str]:
    """Why `cfg` cannot be built (empty when it can): its shape's rules (ModelConfig.problems), its family, the
    options its family has, and the family's own rules. `given`: the fields the user set (flags, YAML
    model_overrides): a mixture-of-experts setting among them is refused on a dense model even at its default,
    where it would do nothing (ModelConfig.problems sees only values that differ)."""
    out = cfg.problems()
    if cfg.num_experts == 0:
        defaults = {f.name: f.default for f in fields(cfg)}
        out += [
            f"{name} {getattr(cfg, name)} was given, but it is a mixture-of-experts setting and this model is dense "
            "(num_experts 0): remove it, or give the model experts"
            for name in given
            if name in cfg.moe_settings and getattr(cfg, name) == defaults[name]  # the others: cfg.problems said so
        ]
    if out:
        return out
    if cfg.family not in FAMILIES:
        return [f"family {cfg.family!r} is not one of {', '.join(sorted(FAMILIES))}"]
    family = FAMILIES[cfg.family]
    if not isinstance(cfg, family.config_class):
        return [f"a {family.name} model's config is a {family.config_class.__name__}, not {type(cfg).__name__}"]
    for option in cfg.changed_options():
        if option not in family.options:
            having = sorted(f.name for f in FAMILIES.values() if option in f.options)
            out.append(
                f"{option}={getattr(cfg, option)!r}: the {family.name} family's layers have no such option"
                + (f" (families with it: {', '.join(having)})" if having else "")
            )
    return out + family.problems(cfg)


__all__ = [
    "CONFIG_FIELDS",
    "DEFAULT_PRESET",
    "FAMILIES",
    "PRESET_NAMES",
    "config_from_dict",
    "families_with_field",
    "family_for_model_type",
    "family_of",
    "get_family",
    "get_preset",
    "hf_model_types",
    "megatron_format",
    "meta_format",
    "model_problems",
]
