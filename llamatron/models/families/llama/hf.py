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
from ...hf_format import (
    TensorRule,
    decoder_config_from_hf,
    decoder_config_keys,
    decoder_layer_rules,
    decoder_rules,
)
from .hf_mixtral import MIXTRAL_DEFAULTS, expert_tensors, has_stacked_experts, moe_config_from_hf, moe_config_to_hf

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    if hf.get("model_type") == "mixtral":  # Mistral's attention (with Mixtral's defaults), experts for the MLP
        # transformers' Mixtral has no biases, whatever attention_bias says
        attention = {**MIXTRAL_DEFAULTS, **hf, "attention_bias": False, "mlp_bias": False}
        return dataclasses.replace(_attention_config(attention), **moe_config_from_hf(hf))
    return _attention_config(hf)


def _attention_config(hf: Mapping[str, Any]) -> ModelConfig:
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise HFConversionError(
            f"attention_bias={attention_bias} but mlp_bias={mlp_bias}: llamatron has one "
            f"bias switch for all linear layers"
        )
    window = hf.get("sliding_window") if hf.get("model_type") in ("mistral", "mixtral") else None
    return decoder_config_from_hf(hf, "llama", sliding_window=window, bias=attention_bias)


def config_to_hf(cfg: ModelConfig, base: Mapping[str, Any]) -> dict[str, Any]:
    model_type = "mistral" if cfg.sliding_window is not None or base.get("model_type") == "mistral" else "llama"
    model_type = "mixtral" if cfg.is_moe else model_type
    if model_type == "mistral" and cfg.bias:
        raise HFConversionError("Mistral has no biases in transformers; this model has bias=True")
    out = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, **decoder_config_keys(cfg)}
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
    layers = []
    for i in range(cfg.num_layers):
        layer = decoder_layer_rules(cfg, i, qkv_bias=b, o_bias=b, mlp_bias=b, mlp=not cfg.is_moe)
        if cfg.is_moe:
            layer += [TensorRule(*t) for t in expert_tensors(cfg, i, stacked)]
        layers.append(layer)
    return decoder_rules(cfg, layers)
