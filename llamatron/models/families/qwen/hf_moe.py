"""Qwen3-MoE (`Qwen3MoeForCausalLM`, model_type qwen3_moe) and Qwen2-MoE (`Qwen2MoeForCausalLM`, qwen2_moe) <->
llamatron: the experts of the config and weights.

Qwen2-MoE's attention is Qwen2's (q/k/v biases); beside the routed experts every token goes through a shared
expert `shared_expert_intermediate_size` wide whose output a sigmoid gate scales:
  layers.N.mlp.shared.gate_up (2·ffn, hidden)   <- mlp.shared_expert.gate_proj, up_proj
  layers.N.mlp.shared.down    (hidden, ffn)     <- mlp.shared_expert.down_proj
  layers.N.mlp.shared.gate    (1, hidden)       <- mlp.shared_expert_gate
Qwen3-MoE's attention and norms are Qwen3's (q/k RMSNorm, head_dim of its own). In both, each layer's MLP is a
router picking the top `num_experts_per_tok` of `num_experts` SwiGLU experts `moe_intermediate_size` wide, by a
softmax over all experts whose top-k weights are renormalised (`norm_topk_prob` true, as in every released
Qwen3-MoE: Mixtral's routing) or not (Qwen2-MoE's default; ModelConfig.moe_renormalize, models/moe.py).
llamatron stacks the experts:
  layers.N.mlp.router.weight   (E, hidden)          <- mlp.gate.weight
  layers.N.mlp.experts.gate_up (E, 2·ffn, hidden)   <- per expert e: rows [gate_proj; up_proj]
  layers.N.mlp.experts.down    (E, hidden, ffn)     <- per expert e: down_proj
The Hub stores the per-expert tensors (mlp.experts.{e}.gate_proj.weight, ...); transformers 5 holds them stacked
in memory (mlp.experts.gate_up_proj, mlp.experts.down_proj), which reads too. Export writes the Hub's names.

Dense layers among the sparse ones: every decoder_sparse_step-th layer is sparse (ModelConfig.moe_layer_step) but
those mlp_only_layers names (QwenConfig), the others SwiGLUs `intermediate_size` wide (dense_ffn_hidden_size).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ....errors import HFConversionError
from ...config import ModelConfig
from ...hf_format import TensorRule, cat, itself, linear, only, split_rows, stacked_expert_rules
from .config import QwenConfig

# transformers' Qwen3MoeConfig and Qwen2MoeConfig defaults for keys a config.json may leave out
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "qwen2_moe": {
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    },
}
_BOTH = {"norm_topk_prob": False, "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1}


def moe_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a qwen3_moe config.json's experts and router (HFConversionError if llamatron
    cannot compute what transformers would)."""
    defaults = {**_BOTH, **DEFAULTS[str(hf.get("model_type"))]}
    get = {**defaults, **{k: v for k, v in hf.items() if v is not None}}
    step = get["decoder_sparse_step"]
    only_dense = get.get("mlp_only_layers") or []
    if not (isinstance(only_dense, list) and all(isinstance(i, int) for i in only_dense)):
        raise HFConversionError(f"config.json has mlp_only_layers={only_dense!r}: it must be a list of layer indices")
    if not (isinstance(step, int) and step >= 1):
        raise HFConversionError(f"config.json has decoder_sparse_step={step!r}: it must be an integer >= 1")
    # dense layers among the sparse ones (every step-th sparse): SwiGLUs intermediate_size wide
    dense: dict[str, Any] = {"moe_layer_step": step} if step > 1 else {}
    if step > 1 or only_dense:  # dense layers among the sparse ones: SwiGLUs intermediate_size wide
        dense.update(dense_ffn_hidden_size=hf["intermediate_size"], mlp_only_layers=tuple(only_dense))
    # transformers 5 writes num_experts as num_local_experts (its attribute map); the Hub's configs say num_experts
    experts, top_k = get.get("num_local_experts", get["num_experts"]), get["num_experts_per_tok"]
    if not (isinstance(experts, int) and isinstance(top_k, int) and 1 <= top_k <= experts):
        raise HFConversionError(
            f"config.json has num_experts={experts!r}, num_experts_per_tok={top_k!r}: they must be integers with "
            "1 <= num_experts_per_tok <= num_experts"
        )
    shared: dict[str, Any] = {}
    if hf.get("model_type") == "qwen2_moe":  # transformers' Qwen2-MoE always has the gated shared expert
        width = get["shared_expert_intermediate_size"]
        if not (isinstance(width, int) and width > 0):
            raise HFConversionError(f"config.json has shared_expert_intermediate_size={width!r}: it must be > 0")
        shared = {"shared_expert_ffn": width, "shared_expert_gate": True}
    return {
        **shared,
        **dense,
        "num_experts": experts,
        "experts_per_token": top_k,
        "ffn_hidden_size": get["moe_intermediate_size"],  # every layer's MLP is experts of this width
        "router_aux_loss_coef": float(get["router_aux_loss_coef"]),
        "router_z_loss_coef": float(get.get("router_z_loss_coef", 0.0)),  # llamatron's own key, as for Mixtral
        "moe_renormalize": bool(get["norm_topk_prob"]),
    }


def moe_config_to_hf(cfg: QwenConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.ffn_hidden_size,
        "norm_topk_prob": cfg.moe_renormalize,
        "decoder_sparse_step": cfg.moe_layer_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }
    if cfg.dense_ffn_hidden_size:
        out["intermediate_size"] = cfg.dense_ffn_hidden_size
    if cfg.router_z_loss_coef:  # not transformers': kept for a round trip
        out["router_z_loss_coef"] = cfg.router_z_loss_coef
    if cfg.shared_expert_ffn:
        if not cfg.shared_expert_gate:
            raise HFConversionError("Qwen2-MoE's shared expert is gated; this model's is not (shared_expert_gate)")
        out["shared_expert_intermediate_size"] = cfg.shared_expert_ffn
    return out


def expert_rules(cfg: ModelConfig, layer: int, names: Collection[str] = ()) -> list[TensorRule]:
    """The router and experts of layer `layer` under the Hub's per-expert names, or transformers 5's stacked
    ones when `names` (the tensors at hand on import) hold those."""
    h, L = f"model.layers.{layer}.mlp", f"layers.{layer}.mlp"
    router = TensorRule(f"{L}.router.weight", (f"{h}.gate.weight",), only, itself)
    experts = stacked_expert_rules(h, L, cfg.num_experts, cfg.ffn_hidden_size, names)
    return [router, *_shared_rules(cfg, h, L), *experts]


def _shared_rules(cfg: ModelConfig, h: str, L: str) -> list[TensorRule]:
    """Qwen2-MoE's shared expert and its gate (none for Qwen3-MoE)."""
    if not cfg.shared_expert_ffn:
        return []
    s, ffn = f"{h}.shared_expert", cfg.shared_expert_ffn
    rules = linear(f"{L}.shared.gate_up", f"{s}.gate_proj|{s}.up_proj", False, fuse=cat, split=split_rows([ffn, ffn]))
    rules += linear(f"{L}.shared.down", f"{s}.down_proj", False)
    return rules + linear(f"{L}.shared.gate", f"{h}.shared_expert_gate", False)


__all__ = ["expert_rules", "moe_config_from_hf", "moe_config_to_hf"]
