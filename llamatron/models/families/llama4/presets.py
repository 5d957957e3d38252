"""Llama 4's published text shapes, and a tiny one for the tests.

Scout and Maverick as their config.json's text_config gives them (transformers' Llama4TextConfig defaults are
Scout's; Maverick's differ in 128 experts, MoE in every second layer, no q/k norm and a 1M-token context). Their
parameter counts come out as Meta publishes them: Scout 109B in all, 17B active; Maverick 400B, 17B active
(tests/test_llama4.py). Scout's released checkpoint also scales its rotary embedding for long context: import it
(`import-hf`) to train with that scaling; the preset is the shape at the trained context.
"""

from __future__ import annotations

from .config import Llama4Config


def _llama4(**shape) -> Llama4Config:
    base = dict(
        family="llama4",
        vocab_size=202048,
        hidden_size=5120,
        num_layers=48,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=8192,  # each routed expert's, and the shared expert's
        max_seq_length=131072,
        rope_theta=500000.0,
        norm_eps=1e-5,
        num_experts=16,
        experts_per_token=1,
        router_aux_loss_coef=0.001,
        moe_renormalize=False,
        shared_expert_ffn=8192,
        dense_ffn_hidden_size=16384,  # the dense layers' SwiGLU (intermediate_size_mlp)
        router_score="sigmoid",
        router_weights_input=True,
        nope_layer_interval=4,
        attention_chunk_size=8192,
        qk_l2_norm=True,
        attn_temperature_floor=8192,
        attn_temperature_scale=0.1,
    )
    return Llama4Config(**{**base, **shape})


PRESETS = {
    "llama4-scout-17b-16e": lambda: _llama4(),
    "llama4-maverick-17b-128e": lambda: _llama4(
        num_experts=128, moe_layer_step=2, qk_l2_norm=False, max_seq_length=1048576
    ),
    # tests: MoE in layers 1 and 3 (dense 0 and 2, of another width), NoPE layer 3 with temperature tuning from
    # position 7 on, chunks of 16 tokens elsewhere
    "llama4-test": lambda: _llama4(
        vocab_size=256,
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_hidden_size=96,
        max_seq_length=128,
        rope_theta=10000.0,
        num_experts=4,
        shared_expert_ffn=96,
        dense_ffn_hidden_size=128,
        moe_layer_step=2,
        attention_chunk_size=16,
        attn_temperature_floor=8,
    ),
}
