"""Mixtral (`MixtralForCausalLM`) <-> llamatron: the mixture-of-experts part of the config and of the weights.

Attention, norms and embeddings are Mistral's (hf.py beside this maps them). Each layer's MLP is a router and E SwiGLU
experts; llamatron stacks the experts:
  layers.N.mlp.router.weight  (E, hidden)          <- block_sparse_moe.gate.weight
  layers.N.mlp.experts.gate_up (E, 2·ffn, hidden)  <- per expert e: rows [w1 (gate); w3 (up)]
  layers.N.mlp.experts.down   (E, hidden, ffn)     <- per expert e: w2
The Hub (and every transformers version's save_pretrained, 4.x and 5.x) stores the per-expert w1/w2/w3.
transformers 5 holds the experts stacked in memory, as llamatron does (`mlp.gate.weight`,
`mlp.experts.gate_up_proj` with the same [gate; up] rows, `mlp.experts.down_proj`): a state dict saved from
such a model directly reads too. Export writes the Hub's names, which transformers >= 4.45 loads.

Here are pure functions of the config and names; hf.py builds its TensorRules from `expert_tensors`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from ....errors import HFConversionError
from ...config import ModelConfig
from ...hf_format import itself, only, split_gate_up, stack_experts, stack_gate_up, unstack

# transformers' MixtralConfig defaults for keys a config.json may leave out (4.x and 5.x agree on these); those
# of the attention differ from Llama's (kv heads = heads, 2048 positions, eps 1e-6, theta 10000).
MIXTRAL_DEFAULTS = {
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
}
_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}
# Keys of other MoE families that would change the model if a config.json under model_type mixtral meant them:
# transformers' Mixtral ignores them, so such a checkpoint is not what its config says. Refused unless they hold
# the value Mixtral's math has.
_MIXTRAL_VALUES: dict[str, Any] = {
    "norm_topk_prob": True,  # Mixtral renormalises the top-k weights
    "num_shared_experts": 0,
    "shared_expert_intermediate_size": 0,
    "n_shared_experts": 0,
    "decoder_sparse_step": 1,  # every layer is sparse
    "first_k_dense_replace": 0,
    "mlp_only_layers": [],
    "router_jitter_noise": 0.0,  # llamatron's router has no jitter (transformers applies it while training)
}

# (llamatron name, Hugging Face names, fuse, split): one entry of a TensorRule
ExpertTensor = tuple[
    str, tuple[str, ...], Callable[[list[torch.Tensor]], torch.Tensor], Callable[[torch.Tensor], list[torch.Tensor]]
]


def moe_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Mixtral config.json's experts and router (HFConversionError if llamatron
    cannot compute what transformers would)."""
    for key, value in _MIXTRAL_VALUES.items():
        if hf.get(key) not in (None, value):
            raise HFConversionError(
                f"config.json has {key}={hf[key]!r} under model_type mixtral; llamatron's Mixtral needs {value!r} "
                f"(or the key left out): this is not a model llamatron can represent"
            )
    ffn = hf.get("moe_intermediate_size")
    if ffn is not None and ffn != hf.get("intermediate_size"):
        raise HFConversionError(
            f"config.json has moe_intermediate_size={ffn} besides intermediate_size={hf.get('intermediate_size')}: "
            f"Mixtral's experts are intermediate_size wide"
        )
    experts = hf.get("num_local_experts", _DEFAULTS["num_local_experts"])
    top_k = hf.get("num_experts_per_tok", _DEFAULTS["num_experts_per_tok"])
    if not (isinstance(experts, int) and isinstance(top_k, int) and 1 <= top_k <= experts):
        raise HFConversionError(
            f"config.json has num_local_experts={experts!r}, num_experts_per_tok={top_k!r}: they must be integers "
            f"with 1 <= num_experts_per_tok <= num_local_experts"
        )
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", _DEFAULTS["router_aux_loss_coef"])),
        # not a transformers key: llamatron's own, written by export-hf only when set (see moe_config_to_hf)
        "router_z_loss_coef": float(hf.get("router_z_loss_coef", 0.0)),
    }


def moe_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The Mixtral config.json keys of `cfg`'s experts (the rest as for Mistral)."""
    if cfg.bias:
        raise HFConversionError("Mixtral has no biases in transformers; this model has bias=True")
    out: dict[str, Any] = {
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "router_jitter_noise": 0.0,
        "sliding_window": cfg.sliding_window,
    }
    if cfg.router_z_loss_coef:  # transformers has no z-loss: kept for a round trip, ignored by transformers
        out["router_z_loss_coef"] = cfg.router_z_loss_coef
    return out


def has_stacked_experts(names: Collection[str]) -> bool:
    """Whether Hugging Face tensor `names` hold transformers 5's stacked experts (else the Hub's per-expert)."""
    return any(n.endswith(".mlp.experts.gate_up_proj") for n in names)


def expert_tensors(cfg: ModelConfig, layer: int, stacked: bool = False) -> list[ExpertTensor]:
    """The router and experts of MoE layer `layer`, with their Hugging Face names (the Hub's per-expert ones,
    or transformers 5's stacked ones when `stacked`)."""
    h, L = f"model.layers.{layer}", f"layers.{layer}"
    if stacked:
        return [
            (f"{L}.mlp.router.weight", (f"{h}.mlp.gate.weight",), only, itself),
            (f"{L}.mlp.experts.gate_up", (f"{h}.mlp.experts.gate_up_proj",), only, itself),
            (f"{L}.mlp.experts.down", (f"{h}.mlp.experts.down_proj",), only, itself),
        ]
    e = f"{h}.block_sparse_moe.experts"
    gate_up = tuple(f"{e}.{i}.{w}.weight" for i in range(cfg.num_experts) for w in ("w1", "w3"))
    down = tuple(f"{e}.{i}.w2.weight" for i in range(cfg.num_experts))
    ffn = cfg.ffn_hidden_size
    return [
        (f"{L}.mlp.router.weight", (f"{h}.block_sparse_moe.gate.weight",), only, itself),
        (f"{L}.mlp.experts.gate_up", gate_up, stack_gate_up, split_gate_up(ffn)),
        (f"{L}.mlp.experts.down", down, stack_experts, unstack),
    ]


__all__ = [
    "MIXTRAL_DEFAULTS",
    "ExpertTensor",
    "expert_tensors",
    "has_stacked_experts",
    "moe_config_from_hf",
    "moe_config_to_hf",
]
