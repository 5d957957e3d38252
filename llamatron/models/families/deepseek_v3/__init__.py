"""The deepseek_v3 family: DeepSeek-V3 and the models built like it (Kimi K2, Moonlight), text, in one folder
(issue 49): its config (config.py), its decoder layer (block.py: the shared pre-norm layer with its multi-head
latent attention, mla.py, whose decode cache is kept compressed, mla_cache.py, and the shared mixture of experts
routed by group-limited top-k, routing.py), its rotary row order and YaRN softmax scale (rope.py), presets and the
Hugging Face format (hf.py). Multi-token prediction (mtp.py) is the
family's extra heads on the last stage (block.py: deepseek_v3_mtp), trained by the language-model objective."""

from __future__ import annotations

from ...blocks import rms_norm
from ...config import MOE_SETTINGS
from ...family import Family, HFAdapter
from . import hf
from .block import deepseek_v3_block, deepseek_v3_mtp
from .config import DeepseekV3Config
from .presets import PRESETS


def problems(cfg: DeepseekV3Config) -> list[str]:
    return cfg.family_problems()


FAMILY = Family(
    name="deepseek_v3",
    description="DeepSeek-V3, Kimi K2, Moonlight (text)",
    block=deepseek_v3_block,
    final_norm=rms_norm,
    presets=PRESETS,
    hf=HFAdapter(("deepseek_v3",), hf.config_from_hf, hf.config_to_hf, hf.weight_rules),
    config_class=DeepseekV3Config,
    # the shared MoE's settings but those DeepSeek-V3's layers fix (an ungated shared expert, output weights,
    # every layer past the dense ones)
    options=frozenset({"head_dim", "num_experts", *MOE_SETTINGS}) - {"shared_expert_gate", "moe_layer_step"},
    problems=problems,
    extra_heads=deepseek_v3_mtp,
)
