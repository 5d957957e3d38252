"""The llama4 family's Hugging Face format: model_type llama4_text (Llama4ForCausalLM).

Llama 4's decoder layers are Llama's pre-norm layers with these differences (Llama4Config's options):
- attention: every `no_rope_layer_interval`-th layer has no rotary embedding (NoPE) and attends to the whole causal
  context, with its queries' temperature tuned by position (`attn_temperature_tuning`, `floor_scale`,
  `attn_scale`); the other layers attend within chunks of `attention_chunk_size` tokens and, with `use_qk_norm`,
  RMS-normalise queries and keys (no weight) after rotating them;
- the MLP: every `interleave_moe_layer_step`-th layer is a mixture of experts (a router picking the top
  `num_experts_per_tok` of `num_local_experts`, each chosen expert's input scaled by the sigmoid of its logit, plus
  a shared expert every token goes through, all `intermediate_size` wide); the others are SwiGLUs
  `intermediate_size_mlp` wide.
Llama 4 rotates interleaved pairs of each head's dimensions (0 and 1, 2 and 3, ...: Meta's complex rotary), where
llamatron rotates the two halves (0 and d/2, ...): import reorders the rows of each query and key head (evens,
then odds), export puts them back; the q/k norm and the scores do not see the order. llamatron's tensors:
  attn.qkv                 rows [Q; K; V], Q and K heads reordered  <- self_attn.q_proj, k_proj, v_proj
  mlp.gate_up, mlp.down    (dense layers)                           <- feed_forward.gate_proj|up_proj, down_proj
  mlp.router.weight        (E, hidden)                              <- feed_forward.router.weight
  mlp.experts.gate_up      (E, 2·ffn, hidden)                       <- feed_forward.experts.gate_up_proj (E, hidden,
                                                                       2·ffn), transposed
  mlp.experts.down         (E, hidden, ffn)                         <- feed_forward.experts.down_proj (E, ffn,
                                                                       hidden), transposed
  mlp.shared.gate_up, .down                                         <- feed_forward.shared_expert.gate_proj|up_proj,
                                                                       down_proj
A llama4 checkpoint (vision + text, Llama4ForConditionalGeneration) is imported as its text model
(`text_model`: text_config and the language_model.* tensors), with a one-line notice. Refused in one line:
attention biases, MoE layers or NoPE layers at indices no interval describes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from ....errors import HFConversionError
from ...config import ModelConfig
from ...hf_format import TensorRule, cat, decoder_config_from_hf, decoder_config_keys, decoder_rules, linear, split_rows
from .config import Llama4Config

# transformers' Llama4TextConfig defaults (Scout's) for keys a config.json may leave out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "router_aux_loss_coef": 0.001,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attention_bias": False,
}


def text_model(hf: Mapping[str, Any]) -> tuple[dict[str, Any], str] | None:
    """A llama4 (vision + text: Llama4ForConditionalGeneration) config.json's text model and its tensors' prefix."""
    if hf.get("model_type") != "llama4":
        return None
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise HFConversionError(f"config.json has model_type llama4 and text_config={text!r}: expected a mapping")
    return {**text, "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"]}, "language_model."


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    text = text_model(hf)
    hf = text[0] if text is not None else hf
    get = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    if get.get("attention_bias"):
        raise HFConversionError("a Llama 4 with attention_bias=true is not supported (no released model has it)")
    layers, step = get["num_hidden_layers"], get["interleave_moe_layer_step"]
    if not (isinstance(step, int) and step >= 1 and isinstance(layers, int)):
        raise HFConversionError(f"config.json has interleave_moe_layer_step={step!r}: it must be an integer >= 1")
    _check_list(hf.get("moe_layers"), list(range(step - 1, layers, step)), "moe_layers", "interleave_moe_layer_step")
    interval = _nope_interval(get, layers)
    chunk = hf.get("attention_chunk_size", DEFAULTS["attention_chunk_size"])  # null: no chunks
    floor = get["floor_scale"]
    if not (isinstance(floor, (int, float)) and float(floor).is_integer() and floor >= 1):
        raise HFConversionError(f"config.json has floor_scale={floor!r}: it must be a whole number >= 1")
    return decoder_config_from_hf(
        get,
        "llama4",
        head_dim=DEFAULTS["head_dim"],
        config_class=Llama4Config,
        num_experts=get.get("num_local_experts"),
        experts_per_token=get["num_experts_per_tok"],
        router_aux_loss_coef=float(get["router_aux_loss_coef"]),
        router_z_loss_coef=float(get.get("router_z_loss_coef", 0.0)),  # llamatron's own key, kept for a round trip
        moe_renormalize=False,
        shared_expert_ffn=get["intermediate_size"],
        moe_layer_step=step,
        dense_ffn_hidden_size=get["intermediate_size_mlp"],
        router_score="sigmoid",
        router_weights_input=True,
        nope_layer_interval=interval,
        attention_chunk_size=chunk,
        qk_l2_norm=bool(get["use_qk_norm"]),
        attn_temperature_floor=int(floor) if get["attn_temperature_tuning"] else 0,
        attn_temperature_scale=float(get["attn_scale"]),
    )


def _nope_interval(get: Mapping[str, Any], layers: int) -> int:
    """no_rope_layers (1: the layer rotates) as an interval: every interval-th layer without rotary (0: none)."""
    interval = get["no_rope_layer_interval"]
    given = get.get("no_rope_layers")
    if given:
        matches = [k for k in range(2, layers + 2) if given == [int((i + 1) % k != 0) for i in range(layers)]]
        if all(x == 1 for x in given) and len(given) == layers:
            return 0
        if not matches:
            raise HFConversionError(
                f"config.json has no_rope_layers={given!r}: llamatron's NoPE layers are every k-th layer "
                "(no_rope_layer_interval); this pattern is no interval's"
            )
        return matches[0]
    if not (isinstance(interval, int) and interval >= 1):
        raise HFConversionError(f"config.json has no_rope_layer_interval={interval!r}: it must be an integer >= 1")
    return interval


def _check_list(given: Any, derived: list[int], name: str, rule: str) -> None:
    if given is not None and list(given) != derived:
        raise HFConversionError(
            f"config.json has {name}={given!r}, not every {rule}-th layer ({derived}): llamatron's layers of a kind "
            f"are every k-th; such a {name} is not supported"
        )


def config_to_hf(cfg: Llama4Config, base: Mapping[str, Any]) -> dict[str, Any]:
    layers, step = cfg.num_layers, cfg.moe_layer_step
    out = {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        **decoder_config_keys(cfg),
        "intermediate_size_mlp": cfg.dense_ffn_hidden_size or cfg.ffn_hidden_size,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "interleave_moe_layer_step": step,
        "moe_layers": list(range(step - 1, layers, step)),
        "no_rope_layer_interval": cfg.nope_layer_interval or layers + 1,
        "no_rope_layers": [int(cfg.layer_has_rope(i)) for i in range(layers)],
        "attention_chunk_size": cfg.attention_chunk_size,
        "use_qk_norm": cfg.qk_l2_norm,
        "attn_temperature_tuning": bool(cfg.attn_temperature_floor),
        "floor_scale": cfg.attn_temperature_floor or DEFAULTS["floor_scale"],
        "attn_scale": cfg.attn_temperature_scale,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "attention_bias": False,
        "layer_types": [
            "chunked_attention" if cfg.layer_attention_chunk(i) is not None else "full_attention" for i in range(layers)
        ],
    }
    if cfg.router_z_loss_coef:  # not transformers': kept for a round trip
        out["router_z_loss_coef"] = cfg.router_z_loss_coef
    return out


def interleaved_to_halves(heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows of `heads` heads, each [0, 1, 2, 3, ...] -> [0, 2, ..., 1, 3, ...] (Meta's rotary pairs -> halves)."""
    return lambda w: w.reshape(heads, -1, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def halves_to_interleaved(heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda w: w.reshape(heads, 2, -1, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def _qkv_rule(cfg: Llama4Config, h: str, L: str) -> TensorRule:
    d, heads, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    to_q, to_k = interleaved_to_halves(heads), interleaved_to_halves(kv)
    from_q, from_k = halves_to_interleaved(heads), halves_to_interleaved(kv)
    sizes = [heads * d, kv * d, kv * d]

    def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = parts
        return torch.cat([to_q(q), to_k(k), v])

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        q, k, v = t.split(sizes)
        return [from_q(q), from_k(k), v]

    names = tuple(f"{h}.self_attn.{x}_proj.weight" for x in "qkv")
    return TensorRule(f"{L}.attn.qkv.weight", names, fuse, split)


def _transposed(t: torch.Tensor) -> list[torch.Tensor]:
    return [t.transpose(1, 2)]


def _transpose_one(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].transpose(1, 2)


def layer_rules(cfg: Llama4Config, i: int) -> list[TensorRule]:
    h, L = f"model.layers.{i}", f"layers.{i}"
    f = f"{h}.feed_forward"
    rules = [TensorRule(f"{L}.attn_norm.weight", (f"{h}.input_layernorm.weight",)), _qkv_rule(cfg, h, L)]
    rules += linear(f"{L}.attn.o", f"{h}.self_attn.o_proj", False)
    rules.append(TensorRule(f"{L}.mlp_norm.weight", (f"{h}.post_attention_layernorm.weight",)))
    if not cfg.is_moe_layer(i):
        ffn = cfg.layer_ffn(i)
        rules += linear(f"{L}.mlp.gate_up", f"{f}.gate_proj|{f}.up_proj", False, fuse=cat, split=split_rows([ffn, ffn]))
        return rules + linear(f"{L}.mlp.down", f"{f}.down_proj", False)
    s, ffn = f"{f}.shared_expert", cfg.shared_expert_ffn
    rules.append(TensorRule(f"{L}.mlp.router.weight", (f"{f}.router.weight",)))
    rules += [
        TensorRule(f"{L}.mlp.experts.{x}", (f"{f}.experts.{x}_proj",), _transpose_one, _transposed)
        for x in ("gate_up", "down")
    ]
    halves = split_rows([ffn, ffn])
    rules += linear(f"{L}.mlp.shared.gate_up", f"{s}.gate_proj|{s}.up_proj", False, fuse=cat, split=halves)
    return rules + linear(f"{L}.mlp.shared.down", f"{s}.down_proj", False)


def weight_rules(cfg: Llama4Config, hf: Mapping[str, Any], names: Collection[str] = ()) -> list[TensorRule]:
    return decoder_rules(cfg, [layer_rules(cfg, i) for i in range(cfg.num_layers)])


__all__ = ["config_from_hf", "config_to_hf", "text_model", "weight_rules"]
