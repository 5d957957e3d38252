"""DeepSeek-V3's own modules (issue 49), each a plain single-device module with a small frozen config of its own,
tested against transformers' DeepSeek-V3 (tests/test_deepseek_v3_parts.py). Not a registered family yet:

- mla.py: multi-head latent attention (MLAConfig, MLAttention) and its Hugging Face names and rotary row order;
- mla_cache.py: its decode cache, kept compressed (the latent and the rotary key; MLACache);
- rope.py: YaRN's frequencies and attention factors, and the interleaved/half-split rotary row order;
- routing.py: group-limited top-k routing (sigmoid scores, the balancing bias choosing, groups by their top 2);
- mtp.py: multi-token prediction (one MTP module, the chain of depths, and its loss).
"""
