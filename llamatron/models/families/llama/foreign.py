"""Llama models in the checkpoint formats they were first trained and published in: Meta's consolidated files
(Llama 1, 2, 3.x, Code Llama) and Megatron-LM runs (Megatron-LM, megatron-core, Megatron-LLaMA, Megatron-LLM).
What is here is the llama family's part (names, config keys, what the run must have been); the files are read by
interop/meta_consolidated.py and interop/megatron.py."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ...family import MegatronFormat, MetaFormat
from ...family import megatron_arg as _arg

# Meta name (after "layers.N.") -> (Hugging Face name, dimension split across model-parallel files or None)
META_LAYER_NAMES = {
    "attention.wq.weight": ("self_attn.q_proj.weight", 0),
    "attention.wk.weight": ("self_attn.k_proj.weight", 0),
    "attention.wv.weight": ("self_attn.v_proj.weight", 0),
    "attention.wo.weight": ("self_attn.o_proj.weight", 1),
    "feed_forward.w1.weight": ("mlp.gate_proj.weight", 0),
    "feed_forward.w3.weight": ("mlp.up_proj.weight", 0),
    "feed_forward.w2.weight": ("mlp.down_proj.weight", 1),
    "attention_norm.weight": ("input_layernorm.weight", None),
    "ffn_norm.weight": ("post_attention_layernorm.weight", None),
}
META_GLOBAL_NAMES = {
    "tok_embeddings.weight": ("model.embed_tokens.weight", 1),
    "norm.weight": ("model.norm.weight", None),
    "output.weight": ("lm_head.weight", 0),
}
# `use_scaled_rope` (Llama 3.1+): the constants of Meta's reference code (llama-models' apply_scaling), which
# params.json does not repeat; transformers' conversion writes the same for 3.1.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def meta_ffn_hidden_size(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The SwiGLU width Meta's model code builds: 2/3 of 4·dim, times ffn_dim_multiplier, rounded up to
    a multiple of multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * -(-hidden // multiple_of)


def _max_positions(p: Mapping[str, Any], vocab: int) -> int:
    """The context the model was trained for; params.json rarely says (its max_seq_len is a runtime setting)."""
    if p.get("max_seq_len"):
        return int(p["max_seq_len"])
    if p.get("use_scaled_rope"):
        return 131072  # Llama 3.1+
    if vocab >= 128000:
        return 8192  # Llama 3 (its 128K-token vocabulary)
    return 16384 if float(p.get("rope_theta", 10000.0)) > 10000.0 else 4096  # Code Llama; Llama 2


def _meta_hf_config(p: Mapping[str, Any], vocab: int, ffn: int, dtype: str) -> dict[str, Any]:
    heads = p["n_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": p["dim"],
        "intermediate_size": ffn,
        "num_hidden_layers": p["n_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": p.get("n_kv_heads") or heads,
        "hidden_act": "silu",
        "rms_norm_eps": p.get("norm_eps", 1e-5),
        "rope_theta": float(p.get("rope_theta", 10000.0)),
        "rope_scaling": dict(LLAMA3_ROPE_SCALING) if p.get("use_scaled_rope") else None,
        "max_position_embeddings": _max_positions(p, vocab),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


# params.json's fields: name -> (required, kind). "int": a positive integer; "number": a positive finite number;
# "vocab": -1 (the weights say) or a positive integer; "flag": true or false.
_META_FIELDS = {
    "dim": (True, "int"),
    "n_layers": (True, "int"),
    "n_heads": (True, "int"),
    "n_kv_heads": (False, "int"),
    "multiple_of": (False, "int"),
    "ffn_dim_multiplier": (False, "number"),
    "norm_eps": (False, "number"),
    "rope_theta": (False, "number"),
    "max_seq_len": (False, "int"),
    "vocab_size": (False, "vocab"),
    "use_scaled_rope": (False, "flag"),
}
_KIND_WORDS = {
    "int": "a positive integer",
    "number": "a positive finite number",
    "vocab": "-1 or a positive integer",
    "flag": "true or false",
}


def _fits(value: Any, kind: str) -> bool:
    if kind == "flag":
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False  # a string "500000" or true is not a number, even if Python would convert it
    if kind == "number":
        return math.isfinite(value) and value > 0
    return isinstance(value, int) and (value > 0 or (kind == "vocab" and value == -1))


def _meta_field_problems(p: Mapping[str, Any]) -> list[str]:
    problems = [
        f"{name} must be {_KIND_WORDS[kind]}, not {json.dumps(p.get(name))[:40]}"
        for name, (required, kind) in _META_FIELDS.items()
        if (required or p.get(name) is not None) and not _fits(p.get(name), kind)
    ]
    if problems:
        return problems
    heads, kv = p["n_heads"], p.get("n_kv_heads") or p["n_heads"]
    if p["dim"] % (2 * heads) or heads % kv:  # rotary pairs need an even head size; GQA whole groups
        problems.append(f"dim={p['dim']}, n_heads={heads}, n_kv_heads={kv} do not split into even heads and groups")
    return problems


def _meta_params_problems(p: Mapping[str, Any], vocab: int, ffn: int) -> list[str]:
    want_ffn = meta_ffn_hidden_size(p["dim"], p.get("multiple_of", 256), p.get("ffn_dim_multiplier"))
    problems = []
    if want_ffn != ffn:
        problems.append(
            f"dim={p['dim']}, multiple_of={p.get('multiple_of', 256)}, ffn_dim_multiplier="
            f"{p.get('ffn_dim_multiplier')} give a feed-forward width of {want_ffn}, the weights have {ffn}"
        )
    if p.get("vocab_size", -1) > 0 and p["vocab_size"] != vocab:
        problems.append(f"vocab_size={p['vocab_size']}, the output layer has {vocab} rows")
    return problems


META = MetaFormat(META_LAYER_NAMES, META_GLOBAL_NAMES, _meta_field_problems, _meta_hf_config, _meta_params_problems)


# ---------------------------------------------------------------- Megatron-LM


def _is_rotary(args: Any) -> bool:
    kind = _arg(args, "position_embedding_type")
    if hasattr(kind, "value"):  # Megatron-LLM's PositionEmbeddingType (an enum member's stand-in): rotary = 1
        return kind.value == 1
    return kind in ("rope", "rotary") or bool(_arg(args, "use_rotary_position_embeddings"))


def megatron_args_problems(args: Any) -> list[str]:
    """What in a run's args llamatron's Llama cannot be: each names the Megatron flag."""
    problems = []
    if not (_arg(args, "swiglu") or _arg(args, "glu_activation") == "swiglu"):
        problems.append("the MLP is not SwiGLU (no --swiglu / --glu_activation swiglu)")
    if _arg(args, "normalization", default="RMSNorm") != "RMSNorm" or _arg(args, "use_rms_norm") is False:
        problems.append(f"--normalization {_arg(args, 'normalization', default='LayerNorm')}: Llama uses RMSNorm")
    if not _is_rotary(args):
        problems.append(f"position embeddings {_arg(args, 'position_embedding_type')!r}: Llama uses rotary ones")
    if float(_arg(args, "rotary_percent", default=1.0)) != 1.0:
        problems.append(f"--rotary-percent {_arg(args, 'rotary_percent')}: llamatron rotates the whole head")
    if _arg(args, "parallel_attn"):
        problems.append("--parallel_attn (Falcon's parallel block)")
    if _arg(args, "num_experts"):
        problems.append(f"--num-experts {_arg(args, 'num_experts')} (mixture of experts)")
    return problems


def megatron_hf_config(args: Any, vocab: int, flavour: str) -> dict[str, Any]:
    """The Hugging Face config.json of the Llama a Megatron run's args describe (`vocab`: rows kept; `flavour`:
    megatron-lm, megatron-llama or megatron-llm)."""
    heads = int(_arg(args, "num_attention_heads"))
    if _arg(args, "num_attention_heads_kv") is not None:  # Megatron-LLM
        kv = int(_arg(args, "num_attention_heads_kv"))
    else:
        kv = int(_arg(args, "num_query_groups", default=heads)) if _arg(args, "group_query_attention") else heads
    hidden = int(_arg(args, "hidden_size"))
    hf: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_arg(args, "ffn_hidden_size", default=4 * hidden)),
        "num_hidden_layers": int(_arg(args, "num_layers", "encoder_num_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": int(_arg(args, "kv_channels", default=hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(_arg(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
        "rope_theta": float(_arg(args, "rotary_base", "rope_theta", default=10000.0)),
        "max_position_embeddings": int(_arg(args, "max_position_embeddings", "seq_length", default=4096)),
        "tie_word_embeddings": False,
    }
    linear = _arg(args, "rotary_seq_len_interpolation_factor") or (
        _arg(args, "rope_scaling_factor") if flavour == "megatron-llm" else None
    )
    if _arg(args, "use_rope_scaling"):  # megatron-core's Llama 3.1 scaling: its fixed constants
        hf["rope_scaling"] = {**LLAMA3_ROPE_SCALING, "factor": float(_arg(args, "rope_scaling_factor", default=8.0))}
    elif linear and float(linear) != 1.0:  # positions divided by the factor
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(linear)}
    return hf


# Hugging Face name within layer g -> (part, index among the part's outputs)
MEGATRON = MegatronFormat(
    megatron_args_problems,
    megatron_hf_config,
    hf_layer_names={
        "input_layernorm.weight": ("attn_norm", 0),
        "self_attn.q_proj.weight": ("qkv", 0),
        "self_attn.k_proj.weight": ("qkv", 1),
        "self_attn.v_proj.weight": ("qkv", 2),
        "self_attn.o_proj.weight": ("proj", 0),
        "post_attention_layernorm.weight": ("mlp_norm", 0),
        "mlp.gate_proj.weight": ("fc1", 0),
        "mlp.up_proj.weight": ("fc1", 1),
        "mlp.down_proj.weight": ("fc2", 0),
    },
    hf_global_names={"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "head": "lm_head.weight"},
)
