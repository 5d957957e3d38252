"""Megatron-LM's flag names, accepted where they mean exactly what one of llamatron's settings means.

Users of Megatron-LLaMA and Megatron-LLM bring launch scripts full of them. Each alias is a second spelling of
the same setting (`--tensor-model-parallel-size 8` is `--tp 8`), never a conversion: flags whose Megatron
meaning differs (`--lr-decay-iters`, `--lr-warmup-fraction`) are not aliased: NOT_ALIASED says what to give
instead, in the unknown-flag error. The model-shape flags set the matching `model_overrides` key.
docs/megatron.md lists them.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError

# llamatron setting -> Megatron-LM's flags for it
SETTING_ALIASES: dict[str, tuple[str, ...]] = {
    "tp": ("--tensor-model-parallel-size",),
    "pp": ("--pipeline-model-parallel-size",),
    "cp": ("--context-parallel-size",),
    "ep": ("--expert-model-parallel-size",),
    "etp": ("--expert-tensor-parallel-size",),
    "train_steps": ("--train-iters",),
    "warmup_steps": ("--lr-warmup-iters",),
    "distributed_optimizer": ("--use-distributed-optimizer",),
    "data": ("--data-path",),
}

# The namespace key an alias writes (beside the setting's own), so that the two given together are told apart
ALIAS_DEST = "alias:"

# Megatron-LM's model-shape flag -> the ModelConfig field it sets through model_overrides
MODEL_ALIASES: dict[str, str] = {
    "--num-layers": "num_layers",
    "--hidden-size": "hidden_size",
    "--num-attention-heads": "num_heads",
    "--num-query-groups": "num_kv_heads",
    "--ffn-hidden-size": "ffn_hidden_size",
    "--max-position-embeddings": "max_seq_length",
    "--num-experts": "num_experts",
    "--moe-router-topk": "experts_per_token",
    "--moe-aux-loss-coeff": "router_aux_loss_coef",
    "--moe-z-loss-coeff": "router_z_loss_coef",
    "--moe-router-bias-update-rate": "router_bias_update_rate",
}
# The model-shape flags that take a number with a fraction (the others are integers)
_FLOAT_FIELDS = {"router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"}

# Megatron-LM's precision switches -> --precision
PRECISION_ALIASES = {"--bf16": "bf16", "--fp16": "fp16"}


# Megatron-LM's flags not aliased (the meaning differs, or llamatron spells the setting its own way) -> what to give
# instead, told where a command takes the aliases (train, bench); a near spelling of another flag would mislead
# (--lr-decay-iters is not --lr-warmup-iters)
NOT_ALIASED: dict[str, str] = {
    "--lr-decay-iters": "llamatron decays the learning rate over --train-steps (after --warmup-steps)",
    "--lr-warmup-fraction": "give the warm-up in steps, --warmup-steps N",
    "--lr-decay-style": "llamatron's is --lr-schedule constant|linear|cosine",
    "--recompute-granularity": "llamatron's is --recompute full|selective",
    "--virtual-pipeline-model-parallel-size": "llamatron's is --vpp N (model chunks per pipeline rank)",
    "--tokenizer-type": "llamatron tells the kind from the files: give --tokenizer PATH (a Hugging Face directory, "
    "tokenizer.json or tokenizer.model)",
    "--tokenizer-model": "give the file as --tokenizer PATH",
    "--moe-router-enable-expert-bias": "give --model-override router_expert_bias=true",
    "--moe-expert-capacity-factor": "Megatron's capacity counts a micro-batch's tokens, llamatron's each "
    "sequence's: give --model-override moe_capacity_factor=X",
    "--moe-token-drop-policy": "give --model-override moe_token_drop_policy=probs|position",
    "--moe-router-load-balancing-type": "seq_aux_loss is --model-override router_aux_loss_scope=sequence; "
    "llamatron's global_batch (the whole step's counts) is not Megatron's global_aux_loss (the micro-batches seen "
    "so far)",
}


def not_aliased_hint(flag: str, known: list[str]) -> str | None:
    """What to give instead of Megatron-LM's `flag`, where it is one llamatron does not alias and the command
    (known: its flags) takes the aliases."""
    if flag not in NOT_ALIASED or SETTING_ALIASES["train_steps"][0] not in known:
        return None
    return f"{flag} is Megatron-LM's, not aliased (docs/megatron.md): {NOT_ALIASED[flag]}"


def add_setting_aliases(parser: argparse.ArgumentParser) -> None:
    """Each alias as its own hidden flag, parsed like the setting's own flag (so an error names the spelling the user
    typed), writing ALIAS_DEST + the alias: settings_from_aliases moves it to the setting."""
    own = {action.dest: action for action in parser._actions}
    for setting, flags in SETTING_ALIASES.items():
        action = own[setting]
        for flag in flags:
            if isinstance(action, argparse.BooleanOptionalAction):
                parser.add_argument(
                    flag, dest=ALIAS_DEST + flag, action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
                )
            else:
                parser.add_argument(
                    flag,
                    dest=ALIAS_DEST + flag,
                    type=action.type or str,
                    nargs=action.nargs,
                    choices=action.choices,
                    default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS,
                )


def settings_from_aliases(given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The settings the aliases in parsed `given` set (popped from it) and the aliases given. An alias given beside
    its setting's own flag, or beside another alias of it (--bf16 --fp16), is an error: one would be dropped."""
    setting_of = {flag: setting for setting, flags in SETTING_ALIASES.items() for flag in flags}
    setting_of.update(dict.fromkeys(PRECISION_ALIASES, "precision"))
    typed: dict[str, str] = {}  # setting -> the alias that set it, as typed
    settings = {}
    for key in [k for k in given if k.startswith(ALIAS_DEST)]:
        flag, value = key.removeprefix(ALIAS_DEST), given.pop(key)
        setting = setting_of[flag]
        if setting in typed:
            raise ConfigError(f"{typed[setting]} and {_as_typed(flag, value)} both set {setting}: give one of them")
        if setting in given:
            own = _as_typed(f"--{'no-' if given[setting] is False else ''}{setting.replace('_', '-')}", given[setting])
            raise ConfigError(
                f"{_as_typed(flag, value)} and {own} both set {setting} (Megatron-LM's name and llamatron's): "
                "give one of them"
            )
        typed[setting], settings[setting] = _as_typed(flag, value), PRECISION_ALIASES.get(flag, value)
    return settings, [key.split(" ")[0] for key in typed.values()]


