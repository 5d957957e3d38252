"""The llama family: Llama 1/2/3/3.1, Code Llama, Mistral (sliding window) and Mixtral (a mixture of experts), all
pre-norm decoder layers of RMSNorm, attention with rotary embeddings and SwiGLU (models/blocks.py)."""

from __future__ import annotations

from ...blocks import decoder_block, rms_norm
from ...config import BALANCING_SETTINGS
from ...family import Family, HFAdapter
from . import hf
from .foreign import MEGATRON, META
from .presets import PRESETS

FAMILY = Family(
    name="llama",
    description="Llama 1/2/3, Code Llama, Mistral, Mixtral",
    block=decoder_block,
    final_norm=rms_norm,
    presets=PRESETS,
    hf=HFAdapter(("llama", "mistral", "mixtral"), hf.config_from_hf, hf.config_to_hf, hf.weight_rules),
    options=frozenset(
        {
            "head_dim",
            "sliding_window",
            "bias",
            "num_experts",
            "experts_per_token",
            "router_aux_loss_coef",
            "router_z_loss_coef",
            *BALANCING_SETTINGS,
        }
    ),
    meta_format=META,
    megatron_format=MEGATRON,
)
