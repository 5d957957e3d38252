"""Hugging Face <-> llamatron: `config.json` <-> ModelConfig, and the weights' names, for every family.

Each family's folder holds its own format (models/families/*/hf.py: its model_types, config keys and
TensorRules); this module finds the family (by config.json's model_type, or the ModelConfig's family), writes
the keys every family shares and applies the rules. Both directions go through the same rules, so import ->
export gives back bitwise-identical tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from ..errors import HFConversionError
from ..models import ModelConfig
from ..models.families import family_for_model_type, family_of, hf_model_types
from ..models.hf_format import TensorRule, rope_to_hf

# Keys rewritten on export (rope in the form every transformers >= 4.45 reads; dtype under both names).
_REWRITTEN_KEYS = (
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "router_z_loss_coef",  # written only when set (a family's own key): a stale one must not survive
)
# Hugging Face tensors that carry nothing a llamatron model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """The llamatron architecture described by a Hugging Face `config.json`."""
    model_type = hf.get("model_type")
    family = family_for_model_type(model_type)
    if family is None:
        raise HFConversionError(
            f"model_type {model_type!r} is not supported; llamatron converts {', '.join(hf_model_types())}"
        )
    return family.hf.config_from_hf(hf)


def training_settings_not_exported(cfg: ModelConfig) -> list[str]:
    """Settings of `cfg` that shape only how it trains and that no Hugging Face config has a key for: export-hf
    names them (a user training the export again sets them again)."""
    if not cfg.is_moe:
        return []
    dropped = []
    if cfg.moe_capacity_factor is not None:
        dropped.append(f"moe_capacity_factor {cfg.moe_capacity_factor} ({cfg.moe_token_drop_policy})")
    if cfg.router_aux_loss_scope == "global_batch":
        dropped.append("router_aux_loss_scope global_batch")
    return dropped


def config_to_hf(
    cfg: ModelConfig,
    base: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """A Hugging Face `config.json` for `cfg`.

    `base` (the config.json the model was imported from) keeps what llamatron
    does not model (token ids, Falcon's QKV layout, model_type) as long as it
    still describes the same architecture; the architecture keys always come
    from `cfg`. `vocab_size` overrides cfg's (a padded vocabulary is cut back).
    """
    if cfg.is_moe and cfg.router_expert_bias and not _rules_name(cfg, ".expert_bias"):
        raise HFConversionError(
            "router_expert_bias: the Hugging Face formats of these experts have no tensor for the balancing bias, "
            "which routes this model; it cannot be exported"
        )
    hf = {k: v for k, v in (base or {}).items() if k not in _REWRITTEN_KEYS}
    hf.update(family_of(cfg).hf.config_to_hf(cfg, hf))
    hf.update(
        {
            "vocab_size": vocab_size or cfg.vocab_size,
            "max_position_embeddings": cfg.max_seq_length,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": rope_to_hf(cfg),
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
        }
    )
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "dynamic":
        # Hugging Face's dynamic scaling starts growing the base past max_position_embeddings.
        hf["max_position_embeddings"] = cfg.rope_scaling.original_max_position
    name = str(dtype).removeprefix("torch.")
    hf["torch_dtype"] = hf["dtype"] = name  # transformers 4.x reads torch_dtype, 5.x dtype
    return dict(sorted(hf.items()))


def _rules_name(cfg: ModelConfig, suffix: str) -> bool:
    """Whether the family's Hugging Face format has a tensor for llamatron's tensors ending in `suffix`."""
    return any(r.name.endswith(suffix) for r in family_of(cfg).hf.weight_rules(cfg, {}, ()))


def weight_rules(cfg: ModelConfig, hf: Mapping[str, Any], names: Collection[str] = ()) -> list[TensorRule]:
    """Every llamatron tensor of `cfg`, in checkpoint order, with its Hugging Face counterparts. `names`: the
    Hugging Face tensors at hand (import), where a family's layout depends on them (export: ())."""
    return family_of(cfg).hf.weight_rules(cfg, hf, names)


def tied_as_loaded(
    hf: Mapping[str, Any], names: Collection[str], read: Callable[[str], torch.Tensor]
) -> dict[str, Any]:
    """`hf` as transformers reads it beside its weights `names` (`read`: a tensor's data): it ties the head to the
    embedding only where the weights hold no head or one equal to the embedding (modeling_utils' tie_weights); a
    distinct lm_head.weight stays untied, and so it is here (tie_word_embeddings false) rather than dropped."""
    cfg = config_from_hf(hf)
    if not cfg.tie_embeddings or "lm_head.weight" not in names:
        return dict(hf)
    embed = next(r for r in weight_rules(cfg, hf, names) if r.name == "embed.weight").hf_names[0]
    if embed not in names or torch.equal(read(embed), read("lm_head.weight")):
        return dict(hf)
    return {**hf, "tie_word_embeddings": False}


def check_hf_names(rules: list[TensorRule], available: set[str], cfg: ModelConfig, where: str) -> None:
    """Every Hugging Face tensor the rules need is there, and nothing unexpected is left over."""
    needed = {n for r in rules for n in r.hf_names}
    missing = sorted(needed - available)
    ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()  # tied: the embedding is the head
    extra = sorted(n for n in available - needed - ignorable if not n.endswith(_IGNORED_SUFFIXES))
    if missing or extra:
        shape = f"{cfg.num_layers} layers" + (f" of {cfg.num_experts} experts" if cfg.is_moe else "")
        problems = [f"missing {n}" for n in missing] + [f"unexpected {n}" for n in extra]
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise HFConversionError(
            f"{where} does not match its config.json ({cfg.family}, {shape}): {', '.join(problems[:8])}{more}; "
            f"the weights must be those of the model config.json describes (re-download an incomplete one)"
        )


def hf_to_llamatron(
    hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, hf: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """In-memory conversion of a Hugging Face state dict (for tests and `verify`; import-hf streams)."""
    rules = weight_rules(cfg, hf, hf_state.keys())
    check_hf_names(rules, set(hf_state), cfg, "state dict")
    return {r.name: r.fuse([hf_state[n] for n in r.hf_names]).contiguous() for r in rules}


def llamatron_to_hf(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, hf: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    out = {}
    for r in weight_rules(cfg, hf):
        out.update({n: t.contiguous() for n, t in zip(r.hf_names, r.split(state[r.name]))})
    return out


__all__ = [
    "HFConversionError",
    "TensorRule",
    "check_hf_names",
    "config_from_hf",
    "config_to_hf",
    "hf_to_llamatron",
    "llamatron_to_hf",
    "tied_as_loaded",
    "weight_rules",
]