def _as_typed(flag: str, value: Any) -> str:
    if isinstance(value, bool):  # a switch: the flag alone
        return flag
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def alias_problems(spelled: list[str], tp: int, etp: int | None) -> list[str]:
    """The conditional aliases given where their Megatron meaning is not the setting's."""
    if "--expert-model-parallel-size" in spelled and etp == 1 and tp > 1:
        return [
            "--expert-model-parallel-size counts the tp ranks under --expert-tensor-parallel-size 1 (Megatron-core's "
            f"expert groups), --ep does not (experts over ep x tp ranks): give --ep N / {tp} instead"
        ]
    return []


def add_model_aliases(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Megatron-LM model-shape flags (set model_overrides)")
    for flag, field in MODEL_ALIASES.items():
        kind = float if field in _FLOAT_FIELDS else int
        group.add_argument(
            flag,
            type=kind,
            dest=f"megatron_{field}",
            default=argparse.SUPPRESS,
            metavar="X" if kind is float else "N",
            help=f"= model_overrides: {field}: {'X' if kind is float else 'N'}",
        )
    for flag, precision in PRECISION_ALIASES.items():
        group.add_argument(
            flag,
            action="store_true",
            dest=ALIAS_DEST + flag,
            default=argparse.SUPPRESS,
            help=f"= --precision {precision}",
        )


def model_overrides_from_flags(given: dict[str, Any]) -> dict[str, int | float]:
    """The model_overrides the Megatron model-shape flags in parsed `given` set (popped from it)."""
    return {key.removeprefix("megatron_"): given.pop(key) for key in list(given) if key.startswith("megatron_")}
