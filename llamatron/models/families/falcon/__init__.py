"""The falcon family: Falcon 7B/40B/180B, attention and a GELU MLP in parallel from one residual, LayerNorm."""

from __future__ import annotations

from ...family import Family, HFAdapter
from . import hf
from .block import falcon_block, layer_norm
from .config import FalconConfig
from .presets import PRESETS

FAMILY = Family(
    name="falcon",
    description="Falcon",
    block=falcon_block,
    final_norm=layer_norm,
    presets=PRESETS,
    hf=HFAdapter(("falcon",), hf.config_from_hf, hf.config_to_hf, hf.weight_rules),
    config_class=FalconConfig,
    options=frozenset({"bias"}),
)
