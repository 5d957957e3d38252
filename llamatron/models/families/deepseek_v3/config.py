"""The deepseek_v3 family's config: the common decoder config (its mixture of experts in the shared MoE fields:
sigmoid scores, the balancing bias, a shared expert, dense first layers) and DeepSeek-V3's own options: the latent
attention's shape, group-limited routing, the dense first layers' count, multi-token prediction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...config import ModelConfig
from .mla import MLAConfig
from .mtp import mtp_problems
from .rope import yarn_softmax_scale
from .routing import routing_problems


@dataclass
class DeepseekV3Config(ModelConfig):
    # Multi-head latent attention (mla.py): the query through a low-rank projection of this rank (None: one
    # projection), keys and values from a latent of kv_lora_rank, each head's key qk_nope_head_dim wide plus the
    # rotary key qk_rope_head_dim wide shared by every head, values v_head_dim wide. head_dim is
    # qk_nope_head_dim + qk_rope_head_dim (the query·key width).
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # Group-limited routing (routing.py): the experts in n_group groups, each token's top_k among its topk_group
    # best groups; the chosen weights times routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # The first layers are dense SwiGLUs dense_ffn_hidden_size wide, the rest mixtures of experts
    first_k_dense_replace: int = 0
    # Multi-token prediction modules after the last layer (DeepSeek-V3's one; 0: none), each a MoE decoder layer
    # (mtp.py), on the last stage; training adds mtp_loss_weight (λ: DeepSeek-V3 trained with 0.3, then 0.1)
    # times their mean cross entropy
    num_nextn_predict_layers: int = 0
    mtp_loss_weight: float = 0.1
    # The published weights lay each rotary head out in interleaved pairs (import reorders them, export back)
    rope_interleave: bool = True

    @property
    def rope_head_dim(self) -> int:
        return self.qk_rope_head_dim

    def is_moe_layer(self, index: int) -> bool:
        return self.is_moe and index >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return max(self.num_layers - self.first_k_dense_replace, 0) if self.is_moe else 0

    def mla(self) -> MLAConfig:
        """The attention's own config (its softmax scale YaRN's where the rotary embedding is YaRN-scaled)."""
        r = self.rope_scaling
        yarn = r is not None and r.kind == "yarn"
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        scale = yarn_softmax_scale(qk, r.factor, r.mscale_all_dim) if yarn and r is not None else None
        return MLAConfig(
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            softmax_scale=scale,
        )

    def family_problems(self) -> list[str]:
        """DeepSeek-V3's own rules (the shared ones are ModelConfig.problems')."""
        out = self.mla().problems()
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            out.append(
                f"head_dim {self.head_dim} != qk_nope_head_dim + qk_rope_head_dim "
                f"({self.qk_nope_head_dim + self.qk_rope_head_dim}): the query·key width is their sum"
            )
        if self.num_kv_heads != self.num_heads:
            out.append(
                f"num_kv_heads {self.num_kv_heads} != num_heads {self.num_heads}: latent attention has a key "
                "and value per head"
            )
        if self.is_moe:
            out += routing_problems(self.num_experts, self.n_group, self.topk_group, self.experts_per_token)
            if self.moe_layer_step != 1:
                out.append("moe_layer_step must be 1: DeepSeek-V3's dense layers are the first first_k_dense_replace")
            if not self.routed_scaling_factor > 0:
                out.append(f"routed_scaling_factor {self.routed_scaling_factor} must be > 0")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            out.append(f"first_k_dense_replace {self.first_k_dense_replace} must be in [0, num_layers]")
        elif self.is_moe and self.first_k_dense_replace == self.num_layers:  # the router losses' mean over no layers
            out.append(
                f"first_k_dense_replace {self.first_k_dense_replace} = num_layers leaves no layer with experts: "
                "use fewer dense layers, or num_experts 0 for a dense model"
            )
        # (the sequence length a run trains at is seq_length_problems')
        n = self.num_nextn_predict_layers
        return out + mtp_problems(n, self.mtp_loss_weight, n + 1)

    def without_extra_heads(self) -> DeepseekV3Config:
        return dataclasses.replace(self, num_nextn_predict_layers=0)

    def layout_problems(self, tp: int, pp: int, cp: int) -> list[str]:
        """Under a pipeline the last stage holds a copy of the embedding for multi-token prediction
        (parallel/pipeline.py), a tied one's head copy being another: not both."""
        n = self.num_nextn_predict_layers
        if n and pp > 1 and self.tie_embeddings:
            return [
                f"num_nextn_predict_layers {n} with tie_embeddings and --pp {pp}: the last stage would hold two "
                "copies of the embedding; untie them, drop --pp or set num_nextn_predict_layers 0 (--model-override)"
            ]
        return []

    def seq_length_problems(self, seq_length: int, name: str) -> list[str]:
        out, n = super().seq_length_problems(seq_length, name), self.num_nextn_predict_layers
        if n and 1 <= seq_length <= n:
            out.append(
                f"--seq-length {seq_length} is too short for {name}'s {n} multi-token prediction modules (the last "
                f"one's targets lie {n + 1} tokens ahead): give more than {n}"
            )
        return out
