"""The deepseek_v3 family's Hugging Face format: model_type deepseek_v3 (DeepseekV3ForCausalLM; Kimi K2 and
Moonlight are published as it).

Layer N (`model.layers.N.`):
  attn_norm, mlp_norm                <- input_layernorm, post_attention_layernorm
  attn.{q | q_a, q_norm, q_b}        <- self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}
  attn.kv_a, attn.kv_norm, attn.kv_b <- self_attn.kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
  attn.o                             <- self_attn.o_proj
  the first first_k_dense_replace layers:
  mlp.gate_up, mlp.down              <- mlp.gate_proj|up_proj, mlp.down_proj
  the others:
  mlp.router.weight, mlp.expert_bias <- mlp.gate.weight, mlp.gate.e_score_correction_bias (a model trained
                                        without the bias exports zeros, which route as none)
  mlp.experts.gate_up, .down         <- mlp.experts.{e}.gate_proj|up_proj, down_proj (or transformers 5's stacked)
  mlp.shared.gate_up, .down          <- mlp.shared_experts.gate_proj|up_proj, down_proj
With rope_interleave (DeepSeek's published configs), the rotary rows of q/q_b and kv_a are reordered from
interleaved pairs to llamatron's halves (rope.py), and back at export. Refused in one line: attention biases, MoE
layers at a frequency other than every layer, and routing other than sigmoid scores with the balancing bias
(topk_method noaux_tc).

Multi-token prediction module j (num_nextn_predict_layers of them) is layer num_layers + j (`model.layers.{L+j}.`):
  extra_heads.j.{enorm, hnorm, eh_proj, norm} <- enorm, hnorm, eh_proj, shared_head.norm
  extra_heads.j.block                         <- the decoder layer's own names, as layer L + j
  embed_tokens, shared_head.head              the model's embedding and head again: checked equal on import and
                                              read once; written back on export
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from ....errors import HFConversionError
from ...config import ModelConfig
from ...hf_format import (
    TensorRule,
    cat,
    decoder_config_from_hf,
    linear,
    split_rows,
    stacked_expert_rules,
)
from .config import DeepseekV3Config
from .mla import HF_NAMES, rotary_block
from .rope import halves_from_interleaved, interleaved_from_halves

# transformers' DeepseekV3Config defaults (DeepSeek-V3's own) for keys a config.json may leave out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,
}


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    get = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    if get.get("attention_bias"):
        raise HFConversionError("a DeepSeek-V3 with attention_bias=true is not supported (no released model has it)")
    if get.get("topk_method", "noaux_tc") != "noaux_tc" or get.get("scoring_func", "sigmoid") != "sigmoid":
        raise HFConversionError(
            f"topk_method={get.get('topk_method')!r}, scoring_func={get.get('scoring_func')!r}: llamatron routes "
            "DeepSeek-V3's way (noaux_tc, sigmoid)"
        )
    if get.get("moe_layer_freq", 1) != 1:
        raise HFConversionError(
            f"moe_layer_freq={get['moe_layer_freq']!r}: every layer past the dense ones has experts"
        )
    nope, rope = get["qk_nope_head_dim"], get["qk_rope_head_dim"]
    experts, ffn = get["n_routed_experts"], get["moe_intermediate_size"]
    return decoder_config_from_hf(
        # transformers' head_dim is the rotary width; llamatron's the query·key width
        {**get, "intermediate_size": ffn, "num_key_value_heads": get["num_attention_heads"], "head_dim": nope + rope},
        "deepseek_v3",
        head_dim=nope + rope,
        config_class=DeepseekV3Config,
        dense_ffn_hidden_size=get["intermediate_size"],
        num_experts=experts,
        experts_per_token=get["num_experts_per_tok"],
        router_aux_loss_coef=float(get.get("router_aux_loss_coef", 0.0)),  # llamatron's own key, for a round trip
        router_z_loss_coef=float(get.get("router_z_loss_coef", 0.0)),
        moe_renormalize=bool(get["norm_topk_prob"]),
        shared_expert_ffn=get["n_shared_experts"] * ffn,
        router_score="sigmoid",
        router_expert_bias=True,
        q_lora_rank=get["q_lora_rank"] if hf.get("q_lora_rank", DEFAULTS["q_lora_rank"]) is not None else None,
        kv_lora_rank=get["kv_lora_rank"],
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=get["v_head_dim"],
        n_group=get["n_group"],
        topk_group=get["topk_group"],
        routed_scaling_factor=float(get["routed_scaling_factor"]),
        first_k_dense_replace=get["first_k_dense_replace"],
        num_nextn_predict_layers=int(get.get("num_nextn_predict_layers") or 0),
        rope_interleave=bool(get["rope_interleave"]),
    )


def config_to_hf(cfg: DeepseekV3Config, base: Mapping[str, Any]) -> dict[str, Any]:
    ffn = cfg.ffn_hidden_size
    shared, rest = divmod(cfg.shared_expert_ffn, ffn)
    if rest:
        raise HFConversionError(f"shared_expert_ffn {cfg.shared_expert_ffn} is not a whole number of experts of {ffn}")
    out: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.dense_ffn_hidden_size or ffn,
        "moe_intermediate_size": ffn,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "head_dim": cfg.qk_rope_head_dim,  # transformers' DeepseekV3Config: the rotary width
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "n_routed_experts": cfg.num_experts,
        "n_shared_experts": shared,
        "num_experts_per_tok": cfg.experts_per_token,
        "norm_topk_prob": cfg.moe_renormalize,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "rope_interleave": cfg.rope_interleave,
        "attention_bias": False,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }
    if cfg.router_z_loss_coef:  # not transformers': kept for a round trip
        out["router_z_loss_coef"] = cfg.router_z_loss_coef
    return out


def _attention_rules(cfg: DeepseekV3Config, h: str, L: str) -> list[TensorRule]:
    children = ["q"] if cfg.q_lora_rank is None else ["q_a", "q_norm", "q_b"]
    rules = []
    for child in [*children, "kv_a", "kv_norm", "kv_b", "o"]:
        names = (f"{L}.{child}.weight", (f"{h}.{HF_NAMES[child]}.weight",))
        block = rotary_block(child, cfg.mla()) if cfg.rope_interleave else None
        if block is None:
            rules.append(TensorRule(*names))
        else:
            rules.append(TensorRule(*names, *_rotary_order(block, cfg.qk_rope_head_dim)))
    return rules


def _rotary_order(block: int, rope: int) -> tuple[Callable, Callable]:
    """(import, export) of a weight whose rotary rows are interleaved pairs in Hugging Face's order (rope.py)."""

    def to_halves(parts: list[torch.Tensor]) -> torch.Tensor:
        return halves_from_interleaved(parts[0], block, rope)

    def to_pairs(t: torch.Tensor) -> list[torch.Tensor]:
        return [interleaved_from_halves(t, block, rope)]

    return to_halves, to_pairs


