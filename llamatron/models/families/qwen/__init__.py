"""The qwen family: Qwen2/Qwen2.5 (biases on q, k and v), Qwen3 dense (q/k RMSNorm, its own head_dim) and
Qwen3-MoE and Qwen2-MoE (Qwen3's or Qwen2's attention, a mixture of experts for every MLP, Qwen2-MoE's with a
gated shared expert), built of the pre-norm decoder layers of models/blocks.py with Qwen's options (block.py)."""

from __future__ import annotations

from ...blocks import rms_norm
from ...config import MOE_SETTINGS
from ...family import Family, HFAdapter
from . import hf
from .block import qwen_block
from .config import QwenConfig
from .presets import PRESETS


def problems(cfg: QwenConfig) -> list[str]:
    """A Qwen model is Qwen2 (qkv_bias) or Qwen3 (qk_norm): exactly one of them."""
    out = cfg.dense_layer_problems() + cfg.gate_problems()
    if cfg.qkv_bias == cfg.qk_norm:
        out.append(
            f"qkv_bias={cfg.qkv_bias} and qk_norm={cfg.qk_norm}: a qwen model is Qwen2/2.5 (qkv_bias: true) or "
            "Qwen3 (qk_norm: true), exactly one"
        )
    return out


FAMILY = Family(
    name="qwen",
    description="Qwen2, Qwen2.5, Qwen3, Qwen2-MoE, Qwen3-MoE",
    block=qwen_block,
    final_norm=rms_norm,
    presets=PRESETS,
    hf=HFAdapter(("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"), hf.config_from_hf, hf.config_to_hf, hf.weight_rules),
    config_class=QwenConfig,
    # Qwen's routing is softmax (router_score is Llama 4's and DeepSeek-V3's)
    options=frozenset({"head_dim", "num_experts", *MOE_SETTINGS}) - {"router_score"},
    problems=problems,
)
