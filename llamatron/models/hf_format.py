"""The vocabulary of Hugging Face checkpoints that every family's adapter speaks (models/families/*/hf.py).

A family maps its weights with a list of `TensorRule`s, one per llamatron tensor: the Hugging Face tensors it is
made of, how to fuse them (import) and how to split it back (export). Splitting only slices, and fusing only
concatenates or reorders rows, so import -> export gives back bitwise-identical tensors. Rope settings are read in
both of transformers' forms (4.x `rope_theta` + `rope_scaling`, 5.x `rope_parameters`) and written in the one every
transformers >= 4.45 reads.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import HFConversionError
from .config import ModelConfig, RopeScaling


def get(hf: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` that `hf` sets (not None), else `default`."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


def rope_from_hf(hf: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """Rope theta and scaling from either form: 4.x (`rope_theta`, `rope_scaling`) or 5.x (`rope_parameters`)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    factor = float(params["factor"])
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    if kind == "dynamic":  # Hugging Face grows the base past max_position_embeddings
        return theta, RopeScaling("dynamic", factor, original_max_position=max_positions)
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor,
            int(params.get("original_max_position_embeddings", max_positions)),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
        )
    if kind == "yarn":
        return theta, _yarn_from_hf(params, factor, max_positions)
    raise HFConversionError(f"rope scaling {kind!r} is not supported; llamatron has linear, dynamic, llama3 and yarn")


def _yarn_from_hf(params: Mapping[str, Any], factor: float, max_positions: int) -> RopeScaling:
    """transformers' yarn parameters (modeling_rope_utils._compute_yarn_parameters' keys)."""
    if params.get("attention_factor") is not None:
        raise HFConversionError(
            "rope scaling yarn with attention_factor set: llamatron derives it from factor, mscale and mscale_all_dim"
        )
    optional = {k: float(params[k]) for k in ("mscale", "mscale_all_dim") if params.get(k) is not None}
    return RopeScaling(
        "yarn",
        factor,
        int(params.get("original_max_position_embeddings") or max_positions),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        **optional,
    )


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any] | None:
    s = cfg.rope_scaling
    if s is None:
        return None
    if s.kind in ("linear", "dynamic"):
        return {"rope_type": s.kind, "factor": s.factor}
    if s.kind == "yarn":
        out = {
            "rope_type": "yarn",
            "factor": s.factor,
            "original_max_position_embeddings": s.original_max_position,
            "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow,
            "mscale": s.mscale,
            "mscale_all_dim": s.mscale_all_dim,
            "truncate": s.truncate,
        }
        return {k: v for k, v in out.items() if v is not None}
    return {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position,
    }


def head_dim_from_hf(hf: Mapping[str, Any], hidden: int, heads: int) -> Any:
    """config.json's head_dim, else hidden_size / heads (transformers' default)."""
    if heads == 0:  # ModelConfig.problems says why
        return hf.get("head_dim")
    derived = hidden // heads  # TypeError for a size of the wrong type: the reader of config.json says so
    return hf["head_dim"] if hf.get("head_dim") is not None else derived


def decoder_config_from_hf(
    hf: Mapping[str, Any],
    family: str,
    max_positions: int = 2048,
    head_dim: Any = None,
    config_class: type[ModelConfig] = ModelConfig,
    **options: Any,
) -> ModelConfig:
    """The config (of `config_class`: the family's) of a transformers pre-norm decoder with SwiGLU and RMSNorm from
    its config.json keys (`max_positions`: transformers' default max_position_embeddings; `head_dim`: the family's
    default when config.json has none, else hidden_size / heads); `options`: the family's config options."""
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"hidden_act={hf['hidden_act']!r}: llamatron's SwiGLU uses silu")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    derived_head_dim = head_dim_from_hf(hf, hidden, heads)  # checks the sizes' types, whatever head_dim is
    max_positions = hf.get("max_position_embeddings", max_positions)
    theta, scaling = rope_from_hf(hf, max_positions)
    return config_class(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=get(hf, "num_key_value_heads", default=heads),
        head_dim=get(hf, "head_dim", default=head_dim) if head_dim is not None else derived_head_dim,
        ffn_hidden_size=hf["intermediate_size"],
        max_seq_length=max_positions,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        **options,
    )


