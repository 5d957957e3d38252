"""Activation memory for the planner (plan.py): the tensors autograd saves, per token.

Activations: the tensors autograd saves in one decoder layer, per token, for the code in models/ (the tests
measure them with saved_tensors_hooks). a = bytes per activation element (2 in bf16), h hidden, kv =
num_kv_heads*head_dim, f ffn; eager | compiled (torch.compile per layer, the default on GPU):
  norm_inputs   Llama: per RMSNorm the fp32 copy of its input 4h, the normalised a*h and rsqrt 4; with the
                       Triton RMSNorm (kernels.norms, the CUDA default) its input a*h and rsqrt 4
                       | the rsqrt 4 per norm and one residual a*h (the rest is re-derived in backward)
                Falcon: the layer input a*h, mean/rstd 8 per LayerNorm | the layer input and one LayerNorm's 8
  norm_outputs  the inputs of the QKV and MLP projections a*h each (Falcon eager with one LayerNorm: shared)
                | Llama 2 a*h, Falcon one a*h
The attention's terms (qkv .. attn_output, and gathered_kv) are what the layer's attention module declares
(its `counts`, models/attention_counts.py; read through models/inventory.Layer.attention): the shared
attention's are these, a family's own attention (DeepSeek-V3's latent attention) lists its own.
  qkv           the QKV projection's output a*(h + 2kv) (the attention reads v from it); with the Triton
                rotary op (kernels.rope, the CUDA default) the q, k, v it writes instead, the same bytes
  qk_norm       a q/k norm (Qwen3): the rsqrt 4 per query and key head; eager torch norms also keep the normalised
                heads a*(q + kv)*d (and in bf16 their fp32 copy, 4 more per element)
  rope          roped q and k a*(h + kv): the attention kernel's inputs; 0 with kernels.rope
  softmax_stats logsumexp 4 per head (flash / cuDNN attention: no S^2 term)
  attn_output   the input of the output projection a*h | plus the kernel's own output: 2 a*h
  mlp           SwiGLU: gate|up a*2f, silu(gate) a*f, the product a*f: 4a*f; with the Triton SwiGLU
                (kernels.swiglu, the CUDA default) gate|up and the product: 3a*f | silu re-derived: 3a*f
                Falcon GELU: its input and output 2a*f; a mixture of experts: experts_per_token times that
                (under a capacity factor the choices kept: models/inventory.experts_taken, k x min(1, factor))
  moe_dispatch  a mixture of experts: the token's k dispatched copies and their combined outputs 2a*k*h (the
                kept ones under a capacity), the router's fp32 scores 4*num_experts (an estimate until the MoE
                layer is measured)
With tp > 1 everything but the norm terms divides by tp. With sequence parallelism norm_inputs divide by tp
too, while each column-parallel projection saves its all-gathered (full) input: norm_outputs stay whole, and
Falcon's two projections each gather their own copy. Selective recompute (engine.py) re-runs the attention
kernel only, whose inputs are kept: it frees softmax_stats (the kinds the attention declares `recomputed`).
Full recompute keeps each layer's input a*h (/tp with sp). Per chunk and micro-batch: rope cos/sin
2a*rope_width, token ids 8 (first chunk), the final norm (last chunk), and on pipeline stages the received
input a*h (/tp with sp); the sent output is freed once sent (backward starts from its gradient edge).
Context parallelism (cp ranks, each holding seq/cp tokens; everything above is per local token): without
recompute the attention kernel saves the K and V it attends to, the whole sequence's gathered over the cp ranks
(gathered_kv: 2a*kv*cp per local token), in place of this rank's own: the local k and v are freed, and with the
torch rotary so is the QKV projection's output (the kernel no longer holds v as a view of it), leaving q alone
(a*h, in qkv with kernels.rope, else in rope). Selective recompute checkpoints the gather with the kernel, so
its inputs, the local q/k/v, are kept as without cp; full recompute keeps the layer input.
In flight on pipeline rank r: parallel/schedules.max_alive: min(pp - r, m) micro-batches under 1F1B; with vpp
chunks per rank min(pp*vpp - r, m*vpp) chunk activations (each 1/vpp of the rank's layers); one micro-batch
at a time without a pipeline.
"""

from __future__ import annotations

from ..models import ModelConfig
from ..models.attention_counts import EAGER_TORCH, LayerKernels
from ..models.inventory import (
    experts_taken,
    extra_head_layers,
    final_norm_counts,
    layers,
    mean_mlp_width,
    moe_layer_share,
    per_config,
)
from ..parallel.schedules import max_alive


def layer_activation_terms(
    model: ModelConfig,
    act_bytes: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    kernels: LayerKernels = EAGER_TORCH,
    cp: int = 1,
) -> dict[str, float]:
    """Bytes one decoder layer saves for backward per token, by part (see the module docstring); cp > 1: the
    attention kernel attends to K/V gathered over cp context-parallel ranks (without recompute)."""
    layer = layers(model)[0]
    # the block's own terms (its norms and MLP) and its attention's, as each declares them (models/block_counts.py,
    # models/attention_counts.py); ffn: k experts' width in a MoE layer
    block = layer.block.saved(act_bytes, mean_mlp_width(model), tp, sequence_parallel, kernels)
    moe = 0.0
    if model.is_moe:  # in MoE layers, each token's dispatched copies and router scores
        moe = (2 * act_bytes * experts_taken(model) * model.hidden_size + 4 * model.num_experts) * moe_layer_share(
            model
        )
    attention = layer.attention.saved(act_bytes, tp, kernels, cp)
    return {
        "norm_inputs": block["norm_inputs"],
        "norm_outputs": block["norm_outputs"],
        **attention,
        "mlp": block["mlp"],
        "moe_dispatch": moe,
    }


