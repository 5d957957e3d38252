"""The kernels: Triton kernels beside their plain torch reference (rmsnorm, rope, swiglu, cross_entropy, a
decoding step's attention, a MoE's combine: gather_sum, AdamW's fused pass), FlashAttention 4's wrapper, and
whether Triton runs (triton_check). Each is a function on tensors: this package imports no other llamatron
package (models/ and parallel/ call it), and its __init__ imports none of its modules, so a CPU install that
imports the package loads no kernel."""
