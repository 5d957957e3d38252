"""DeepSeek-V3's published shapes and those built like it (Moonlight, Kimi K2), as their config.json files give
them, and a tiny one for the tests. Their multi-token prediction modules are left out (not trained yet): the counts
are the main model's (DeepSeek-V3 671B in all, 37B active; tests/test_deepseek_v3.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...config import RopeScaling
from .config import DeepseekV3Config


def _deepseek(**shape: Any) -> DeepseekV3Config:
    base: dict[str, Any] = dict(
        family="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_heads=128,
        head_dim=192,  # qk_nope_head_dim + qk_rope_head_dim
        ffn_hidden_size=2048,  # each routed expert's (moe_intermediate_size)
        dense_ffn_hidden_size=18432,  # the dense first layers' SwiGLU (intermediate_size)
        max_seq_length=163840,
        rope_theta=10000.0,
        rope_scaling=RopeScaling("yarn", 40.0, 4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        norm_eps=1e-6,
        num_experts=256,
        experts_per_token=8,
        router_aux_loss_coef=0.0001,  # the paper's sequence-wise balance loss, beside the bias
        moe_renormalize=True,
        shared_expert_ffn=2048,  # n_shared_experts x moe_intermediate_size
        router_score="sigmoid",
        router_expert_bias=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
    )
    return DeepseekV3Config(**{**base, **shape})


_KIMI_YARN = RopeScaling("yarn", 32.0, 4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)

PRESETS: dict[str, Callable[[], DeepseekV3Config]] = {
    "deepseek-v3": lambda: _deepseek(),
    # Moonlight-16B-A3B (Moonshot, trained with Muon): no low-rank query, one group, 64 experts of 1408
    "moonlight-16b-a3b": lambda: _deepseek(
        vocab_size=163840,
        hidden_size=2048,
        num_layers=27,
        num_heads=16,
        ffn_hidden_size=1408,
        dense_ffn_hidden_size=11264,
        max_seq_length=8192,
        rope_theta=50000.0,
        rope_scaling=None,
        norm_eps=1e-5,
        num_experts=64,
        experts_per_token=6,
        shared_expert_ffn=2 * 1408,
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        first_k_dense_replace=1,
    ),
    # Kimi K2 (1T in all): DeepSeek-V3's layer with 64 heads, 384 experts, one dense layer
    "kimi-k2": lambda: _deepseek(
        vocab_size=163840,
        num_heads=64,
        max_seq_length=131072,
        rope_theta=50000.0,
        rope_scaling=_KIMI_YARN,
        num_experts=384,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        first_k_dense_replace=1,
    ),
    # tests: the low-rank query, YaRN, groups (4 of 2 experts, 2 kept), one dense layer then experts
    "deepseek-v3-test": lambda: _deepseek(
        vocab_size=256,
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        head_dim=24,
        ffn_hidden_size=32,
        dense_ffn_hidden_size=96,
        max_seq_length=128,
        rope_scaling=RopeScaling("yarn", 4.0, 32, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        num_experts=8,
        experts_per_token=2,
        shared_expert_ffn=32,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
    ),
}
