"""The falcon family's config: the common decoder config and the one option only Falcon's block has."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import ModelConfig


@dataclass
class FalconConfig(ModelConfig):
    # Falcon 40B/180B's parallel block normalises the MLP's input with a LayerNorm of its own (7B: one norm feeds both)
    separate_mlp_norm: bool = False
