"""Hugging Face <-> llamatron, per family: `config.json` <-> ModelConfig, and weight names.

The weight mapping is a list of `TensorRule`s, one per llamatron tensor: the
Hugging Face tensors it is made of, how to fuse them (import) and how to split
it back (export). Splitting only slices, and fusing only concatenates or
reorders rows, so import -> export gives back bitwise-identical tensors.

Llamatron fuses what Hugging Face keeps apart:
  attn.qkv   rows [Q heads; K heads; V heads]  <- q_proj, k_proj, v_proj (Llama, Mistral, Mixtral)
  mlp.gate_up rows [gate; up]                  <- gate_proj, up_proj
Mixtral's experts are stacked per layer (hf_mixtral.py).
Falcon already fuses QKV, in one of three row layouts (`falcon_qkv_layout`):
  "multi_query" (7B):   [all Q heads; K; V]                      = llamatron's order
  "grouped" (40B/180B, new_decoder_architecture): per KV head g, [q_g1 .. q_gn, k_g, v_g]
  "interleaved" (multi-head, no new architecture): per head [q, k, v]

Both directions go through the same rules, built from the model config and the
Hugging Face config (which decides Falcon's layout and norm names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import HFConversionError
from ..models import ModelConfig, RopeScaling
from .hf_mixtral import MIXTRAL_DEFAULTS, expert_tensors, has_stacked_experts, moe_config_from_hf, moe_config_to_hf

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "falcon": "FalconForCausalLM",
}
# Keys rewritten on export (rope in the form every transformers >= 4.45 reads; dtype under both names).
_REWRITTEN_KEYS = (
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "router_z_loss_coef",  # written only when set (hf_mixtral.py): a stale one must not survive
)
# Hugging Face tensors that carry nothing a llamatron model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------- configs


def _get(hf: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


def _rope_from_hf(hf: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
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
    raise HFConversionError(f"rope scaling {kind!r} is not supported; llamatron has linear, dynamic and llama3")


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any] | None:
    s = cfg.rope_scaling
    if s is None:
        return None
    if s.kind in ("linear", "dynamic"):
        return {"rope_type": s.kind, "factor": s.factor}
    return {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position,
    }


def _check_head_dim(hf: Mapping[str, Any], hidden: int, heads: int) -> None:
    head_dim = hf.get("head_dim")
    if hidden % heads or (head_dim is not None and head_dim != hidden // heads):
        raise HFConversionError(
            f"head_dim={head_dim} with hidden_size={hidden} and {heads} heads: llamatron needs "
            f"head_dim = hidden_size / num_attention_heads"
        )


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """The llamatron architecture described by a Hugging Face `config.json`."""
    model_type = hf.get("model_type")
    if model_type in ("llama", "mistral"):
        return _llama_config_from_hf(hf)
    if model_type == "mixtral":  # Mistral's attention (with Mixtral's defaults), a mixture of experts for the MLP
        # transformers' Mixtral has no biases, whatever attention_bias says
        attention = {**MIXTRAL_DEFAULTS, **hf, "attention_bias": False, "mlp_bias": False}
        return dataclasses.replace(_llama_config_from_hf(attention), **moe_config_from_hf(hf))
    if model_type == "falcon":
        return _falcon_config_from_hf(hf)
    raise HFConversionError(
        f"model_type {model_type!r} is not supported; llamatron converts llama, mistral, mixtral "
        f"and falcon (Llama 1/2/3, Code Llama, Mistral, Mixtral, Falcon)"
    )


def _llama_config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"hidden_act={hf['hidden_act']!r}: llamatron's SwiGLU uses silu")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    _check_head_dim(hf, hidden, heads)
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise HFConversionError(
            f"attention_bias={attention_bias} but mlp_bias={mlp_bias}: llamatron has one "
            f"bias switch for all linear layers"
        )
    max_positions = hf.get("max_position_embeddings", 2048)
    theta, scaling = _rope_from_hf(hf, max_positions)
    return ModelConfig(
        family="llama",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=_get(hf, "num_key_value_heads", default=heads),
        ffn_hidden_size=hf["intermediate_size"],
        max_seq_length=max_positions,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=hf.get("sliding_window") if hf.get("model_type") in ("mistral", "mixtral") else None,
        bias=attention_bias,
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def falcon_qkv_layout(hf: Mapping[str, Any]) -> str:
    """Row layout of Falcon's fused query_key_value: "grouped", "multi_query" or "interleaved"."""
    if hf.get("new_decoder_architecture"):
        return "grouped"
    return "multi_query" if hf.get("multi_query", True) else "interleaved"


def _falcon_separate_norms(hf: Mapping[str, Any]) -> bool:
    return bool(hf.get("new_decoder_architecture")) and hf.get("num_ln_in_parallel_attn") in (None, 2)


