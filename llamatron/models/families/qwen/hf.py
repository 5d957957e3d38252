"""The qwen family's Hugging Face format: model_types qwen2 (Qwen2, Qwen2.5: Qwen2ForCausalLM), qwen3
(Qwen3ForCausalLM), qwen3_moe and qwen2_moe (Qwen3MoeForCausalLM, Qwen2MoeForCausalLM: Qwen3's or Qwen2's
attention, a mixture of experts for every MLP, Qwen2-MoE's with a gated shared expert: hf_moe.py).

Their layers are Llama's pre-norm decoder layers with two differences: Qwen2 has biases on the query, key and
value projections (not on the output projection or the MLP); Qwen3 has none, but an RMSNorm over each query and
key head before the rotary embedding, and a head_dim of its own (128 in every released size). llamatron fuses
q/k/v into attn.qkv and gate/up into mlp.gate_up, as for Llama. Sliding-window layers (use_sliding_window, off in
every released model) are not supported.
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
from .config import QwenConfig
from .hf_moe import expert_rules, moe_config_from_hf, moe_config_to_hf

ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    if hf.get("model_type") == "qwen3_moe":
        # Qwen3's attention; transformers' Qwen3-MoE derives head_dim from hidden_size / heads when it is left out
        dense = config_from_hf({**hf, "model_type": "qwen3", "head_dim": hf.get("head_dim") or _derived(hf)})
        return dataclasses.replace(dense, **moe_config_from_hf(hf))
    if hf.get("model_type") == "qwen2_moe":  # Qwen2's attention, experts and a shared expert for the MLP
        return dataclasses.replace(config_from_hf({**hf, "model_type": "qwen2"}), **moe_config_from_hf(hf))
    qwen3 = hf.get("model_type") == "qwen3"
    sliding = [t for t in hf.get("layer_types") or () if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding:
        raise HFConversionError(
            "use_sliding_window / sliding_attention layers (Qwen's windowed layers past max_window_layers) are not "
            "supported; every released Qwen2/2.5/3 model has them off"
        )
    if qwen3 and hf.get("attention_bias"):
        raise HFConversionError("a Qwen3 with attention_bias=true (biases on q, k, v and o) is not supported")
    # transformers' Qwen3 defaults head_dim to 128 (not hidden_size / heads) when config.json leaves it out
    return decoder_config_from_hf(
        hf,
        "qwen",
        max_positions=32768,
        head_dim=128 if qwen3 else None,
        config_class=QwenConfig,
        qkv_bias=not qwen3,
        qk_norm=qwen3,
    )


def _derived(hf: Mapping[str, Any]) -> Any:
    heads = hf.get("num_attention_heads")
    return hf["hidden_size"] // heads if isinstance(heads, int) and heads > 0 else None


def config_to_hf(cfg: QwenConfig, base: Mapping[str, Any]) -> dict[str, Any]:
    model_type = ("qwen3" if cfg.qk_norm else "qwen2") + ("_moe" if cfg.is_moe else "")
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        **decoder_config_keys(cfg),
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_layers,
        "layer_types": ["full_attention"] * cfg.num_layers,
    }
    if cfg.qk_norm:
        out["attention_bias"] = False
    if cfg.is_moe:
        out.update(moe_config_to_hf(cfg))
    return out


def weight_rules(cfg: QwenConfig, hf: Mapping[str, Any], names: Collection[str] = ()) -> list[TensorRule]:
    """`names`: the Hugging Face tensors at hand (import), which decide the layout of Qwen3-MoE's experts."""
    layers = []
    for i in range(cfg.num_layers):
        sparse = cfg.is_moe_layer(i)
        layer = decoder_layer_rules(
            cfg, i, qkv_bias=cfg.qkv_bias, o_bias=False, mlp_bias=False, mlp=not sparse, qk_norm=cfg.qk_norm
        )
        layers.append(layer + (expert_rules(cfg, i, names) if sparse else []))
    return decoder_rules(cfg, layers)
