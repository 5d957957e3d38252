"""The falcon family's Hugging Face format: model_type falcon (FalconForCausalLM).

Falcon already fuses QKV, in one of three row layouts (`qkv_layout`):
  "multi_query" (7B):   [all Q heads; K; V]                      = llamatron's order
  "grouped" (40B/180B, new_decoder_architecture): per KV head g, [q_g1 .. q_gn, k_g, v_g]
  "interleaved" (multi-head, no new architecture): per head [q, k, v]
The config.json decides the layout and the norms' names, in both directions.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from ....errors import HFConversionError
from ...hf_format import TensorRule, check_head_dim_follows, get, itself, linear, only, rope_from_hf
from .config import FalconConfig


def qkv_layout(hf: Mapping[str, Any]) -> str:
    """Row layout of Falcon's fused query_key_value: "grouped", "multi_query" or "interleaved"."""
    if hf.get("new_decoder_architecture"):
        return "grouped"
    return "multi_query" if hf.get("multi_query", True) else "interleaved"


def _separate_norms(hf: Mapping[str, Any]) -> bool:
    return bool(hf.get("new_decoder_architecture")) and hf.get("num_ln_in_parallel_attn") in (None, 2)


def config_from_hf(hf: Mapping[str, Any]) -> FalconConfig:
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
    check_head_dim_follows(hf, hidden, heads, "falcon")
    layout = qkv_layout(hf)
    kv_heads = {"grouped": get(hf, "num_kv_heads", default=heads), "multi_query": 1, "interleaved": heads}[layout]
    max_positions = hf.get("max_position_embeddings", 2048)
    theta, scaling = rope_from_hf(hf, max_positions)
    return FalconConfig(
        family="falcon",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=get(hf, "ffn_hidden_size", default=4 * hidden),
        max_seq_length=max_positions,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(get(hf, "layer_norm_epsilon", default=1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        separate_mlp_norm=_separate_norms(hf),
        bias=bool(hf.get("bias", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def config_to_hf(cfg: FalconConfig, base: Mapping[str, Any]) -> dict[str, Any]:
    layout = qkv_layout(base) if base.get("model_type") == "falcon" else None
    fits = {
        "grouped": True,
        "multi_query": cfg.num_kv_heads == 1 and not cfg.separate_mlp_norm,
        "interleaved": cfg.num_kv_heads == cfg.num_heads and not cfg.separate_mlp_norm,
        None: False,
    }
    if not fits[layout]:  # the 7B layout where it can express the model, else the 40B one
        layout = "multi_query" if fits["multi_query"] else "grouped"
    out = {
        "architectures": ["FalconForCausalLM"],
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


def weight_rules(cfg: FalconConfig, hf: Mapping[str, Any], names: Collection[str] = ()) -> list[TensorRule]:
    layout, b = qkv_layout(hf), cfg.bias
    if layout == "grouped":
        qkv_fuse, qkv_split = _grouped_qkv(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    elif layout == "interleaved":
        qkv_fuse, qkv_split = _interleaved_qkv(cfg.num_heads, cfg.head_dim)
    else:
        qkv_fuse, qkv_split = only, itself  # [Q; K; V] already
    separate = _separate_norms(hf)
    if separate != cfg.separate_mlp_norm:
        raise HFConversionError(
            f"Falcon config has {'two' if separate else 'one'} layer norm(s) per block but the "
            f"model separate_mlp_norm={cfg.separate_mlp_norm}"
        )
    rules = [TensorRule("embed.weight", ("transformer.word_embeddings.weight",))]
    for i in range(cfg.num_layers):
        h, L = f"transformer.h.{i}", f"layers.{i}"
        rules += linear(f"{L}.attn_norm", f"{h}.ln_attn" if separate else f"{h}.input_layernorm", True)
        if separate:
            rules += linear(f"{L}.mlp_norm", f"{h}.ln_mlp", True)
        rules += linear(f"{L}.attn.qkv", f"{h}.self_attention.query_key_value", b, fuse=qkv_fuse, split=qkv_split)
        rules += linear(f"{L}.attn.o", f"{h}.self_attention.dense", b)
        rules += linear(f"{L}.mlp.up", f"{h}.mlp.dense_h_to_4h", b)
        rules += linear(f"{L}.mlp.down", f"{h}.mlp.dense_4h_to_h", b)
    rules += linear("norm", "transformer.ln_f", True)
    if not cfg.tie_embeddings:
        rules.append(TensorRule("lm_head.weight", ("lm_head.weight",)))
    return rules
