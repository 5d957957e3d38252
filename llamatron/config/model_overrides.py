"""`--model-override FIELD=VALUE`: a field of the --model preset changed on the command line, as a --config file's
`model_overrides: {FIELD: VALUE}` changes it (the flag wins over the file, field by field).

Every ModelConfig field can be given, so no model option needs a flag of its own; Megatron-LM's flags for the
mixture-of-experts options whose meaning differs (its capacity factor, balancing type) stay unaliased
(megatron_flags.py) and these are the way to set ours.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..errors import ConfigError, did_you_mean
from ..models.config import field_value_problem
from ..models.families import CONFIG_FIELDS

FLAG = "--model-override"
MODEL_FIELDS = tuple(CONFIG_FIELDS)  # ModelConfig's fields and every family config's own


def add_model_override_argument(parser: argparse.ArgumentParser, default: Any = argparse.SUPPRESS) -> None:
    parser.add_argument(
        FLAG,
        action="append",
        dest="model_override",
        default=default,
        metavar="FIELD=VALUE",
        help="change a field of the --model preset (any field of llamatron/models/config.py's ModelConfig, or of "
        "its family's config, e.g. "
        "num_layers=8, moe_capacity_factor=1.25, router_aux_loss_scope=global_batch); VALUE is read as YAML "
        "(4, 0.5, true, null, a word); repeatable; over the --config file's model_overrides, field by field",
    )


@dataclass
class FlagOverrides:
    """The model fields the --model-override flags set, and each one's flag as typed (for the errors that name
    the setting to fix)."""

    values: dict[str, Any] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)


def parse_model_overrides(items: list[str] | None) -> FlagOverrides:
    """The --model-override FIELD=VALUE flags, checked: a known field (did you mean ...), a value of its type;
    raises ConfigError naming the flag and the fix. A later flag for the same field wins, as a repeated flag does."""
    out = FlagOverrides()
    for item in items or []:
        name, equals, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not equals or not name:
            raise ConfigError(f"{FLAG} {item!r}: give FIELD=VALUE, e.g. {FLAG} {name or 'num_layers'}=4")
        if name not in MODEL_FIELDS:
            fix = did_you_mean(name, MODEL_FIELDS) or " (the fields are llamatron/models/config.py's ModelConfig)"
            raise ConfigError(f"{FLAG} {item}: unknown model field {name!r}{fix}")
        value = _value(item, name, text)
        out.values[name] = value
        out.flags[name] = f"{FLAG} {item}"
    return out


def _value(item: str, name: str, text: str) -> Any:
    """VALUE as YAML reads a scalar (safe_load: plain data, nothing constructed), of the field's type."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        why = str(getattr(e, "problem", None) or e).splitlines()[0]
        raise ConfigError(f"{FLAG} {item}: {text!r} is not a YAML value ({why}); quote it or give a number") from None
    owner = CONFIG_FIELDS[name]
    problem = field_value_problem(name, value, owner)
    if problem is not None and isinstance(value, str):  # YAML reads `1e-3` (no dot) as text: a flag means a number
        for number in (int, float):
            try:
                if field_value_problem(name, number(value), owner) is None:
                    return number(value)
            except ValueError:
                pass
    if problem is None:
        return value
    word = isinstance(value, bool) or value is None  # `no`, `on`, `null`: words YAML reads as no text
    if word and isinstance(owner.__dataclass_fields__[name].default, str):
        problem += f" (YAML reads {text!r} as {value!r}: quote the word, {FLAG} \"{name}='{text}'\")"
    raise ConfigError(f"{FLAG} {item}: {problem}")


def merged_overrides(from_file: dict, alias_flags: dict[str, str], flagged: FlagOverrides) -> dict:
    """The config file's model_overrides with the flags' over them; a field set by both a Megatron-LM alias
    (`alias_flags`: field -> the flag as typed) and --model-override is an error."""
    both = sorted(set(alias_flags) & set(flagged.values))
    if both:
        raise ConfigError(f"{alias_flags[both[0]]} and {flagged.flags[both[0]]} both set {both[0]}: give one of them")
    return {**from_file, **flagged.values}
