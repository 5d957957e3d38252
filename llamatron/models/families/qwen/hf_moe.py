"""Qwen3-MoE (`Qwen3MoeForCausalLM`, model_type qwen3_moe) <-> llamatron: the experts of the config and weights.

Attention and norms are Qwen3's (q/k RMSNorm, head_dim of its own); each layer's MLP is a router picking the top
`num_experts_per_tok` of `num_experts` SwiGLU experts `moe_intermediate_size` wide, by a softmax over all experts
whose top-k weights are renormalised (`norm_topk_prob` true, as in every released Qwen3-MoE: Mixtral's routing) or
not (ModelConfig.moe_renormalize, models/moe.py). llamatron stacks the experts:
  layers.N.mlp.router.weight   (E, hidden)          <- mlp.gate.weight
  layers.N.mlp.experts.gate_up (E, 2·ffn, hidden)   <- per expert e: rows [gate_proj; up_proj]
  layers.N.mlp.experts.down    (E, hidden, ffn)     <- per expert e: down_proj
The Hub stores the per-expert tensors (mlp.experts.{e}.gate_proj.weight, ...); transformers 5 holds them stacked
in memory (mlp.experts.gate_up_proj, mlp.experts.down_proj), which reads too. Export writes the Hub's names.

Not yet represented, refused in one line: dense layers among the sparse ones (decoder_sparse_step > 1,
mlp_only_layers), Qwen2-MoE's shared expert.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ....errors import HFConversionError
from ...config import ModelConfig
from ...hf_format import TensorRule, itself, only, split_gate_up, stack_experts, stack_gate_up, unstack

# transformers' Qwen3MoeConfig defaults for keys a config.json may leave out
DEFAULTS: dict[str, Any] = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "decoder_sparse_step": 1,
}


def moe_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a qwen3_moe config.json's experts and router (HFConversionError if llamatron
    cannot compute what transformers would)."""
    get = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    if get["decoder_sparse_step"] != 1 or get.get("mlp_only_layers"):
        raise HFConversionError(
            f"config.json has decoder_sparse_step={get['decoder_sparse_step']!r}, mlp_only_layers="
            f"{get.get('mlp_only_layers')!r}: dense layers among the mixture-of-experts ones are not supported yet "
            "(every released Qwen3-MoE has every layer sparse)"
        )
    # transformers 5 writes num_experts as num_local_experts (its attribute map); the Hub's configs say num_experts
    experts, top_k = get.get("num_local_experts", get["num_experts"]), get["num_experts_per_tok"]
    if not (isinstance(experts, int) and isinstance(top_k, int) and 1 <= top_k <= experts):
        raise HFConversionError(
            f"config.json has num_experts={experts!r}, num_experts_per_tok={top_k!r}: they must be integers with "
            "1 <= num_experts_per_tok <= num_experts"
        )
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "ffn_hidden_size": get["moe_intermediate_size"],  # every layer's MLP is experts of this width
        "router_aux_loss_coef": float(get["router_aux_loss_coef"]),
        "router_z_loss_coef": float(get.get("router_z_loss_coef", 0.0)),  # llamatron's own key, as for Mixtral
        "moe_renormalize": bool(get["norm_topk_prob"]),
    }


def moe_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.ffn_hidden_size,
        "norm_topk_prob": cfg.moe_renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }
    if cfg.router_z_loss_coef:  # not transformers': kept for a round trip
        out["router_z_loss_coef"] = cfg.router_z_loss_coef
    return out


def expert_rules(cfg: ModelConfig, layer: int, names: Collection[str] = ()) -> list[TensorRule]:
    """The router and experts of layer `layer` under the Hub's per-expert names, or transformers 5's stacked
    ones when `names` (the tensors at hand on import) hold those."""
    h, L = f"model.layers.{layer}.mlp", f"layers.{layer}.mlp"
    router = TensorRule(f"{L}.router.weight", (f"{h}.gate.weight",), only, itself)
    if any(n.endswith(".mlp.experts.gate_up_proj") for n in names):
        return [
            router,
            TensorRule(f"{L}.experts.gate_up", (f"{h}.experts.gate_up_proj",)),
            TensorRule(f"{L}.experts.down", (f"{h}.experts.down_proj",)),
        ]
    e = range(cfg.num_experts)
    gate_up = tuple(f"{h}.experts.{i}.{w}_proj.weight" for i in e for w in ("gate", "up"))
    down = tuple(f"{h}.experts.{i}.down_proj.weight" for i in e)
    return [
        router,
        TensorRule(f"{L}.experts.gate_up", gate_up, stack_gate_up, split_gate_up(cfg.ffn_hidden_size)),
        TensorRule(f"{L}.experts.down", down, stack_experts, unstack),
    ]


__all__ = ["expert_rules", "moe_config_from_hf", "moe_config_to_hf"]
