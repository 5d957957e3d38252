"""The qwen family's config: the common decoder config and Qwen-MoE's dense layers at chosen indices."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import ModelConfig


@dataclass
class QwenConfig(ModelConfig):
    # Qwen-MoE's mlp_only_layers: these layers are dense SwiGLUs (dense_ffn_hidden_size wide) whatever
    # moe_layer_step says
    mlp_only_layers: tuple[int, ...] = ()

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

    def dense_layer_problems(self) -> list[str]:
        bad = [i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if bad:
            return [f"mlp_only_layers {list(self.mlp_only_layers)}: {bad} not layer indices in [0, {self.num_layers})"]
        if self.mlp_only_layers and not self.is_moe:
            return ["mlp_only_layers needs a model with experts (num_experts > 0)"]
        return []