def _falcon_config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    if hf.get("alibi"):
        raise HFConversionError("Falcon with alibi=True is not supported (llamatron uses rotary embeddings)")
    if not hf.get("new_decoder_architecture") and not hf.get("parallel_attn", True):
        raise HFConversionError(
            "Falcon with parallel_attn=False is not supported (llamatron's Falcon block runs "
            "attention and MLP in parallel)"
        )
    if hf.get("activation", "gelu") != "gelu":
        raise HFConversionError(f"Falcon activation={hf['activation']!r}: llamatron's Falcon MLP uses gelu")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    _check_head_dim(hf, hidden, heads)
    layout = falcon_qkv_layout(hf)
    kv_heads = {"grouped": _get(hf, "num_kv_heads", default=heads), "multi_query": 1, "interleaved": heads}[layout]
    max_positions = hf.get("max_position_embeddings", 2048)
    theta, scaling = _rope_from_hf(hf, max_positions)
    return ModelConfig(
        family="falcon",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=_get(hf, "ffn_hidden_size", default=4 * hidden),
        max_seq_length=max_positions,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(_get(hf, "layer_norm_epsilon", default=1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        separate_mlp_norm=_falcon_separate_norms(hf),
        bias=bool(hf.get("bias", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


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
    hf = {k: v for k, v in (base or {}).items() if k not in _REWRITTEN_KEYS}
    hf.update(_falcon_to_hf(cfg, hf) if cfg.family == "falcon" else _llama_to_hf(cfg, hf))
    hf.update(
        {
            "vocab_size": vocab_size or cfg.vocab_size,
            "max_position_embeddings": cfg.max_seq_length,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": _rope_to_hf(cfg),
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


def _llama_to_hf(cfg: ModelConfig, base: Mapping[str, Any]) -> dict[str, Any]:
    model_type = "mistral" if cfg.sliding_window is not None or base.get("model_type") == "mistral" else "llama"
    model_type = "mixtral" if cfg.is_moe else model_type
    if model_type == "mistral" and cfg.bias:
        raise HFConversionError("Mistral has no biases in transformers; this model has bias=True")
    out = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
    }
    if model_type == "mixtral":
        out.update(moe_config_to_hf(cfg))
    elif model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    else:
        out.update({"attention_bias": cfg.bias, "mlp_bias": cfg.bias})
    return out


def _falcon_to_hf(cfg: ModelConfig, base: Mapping[str, Any]) -> dict[str, Any]:
    layout = falcon_qkv_layout(base) if base.get("model_type") == "falcon" else None
    fits = {
        "grouped": True,
        "multi_query": cfg.num_kv_heads == 1 and not cfg.separate_mlp_norm,
        "interleaved": cfg.num_kv_heads == cfg.num_heads and not cfg.separate_mlp_norm,
        None: False,
    }
    if not fits[layout]:  # the 7B layout where it can express the model, else the 40B one
        layout = "multi_query" if fits["multi_query"] else "grouped"
    out = {
        "architectures": [ARCHITECTURES["falcon"]],
        "model_type": "falcon",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "ffn_hidden_size": cfg.ffn_hidden_size,
        "layer_norm_epsilon": cfg.norm_eps,
        "bias": cfg.bias,
        "alibi": False,
        "parallel_attn": True,
        "activation": "gelu",
        "new_decoder_architecture": layout == "grouped",
        "num_kv_heads": cfg.num_kv_heads,
        # ignored by the grouped layout: keep what the source said there
        "multi_query": bool(base.get("multi_query", True)) if layout == "grouped" else layout == "multi_query",
    }
    out["num_ln_in_parallel_attn"] = (2 if cfg.separate_mlp_norm else 1) if layout == "grouped" else None
    return out


# ---------------------------------------------------------------- weights


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0)


def _only(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0]


def _itself(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def _split_rows(sizes: list[int]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    return lambda t: list(t.split(sizes, dim=0))


@dataclass(frozen=True)
class TensorRule:
    """One llamatron tensor and the Hugging Face tensors it is made of."""

    name: str
    hf_names: tuple[str, ...]
    fuse: Callable[[list[torch.Tensor]], torch.Tensor] = field(default=_only, compare=False)
    split: Callable[[torch.Tensor], list[torch.Tensor]] = field(default=_itself, compare=False)


def _grouped_qkv(heads: int, kv_heads: int, head_dim: int) -> tuple[Callable, Callable]:
    """Falcon 40B rows [per KV head: its query heads, k, v] <-> llamatron's [Q; K; V]."""
    group = heads // kv_heads

    def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
        t = parts[0]
        g = t.reshape(kv_heads, group + 2, head_dim, *t.shape[1:])
        q, k, v = g[:, :group], g[:, group], g[:, group + 1]
        return torch.cat(
            [
                q.reshape(heads * head_dim, *t.shape[1:]),
                k.reshape(kv_heads * head_dim, *t.shape[1:]),
                v.reshape(kv_heads * head_dim, *t.shape[1:]),
            ],
            dim=0,
        )

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        rest = t.shape[1:]
        q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=0)
        g = torch.cat(
            [
                q.reshape(kv_heads, group, head_dim, *rest),
                k.reshape(kv_heads, 1, head_dim, *rest),
                v.reshape(kv_heads, 1, head_dim, *rest),
            ],
            dim=1,
        )
        return [g.reshape(t.shape)]

    return fuse, split


def _interleaved_qkv(heads: int, head_dim: int) -> tuple[Callable, Callable]:
    """Falcon multi-head rows [per head: q, k, v] <-> llamatron's [Q; K; V]."""

    def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
        t = parts[0]
        return t.reshape(heads, 3, head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        return [t.reshape(3, heads, head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)]

    return fuse, split


def _linear(name: str, hf_name: str, bias: bool, **fns) -> list[TensorRule]:
    suffixes = ("weight", "bias") if bias else ("weight",)
    return [TensorRule(f"{name}.{s}", tuple(f"{h}.{s}" for h in hf_name.split("|")), **fns) for s in suffixes]


def weight_rules(cfg: ModelConfig, hf: Mapping[str, Any], names: Collection[str] = ()) -> list[TensorRule]:
    """Every llamatron tensor of `cfg`, in checkpoint order, with its Hugging Face counterparts. `names`: the
    Hugging Face tensors at hand (import), which decide the layout of Mixtral's experts (export: the Hub's)."""
    if cfg.family == "falcon":
        return _falcon_rules(cfg, hf)
    return _llama_rules(cfg, stacked_experts=has_stacked_experts(names))


def _llama_rules(cfg: ModelConfig, stacked_experts: bool = False) -> list[TensorRule]:
    d, b = cfg.head_dim, cfg.bias
    qkv = _split_rows([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
    gate_up = _split_rows([cfg.ffn_hidden_size, cfg.ffn_hidden_size])
    rules = [TensorRule("embed.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.num_layers):
        h, L = f"model.layers.{i}", f"layers.{i}"
        rules.append(TensorRule(f"{L}.attn_norm.weight", (f"{h}.input_layernorm.weight",)))
        rules += _linear(
            f"{L}.attn.qkv", f"{h}.self_attn.q_proj|{h}.self_attn.k_proj|{h}.self_attn.v_proj", b, fuse=_cat, split=qkv
        )
        rules += _linear(f"{L}.attn.o", f"{h}.self_attn.o_proj", b)
        rules.append(TensorRule(f"{L}.mlp_norm.weight", (f"{h}.post_attention_layernorm.weight",)))
        if cfg.is_moe:
            rules += [TensorRule(*t) for t in expert_tensors(cfg, i, stacked_experts)]
            continue
        rules += _linear(f"{L}.mlp.gate_up", f"{h}.mlp.gate_proj|{h}.mlp.up_proj", b, fuse=_cat, split=gate_up)
        rules += _linear(f"{L}.mlp.down", f"{h}.mlp.down_proj", b)
    rules.append(TensorRule("norm.weight", ("model.norm.weight",)))
    if not cfg.tie_embeddings:
        rules.append(TensorRule("lm_head.weight", ("lm_head.weight",)))
    return rules


def _falcon_rules(cfg: ModelConfig, hf: Mapping[str, Any]) -> list[TensorRule]:
    layout, b = falcon_qkv_layout(hf), cfg.bias
    if layout == "grouped":
        qkv_fuse, qkv_split = _grouped_qkv(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    elif layout == "interleaved":
        qkv_fuse, qkv_split = _interleaved_qkv(cfg.num_heads, cfg.head_dim)
    else:
        qkv_fuse, qkv_split = _only, _itself  # [Q; K; V] already
    separate = _falcon_separate_norms(hf)
    if separate != cfg.separate_mlp_norm:
        raise HFConversionError(
            f"Falcon config has {'two' if separate else 'one'} layer norm(s) per block but the "
            f"model separate_mlp_norm={cfg.separate_mlp_norm}"
        )
    rules = [TensorRule("embed.weight", ("transformer.word_embeddings.weight",))]
    for i in range(cfg.num_layers):
        h, L = f"transformer.h.{i}", f"layers.{i}"
        rules += _linear(f"{L}.attn_norm", f"{h}.ln_attn" if separate else f"{h}.input_layernorm", True)
        if separate:
            rules += _linear(f"{L}.mlp_norm", f"{h}.ln_mlp", True)
        rules += _linear(f"{L}.attn.qkv", f"{h}.self_attention.query_key_value", b, fuse=qkv_fuse, split=qkv_split)
        rules += _linear(f"{L}.attn.o", f"{h}.self_attention.dense", b)
        rules += _linear(f"{L}.mlp.up", f"{h}.mlp.dense_h_to_4h", b)
        rules += _linear(f"{L}.mlp.down", f"{h}.mlp.dense_4h_to_h", b)
    rules += _linear("norm", "transformer.ln_f", True)
    if not cfg.tie_embeddings:
        rules.append(TensorRule("lm_head.weight", ("lm_head.weight",)))
    return rules


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
    "ARCHITECTURES",
    "HFConversionError",
    "TensorRule",
    "check_hf_names",
    "config_from_hf",
    "config_to_hf",
    "falcon_qkv_layout",
    "hf_to_llamatron",
    "llamatron_to_hf",
    "weight_rules",
]
