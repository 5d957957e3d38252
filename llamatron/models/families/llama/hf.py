"""The llama family's Hugging Face format: model_types llama, mistral and mixtral (LlamaForCausalLM,
MistralForCausalLM, MixtralForCausalLM).

Llamatron fuses what Hugging Face keeps apart:
  attn.qkv    rows [Q heads; K heads; V heads]  <- q_proj, k_proj, v_proj
  mlp.gate_up rows [gate; up]                   <- gate_proj, up_proj
Mixtral's experts are stacked per layer (hf_mixtral.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from ....errors import HFConversionError
from ...config import ModelConfig
from ...hf_format import TensorRule, cat, get, head_dim_from_hf, linear, qkv_and_gate_up, rope_from_hf
from .hf_mixtral import MIXTRAL_DEFAULTS, expert_tensors, has_stacked_experts, moe_config_from_hf, moe_config_to_hf

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    if hf.get("model_type") == "mixtral":  # Mistral's attention (with Mixtral's defaults), experts for the MLP
        # transformers' Mixtral has no biases, whatever attention_bias says
        attention = {**MIXTRAL_DEFAULTS, **hf, "attention_bias": False, "mlp_bias": False}
        return dataclasses.replace(_attention_config(attention), **moe_config_from_hf(hf))
    return _attention_config(hf)


def _attention_config(hf: Mapping[str, Any]) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"hidden_act={hf['hidden_act']!r}: llamatron's SwiGLU uses silu")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise HFConversionError(
            f"attention_bias={attention_bias} but mlp_bias={mlp_bias}: llamatron has one "
            f"bias switch for all linear layers"
        )
    max_positions = hf.get("max_position_embeddings", 2048)
    theta, scaling = rope_from_hf(hf, max_positions)
    return ModelConfig(
        family="llama",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=get(hf, "num_key_value_heads", default=heads),
        head_dim=head_dim_from_hf(hf, hidden, heads),
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


def config_to_hf(cfg: ModelConfig, base: Mapping[str, Any]) -> dict[str, Any]:
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


def weight_rules(cfg: ModelConfig, hf: Mapping[str, Any], names: Collection[str] = ()) -> list[TensorRule]:
    """`names`: the Hugging Face tensors at hand (import), which decide the layout of Mixtral's experts (export:
    the Hub's)."""
    b, stacked = cfg.bias, has_stacked_experts(names)
    qkv, gate_up = qkv_and_gate_up(cfg)
    rules = [TensorRule("embed.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.num_layers):
        h, L = f"model.layers.{i}", f"layers.{i}"
        rules.append(TensorRule(f"{L}.attn_norm.weight", (f"{h}.input_layernorm.weight",)))
        rules += linear(
            f"{L}.attn.qkv", f"{h}.self_attn.q_proj|{h}.self_attn.k_proj|{h}.self_attn.v_proj", b, fuse=cat, split=qkv
        )
        rules += linear(f"{L}.attn.o", f"{h}.self_attn.o_proj", b)
        rules.append(TensorRule(f"{L}.mlp_norm.weight", (f"{h}.post_attention_layernorm.weight",)))
        if cfg.is_moe:
            rules += [TensorRule(*t) for t in expert_tensors(cfg, i, stacked)]
            continue
        rules += linear(f"{L}.mlp.gate_up", f"{h}.mlp.gate_proj|{h}.mlp.up_proj", b, fuse=cat, split=gate_up)
        rules += linear(f"{L}.mlp.down", f"{h}.mlp.down_proj", b)
    rules.append(TensorRule("norm.weight", ("model.norm.weight",)))
    if not cfg.tie_embeddings:
        rules.append(TensorRule("lm_head.weight", ("lm_head.weight",)))
    return rules
