"""The llama4 family: Llama 4 Scout and Maverick, text only (Llama4ForCausalLM). Pre-norm decoder layers of
models/blocks.py with the shared mixture of experts weighting its experts' inputs (moe.py: sigmoid weights, a
shared expert, interleaved with dense layers) and Llama 4's own attention (attention.py; its options in
config.py): NoPE layers with attention temperature tuning; chunked local attention with an L2 q/k norm on the
others (hf.py says which config.json key is which)."""

from __future__ import annotations

from ...blocks import rms_norm
from ...config import BALANCING_SETTINGS
from ...family import Family, HFAdapter
from . import hf
from .attention import llama4_block
from .config import Llama4Config
from .presets import PRESETS

# What the Llama 4 format fixes: a model that differs here cannot be written as one
_FIXED = {"router_score": "sigmoid", "router_weights_input": True, "moe_renormalize": False}


def problems(cfg: Llama4Config) -> list[str]:
    out = cfg.attention_problems()
    out += [] if cfg.is_moe else ["a llama4 model has experts: give num_experts >= 1"]
    out += [
        f"{name}={getattr(cfg, name)!r}: Llama 4's routing has {name}={value!r}"
        for name, value in _FIXED.items()
        if getattr(cfg, name) != value
    ]
    if cfg.shared_expert_ffn != cfg.ffn_hidden_size:
        out.append(
            f"shared_expert_ffn {cfg.shared_expert_ffn} != ffn_hidden_size {cfg.ffn_hidden_size}: Llama 4's shared "
            "expert is as wide as its routed ones"
        )
    return out


FAMILY = Family(
    name="llama4",
    description="Llama 4 Scout, Maverick (text)",
    block=llama4_block,
    final_norm=rms_norm,
    presets=PRESETS,
    hf=HFAdapter(("llama4_text", "llama4"), hf.config_from_hf, hf.config_to_hf, hf.weight_rules, hf.text_model),
    config_class=Llama4Config,
    options=frozenset(
        {
            "head_dim",
            "num_experts",
            "experts_per_token",
            "router_aux_loss_coef",
            "router_z_loss_coef",
            "moe_renormalize",
            "shared_expert_ffn",
            "moe_layer_step",
            "dense_ffn_hidden_size",
            "router_score",
            "router_weights_input",
            *BALANCING_SETTINGS,
        }
    ),
    problems=problems,
)