def _moe_rules(cfg: DeepseekV3Config, h: str, L: str, names: Collection[str]) -> list[TensorRule]:
    s, shared = f"{h}.shared_experts", cfg.shared_expert_ffn
    gate, bias = f"{h}.gate.weight", f"{h}.gate.e_score_correction_bias"
    if cfg.router_expert_bias:
        rules = [TensorRule(f"{L}.router.weight", (gate,)), TensorRule(f"{L}.expert_bias", (bias,), _fp32, _as_is)]
    else:  # trained without the balancing bias: DeepSeek-V3's format holds one, which routes as none when zero
        rules = [TensorRule(f"{L}.router.weight", (gate, bias), _first, _with_zero_bias)]
    rules += linear(
        f"{L}.shared.gate_up", f"{s}.gate_proj|{s}.up_proj", False, fuse=cat, split=split_rows([shared] * 2)
    )
    rules += linear(f"{L}.shared.down", f"{s}.down_proj", False)
    return rules + stacked_expert_rules(h, L, cfg.num_experts, cfg.ffn_hidden_size, names)


def _fp32(parts: list[torch.Tensor]) -> torch.Tensor:
    """The balancing bias is fp32 in every precision (models/moe.py)."""
    return parts[0].float()


def _as_is(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def _first(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0]


def _with_zero_bias(router: torch.Tensor) -> list[torch.Tensor]:
    """The router's weight and a zero balancing bias (fp32, one per expert) beside it."""
    return [router, torch.zeros(router.shape[0], dtype=torch.float32)]


def weight_rules(cfg: DeepseekV3Config, hf: Mapping[str, Any], names: Collection[str] = ()) -> list[TensorRule]:
    embeds, heads = _mtp_copies(cfg)
    if cfg.tie_embeddings:
        embeds += heads
    rules = [
        TensorRule(
            "embed.weight", ("model.embed_tokens.weight", *embeds), *_same_copies("embed.weight", 1 + len(embeds))
        )
    ]
    for i in range(cfg.num_layers):
        rules += _layer_rules(cfg, f"model.layers.{i}", f"layers.{i}", i, names)
    rules.append(TensorRule("norm.weight", ("model.norm.weight",)))
    if not cfg.tie_embeddings:
        rules.append(
            TensorRule("lm_head.weight", ("lm_head.weight", *heads), *_same_copies("lm_head.weight", 1 + len(heads)))
        )
    return rules + _mtp_rules(cfg, names)


def _layer_rules(cfg: DeepseekV3Config, h: str, L: str, i: int, names: Collection[str]) -> list[TensorRule]:
    """Decoder layer `i`'s tensors (an MTP module's block is layer num_layers + its depth - 1)."""
    rules = [TensorRule(f"{L}.attn_norm.weight", (f"{h}.input_layernorm.weight",))]
    rules += _attention_rules(cfg, f"{h}.self_attn", f"{L}.attn")
    rules.append(TensorRule(f"{L}.mlp_norm.weight", (f"{h}.post_attention_layernorm.weight",)))
    if cfg.is_moe_layer(i):
        return rules + _moe_rules(cfg, f"{h}.mlp", f"{L}.mlp", names)
    ffn = cfg.layer_ffn(i)
    rules += linear(
        f"{L}.mlp.gate_up", f"{h}.mlp.gate_proj|{h}.mlp.up_proj", False, fuse=cat, split=split_rows([ffn] * 2)
    )
    return rules + linear(f"{L}.mlp.down", f"{h}.mlp.down_proj", False)


def _mtp_rules(cfg: DeepseekV3Config, names: Collection[str]) -> list[TensorRule]:
    """The MTP modules (mtp.py) as DeepSeek's checkpoints hold them: layer num_layers + j, its decoder layer's
    tensors beside enorm, hnorm, eh_proj and shared_head.norm."""
    rules = []
    for j in range(cfg.num_nextn_predict_layers):
        i = cfg.num_layers + j
        h, M = f"model.layers.{i}", f"extra_heads.{j}"
        for ours, theirs in (
            ("enorm", "enorm"),
            ("hnorm", "hnorm"),
            ("eh_proj", "eh_proj"),
            ("norm", "shared_head.norm"),
        ):
            rules.append(TensorRule(f"{M}.{ours}.weight", (f"{h}.{theirs}.weight",)))
        rules += _layer_rules(cfg, h, f"{M}.block", i, names)
    return rules


def _mtp_copies(cfg: DeepseekV3Config) -> tuple[list[str], list[str]]:
    """The copies of the embedding and of the head each MTP module's checkpoint tensors hold (embed_tokens,
    shared_head.head): the model's own, read once and checked equal on import, written back on export."""
    layers = range(cfg.num_layers, cfg.num_layers + cfg.num_nextn_predict_layers)
    return [f"model.layers.{i}.embed_tokens.weight" for i in layers], [
        f"model.layers.{i}.shared_head.head.weight" for i in layers
    ]


def _same_copies(name: str, count: int) -> tuple[Callable, Callable]:
    """(import, export) of a tensor the checkpoint holds several equal copies of: the first, once every copy is
    checked equal to it (files' headers, read for shapes, are not); each copy written back."""

    def first(parts: list[torch.Tensor]) -> torch.Tensor:
        if not parts[0].is_meta and not all(torch.equal(parts[0], p) for p in parts[1:]):
            raise HFConversionError(
                f"the multi-token prediction modules' copies of {name} differ from the model's: DeepSeek-V3 "
                "shares one embedding and head; import a checkpoint whose copies are equal"
            )
        return parts[0]

    def copies(t: torch.Tensor) -> list[torch.Tensor]:
        return [t] * count

    return first, copies