def gathered_kv_bytes(model: ModelConfig, act_bytes: int, tp: int, cp: int) -> float:
    """Per local token: the whole sequence's K and V that one layer all-gathers over the cp ranks (seq/cp tokens
    each), i.e. cp times a rank's own; 0 without context parallelism (the local K/V are the qkv term)."""
    if cp == 1:
        return 0.0
    return cp * act_bytes * layers(model)[0].attention.gathered_kv_width(tp)


def final_norm_bytes(
    model: ModelConfig, act_bytes: int, tp: int, sequence_parallel: bool, fused_norms: bool = False
) -> float:
    """The last chunk's final norm per token (eager), its output saved whole by the head: what the final norm
    declares (models/block_counts.py)."""
    return final_norm_counts(model).saved(act_bytes, tp, sequence_parallel, fused_norms)


@per_config
def layer_activation_bytes(
    model: ModelConfig,
    act_bytes: int,
    tp: int,
    sequence_parallel: bool,
    recompute: str,
    kernels: LayerKernels = EAGER_TORCH,
    cp: int = 1,
) -> float:
    """Bytes per (local) token one decoder layer keeps until its backward, under a recompute mode."""
    if recompute == "full":
        return act_bytes * model.hidden_size / (tp if sequence_parallel else 1)
    # Selective recompute re-runs the K/V gather inside its checkpoint: only the local q/k/v are kept.
    terms = layer_activation_terms(model, act_bytes, tp, sequence_parallel, kernels, cp if recompute == "none" else 1)
    if recompute == "selective":  # the kinds its attention declares the re-run kernel frees
        for kind in layers(model)[0].attention.recomputed:
            terms.pop(kind)
    return sum(terms.values())


@per_config
def chunk_activation_bytes(
    model: ModelConfig,
    layers: int,
    first: bool,
    last: bool,
    act_bytes: int,
    tp: int,
    sequence_parallel: bool,
    recompute: str,
    pipelined: bool,
    kernels: LayerKernels = EAGER_TORCH,
    recompute_layers: int | None = None,
    cp: int = 1,
) -> float:
    """Bytes per (local) token one model chunk keeps for one micro-batch until its backward.

    recompute_layers: only the chunk's first N layers are recomputed (--recompute-layers); cp: context-parallel
    ranks (each holds seq/cp tokens of the micro-batch).
    """
    hidden = act_bytes * model.hidden_size / (tp if sequence_parallel else 1)
    recomputed = layers if recompute == "none" or recompute_layers is None else min(layers, recompute_layers)
    total = recomputed * layer_activation_bytes(model, act_bytes, tp, sequence_parallel, recompute, kernels, cp)
    total += (layers - recomputed) * layer_activation_bytes(
        model, act_bytes, tp, sequence_parallel, "none", kernels, cp
    )
    total += 2 * act_bytes * _rope_width(model)  # rope cos/sin, shared by the chunk's layers
    if first:
        total += 8  # token ids saved by the embedding
    elif pipelined:
        total += hidden  # the received input, kept for its gradient
    if last:
        total += final_norm_bytes(model, act_bytes, tp, sequence_parallel, kernels.norms)
        total += extra_head_bytes(model, act_bytes, tp, sequence_parallel, kernels, cp)
    return total  # (the sent output is not kept: backward starts from its gradient edge)


def extra_head_bytes(
    model: ModelConfig, act_bytes: int, tp: int, sequence_parallel: bool, kernels: LayerKernels, cp: int
) -> float:
    """Bytes per token the family's extra prediction heads keep (DeepSeek-V3's MTP modules, on the last chunk, never
    recomputed), each: its two input norms' inputs (as the final norm's), the concatenation eh_proj reads 2a*h
    (/tp with sp: it runs on the rank's tokens), the token ids its embedding saves 8, a decoder layer (the mean
    layer's terms) and its norm before the shared head (final_norm_bytes)."""
    depths = len(extra_head_layers(model))
    if not depths:
        return 0.0
    shard = tp if sequence_parallel else 1
    head = final_norm_bytes(model, act_bytes, tp, sequence_parallel, kernels.norms)
    norm_input = head - act_bytes * model.hidden_size  # a norm's own input terms: the final norm's, less the head's
    layer = layer_activation_bytes(model, act_bytes, tp, sequence_parallel, "none", kernels, cp)
    return depths * (2 * norm_input + 2 * act_bytes * model.hidden_size / shard + 8 + layer + head)


def _rope_width(model: ModelConfig) -> int:
    """The rotary tables' width, as the first layer's attention declares it."""
    return layers(model)[0].attention.rope_width


def chunks_in_flight(pp: int, vpp: int, micro_batches: int, rank: int) -> int:
    """Chunk activations pipeline rank `rank` holds at its peak (one micro-batch at a time without a pipeline)."""
    return 1 if pp == 1 else max_alive(pp, vpp, rank, micro_batches)
