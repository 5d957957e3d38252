"""The qwen family's config: the common decoder config, Qwen2's q/k/v biases or Qwen3's q/k norms (read by its
block, block.py), Qwen2-MoE's shared expert gate and Qwen-MoE's dense layers at chosen indices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import MOE_SETTINGS, ModelConfig


@dataclass
class QwenConfig(ModelConfig):
    moe_settings: ClassVar[tuple[str, ...]] = (*MOE_SETTINGS, "shared_expert_gate")

    # Qwen-MoE's mlp_only_layers: these layers are dense SwiGLUs (dense_ffn_hidden_size wide) whatever
    # moe_layer_step says
    mlp_only_layers: tuple[int, ...] = ()
    qkv_bias: bool = False  # biases on the query, key and value projections only (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each query and key head before the rotary embedding (Qwen3)
    # the shared expert's output scaled by a sigmoid gate of the token (Qwen2-MoE; needs shared_expert_ffn)
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.mlp_only_layers, list):  # a checkpoint's meta.json, YAML
            self.mlp_only_layers = tuple(self.mlp_only_layers)

    def is_moe_layer(self, index: int) -> bool:
        return super().is_moe_layer(index) and index not in self.mlp_only_layers

    @property
    def num_moe_layers(self) -> int:
        sparse_by_step = ModelConfig.is_moe_layer
        dense = sum(1 for i in set(self.mlp_only_layers) if sparse_by_step(self, i))
        return ModelConfig.num_moe_layers.fget(self) - dense  # type: ignore[attr-defined]

    def gate_problems(self) -> list[str]:
        if self.shared_expert_gate and self.is_moe and not self.shared_expert_ffn:
            return ["shared_expert_gate needs a shared expert: give shared_expert_ffn > 0"]
        return []

    def dense_layer_problems(self) -> list[str]:
        bad = [i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if bad:
            return [f"mlp_only_layers {list(self.mlp_only_layers)}: {bad} not layer indices in [0, {self.num_layers})"]
        if self.mlp_only_layers and not self.is_moe:
            return ["mlp_only_layers needs a model with experts (num_experts > 0)"]
        return []