def check_head_dim_follows(hf: Mapping[str, Any], hidden: int, heads: int, family: str) -> None:
    """For families whose transformers code has no head_dim of its own: it must be hidden_size / heads."""
    head_dim = hf.get("head_dim")
    if hidden % heads or (head_dim is not None and head_dim != hidden // heads):
        raise HFConversionError(
            f"head_dim={head_dim} with hidden_size={hidden} and {heads} heads: the {family} family needs "
            f"head_dim = hidden_size / num_attention_heads"
        )


# ---------------------------------------------------------------- weights


def cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0)


def only(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0]


def itself(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def split_rows(sizes: list[int]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    return lambda t: list(t.split(sizes, dim=0))


def _check_alike(parts: list[torch.Tensor]) -> None:
    odd = [p for p in parts if p.shape != parts[0].shape or p.dtype != parts[0].dtype]
    if odd:
        raise HFConversionError(
            f"the experts of one layer differ: {tuple(parts[0].shape)} {parts[0].dtype} vs {tuple(odd[0].shape)} "
            f"{odd[0].dtype}; every expert of a layer has the same shape and dtype"
        )


def stack_experts(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert matrices -> (E, rows, columns)."""
    _check_alike(parts)
    return torch.stack(parts)


def stack_gate_up(parts: list[torch.Tensor]) -> torch.Tensor:
    """[gate_0, up_0, gate_1, up_1, ...] -> (E, 2·ffn, hidden), each expert's rows [gate; up], written in place
    (one copy of the layer's experts besides the parts, no per-expert temporaries)."""
    _check_alike(parts)
    ffn, hidden = parts[0].shape
    out = parts[0].new_empty((len(parts) // 2, 2 * ffn, hidden))
    for i, part in enumerate(parts):
        out[i // 2, (i % 2) * ffn : (i % 2 + 1) * ffn].copy_(part)
    return out


def split_gate_up(ffn: int) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """stack_gate_up's inverse for experts `ffn` wide."""
    return lambda t: [p for x in t for p in x.split([ffn, ffn])]


def unstack(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.unbind(0))


@dataclass(frozen=True)
class TensorRule:
    """One llamatron tensor and the Hugging Face tensors it is made of."""

    name: str
    hf_names: tuple[str, ...]
    fuse: Callable[[list[torch.Tensor]], torch.Tensor] = field(default=only, compare=False)
    split: Callable[[torch.Tensor], list[torch.Tensor]] = field(default=itself, compare=False)


def linear(name: str, hf_name: str, bias: bool, **fns) -> list[TensorRule]:
    """The weight (and bias) of linear `name` from Hugging Face's `hf_name` ("a|b|c": fused from several)."""
    suffixes = ("weight", "bias") if bias else ("weight",)
    return [TensorRule(f"{name}.{s}", tuple(f"{h}.{s}" for h in hf_name.split("|")), **fns) for s in suffixes]


def stacked_expert_rules(h: str, L: str, num_experts: int, ffn: int, names: Collection[str] = ()) -> list[TensorRule]:
    """A layer's stacked experts (`L`.experts.gate_up (E, 2·ffn, hidden), .down (E, hidden, ffn)) under the Hub's
    per-expert names (`h`.experts.{e}.gate_proj.weight, ...), or transformers 5's stacked ones
    (`h`.experts.gate_up_proj, .down_proj) when `names` (the tensors at hand on import) hold those."""
    if any(n.endswith(".mlp.experts.gate_up_proj") for n in names):
        return [
            TensorRule(f"{L}.experts.gate_up", (f"{h}.experts.gate_up_proj",)),
            TensorRule(f"{L}.experts.down", (f"{h}.experts.down_proj",)),
        ]
    e = range(num_experts)
    gate_up = tuple(f"{h}.experts.{i}.{w}_proj.weight" for i in e for w in ("gate", "up"))
    down = tuple(f"{h}.experts.{i}.down_proj.weight" for i in e)
    return [
        TensorRule(f"{L}.experts.gate_up", gate_up, stack_gate_up, split_gate_up(ffn)),
        TensorRule(f"{L}.experts.down", down, stack_experts, unstack),
    ]


def decoder_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """The shape keys of config.json that transformers' pre-norm decoders with SwiGLU and RMSNorm share."""
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
    }


def decoder_layer_rules(
    cfg: ModelConfig, i: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool, mlp: bool = True, qk_norm: bool = False
) -> list[TensorRule]:
    """Layer `i` of such a decoder under transformers' names (model.layers.i.self_attn.q_proj, ...): norms,
    attention (with per-head q/k norms where `qk_norm`) and, with `mlp`, the SwiGLU MLP."""
    qkv, gate_up = qkv_and_gate_up(cfg, cfg.layer_ffn(i))
    h, L = f"model.layers.{i}", f"layers.{i}"
    q, k, v = (f"{h}.self_attn.{x}_proj" for x in "qkv")
    rules = [TensorRule(f"{L}.attn_norm.weight", (f"{h}.input_layernorm.weight",))]
    rules += linear(f"{L}.attn.qkv", f"{q}|{k}|{v}", qkv_bias, fuse=cat, split=qkv)
    if qk_norm:
        rules += [TensorRule(f"{L}.attn.{x}_norm.weight", (f"{h}.self_attn.{x}_norm.weight",)) for x in "qk"]
    rules += linear(f"{L}.attn.o", f"{h}.self_attn.o_proj", o_bias)
    rules.append(TensorRule(f"{L}.mlp_norm.weight", (f"{h}.post_attention_layernorm.weight",)))
    if mlp:
        rules += linear(f"{L}.mlp.gate_up", f"{h}.mlp.gate_proj|{h}.mlp.up_proj", mlp_bias, fuse=cat, split=gate_up)
        rules += linear(f"{L}.mlp.down", f"{h}.mlp.down_proj", mlp_bias)
    return rules


def decoder_rules(cfg: ModelConfig, layers: list[list[TensorRule]]) -> list[TensorRule]:
    """The whole model under transformers' names: the embedding, `layers` (each layer's rules), the final norm and,
    untied, the head."""
    rules = [TensorRule("embed.weight", ("model.embed_tokens.weight",))]
    rules += [r for layer in layers for r in layer]
    rules.append(TensorRule("norm.weight", ("model.norm.weight",)))
    if not cfg.tie_embeddings:
        rules.append(TensorRule("lm_head.weight", ("lm_head.weight",)))
    return rules


def qkv_and_gate_up(cfg: ModelConfig, ffn: int | None = None) -> tuple[Callable, Callable]:
    """The splits of llamatron's fused [Q; K; V] and [gate; up] rows (`ffn` wide: default cfg.ffn_hidden_size) back
    into Hugging Face's separate ones."""
    d = cfg.head_dim
    qkv = split_rows([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
    ffn = cfg.ffn_hidden_size if ffn is None else ffn
    return qkv, split_rows([ffn, ffn])


__all__ = [
    "TensorRule",
    "cat",
    "check_head_dim_follows",
    "decoder_config_from_hf",
    "decoder_config_keys",
    "decoder_layer_rules",
    "decoder_rules",
    "get",
    "head_dim_from_hf",
    "itself",
    "linear",
    "only",
    "qkv_and_gate_up",
    "rope_from_hf",
    "rope_to_hf",
    "split_rows",
    "stacked_expert_rules",
]
