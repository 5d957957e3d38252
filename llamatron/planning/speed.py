"""The planner's ranking model: how fast a layout should run, in closed form (plan.py's memory model says
whether it fits).

Speed model (orders a search's layouts and picks its cp layouts; `plan --no-simulate` lists its figures. `plan`
itself lists the step simulator's, llamatron/planning/simulator/ranking.py, docs/simulator.md: this model has no
MoE token permutation or routing and no --fsdp contention, and can be 2x off there. Both take their numbers from
llamatron/planning/simulator/calibration.yaml, this one from its `planner:` section, see SpeedAssumptions)
---------------------------------------------------------------------------------------------------
  compute per micro-batch = tokens x hardware FLOPs per token / (tp*pp) / (peak x base MFU x GEMM efficiency),
    tokens = micro-batch x seq / cp (the load-balanced split gives every cp rank 1/cp of the attention work);
    hardware FLOPs = model FLOPs (ModelConfig.flops_per_token) plus one more layer forward (full recompute;
    N/layers-per-chunk of it with --recompute-layers N) or attention forward (selective);
    GEMM efficiency = tokens/(tokens+256) x (h/tp)/((h/tp)+64): small micro-batches and thin shards run slower;
  tensor parallelism: 8 (12 with full recompute) all-gathers/reduce-scatters of (tokens x h) per layer over
    NVLink (tp never leaves a node), not overlapped with compute;
  context parallelism: per layer and micro-batch an all-gather of the whole sequence's K/V (2 x seq x kv heads/tp
    x head_dim per sample) in forward, the reduce-scatter of their gradients in backward and, with recompute,
    the gather again; over NVLink when tp*cp fits in a node, else across nodes; not overlapped (context.py);
  pipeline: point-to-point sends per virtual stage, across nodes when the job spans nodes, and the bubble:
    time x (1 + (pp-1)/(m*vpp));
  data parallelism: the gradient reduction (and the distributed optimizer's all-gather) over the dp x cp
    replicas overlaps the last micro-batch's backward (forward); the rest is exposed, never less than one
    bucket;
  --fsdp: per micro-batch and layer, the weights' all-gather (forward, and backward unless keep-params) and the
    gradient's reduce-scatter over the shard group, exposed what outlasts the layer's compute (fsdp_comm_seconds);
    hybrid sharding's all-reduce exposed in full; no step-end reduction;
  optimizer step: memory-bound, about 30 bytes per owned parameter plus 8 per held parameter; --optimizer muon
    adds its Newton-Schulz FLOPs (at the base MFU) and its updates' gather/sum/broadcast (muon_cost.py), exposed;
  a mixture of experts: under a capacity factor the experts' FLOPs of the choices dropped (k - experts_taken per
    token) are not run; global-batch load balancing (router_aux_loss_scope global_batch) runs every micro-batch
    forward once more without gradient before the step (a third of the model FLOPs more);
  --fp8: the decoder's linear FLOPs (6 x layer parameters per token, 2 more with full recompute) run
    SpeedAssumptions.fp8_gemm_speedup times faster (fitted to RESULTS.md run 9); memory is the bf16 figure (the
    measured FP8 peaks were 2-5 GiB below bf16's: a margin, not modelled).
  Calibrated against llamatron's own compiled bf16 runs on H200s (benchmarks/h200_peak_memory.json: 21
  runs of llama-1b and Llama 2 7B on one and two GPUs, each within 10%, tested); eager runs are ~27% slower
  than it says. It models the layout, not the kernel choices (FA4, the Triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..config.settings import ParallelConfig
from ..models import ModelConfig
from ..models.inventory import experts_taken, flops_per_token, layers
from .activations import gathered_kv_bytes
from .layout import Layout
from .muon_cost import muon_cost
from .params import active_layer_params, layer_shards, stage_params
from .simulator.calibration import Calibration, load_calibration
from .simulator.hardware import Hardware, resolve_hardware


def _planner_numbers(cal: Calibration) -> dict[str, Any]:
    """The ranking model's numbers on one H200 node: calibration.yaml's `planner:`, the simulator's shape factor
    and efficiencies, the trainer's gradient bucket."""
    hw = resolve_hardware("h200")
    return {
        "peak_flops": hw.gpu.peak_flops,
        "base_mfu": cal.planner["base_mfu"],
        "nvlink_bw": cal.planner["nvlink_bw"],
        "internode_bw": hw.nic_bandwidth_per_gpu() * cal.network.efficiency,
        "hbm_bw": hw.gpu.hbm_bw * cal.elementwise_hbm_efficiency,
        "gemm_tokens_half": cal.gemm_tokens_half,
        "gemm_width_half": cal.gemm_width_half,
        "bucket_size": ParallelConfig().bucket_size,
        "fp8_gemm_speedup": (("none", 1.0), *cal.planner["fp8_gemm_speedup"].items()),
    }


_PLANNER = _planner_numbers(load_calibration())


@dataclass(frozen=True)
class SpeedAssumptions:
    """The closed-form ranking model's numbers (_planner_numbers); `for_hardware` scales them to a GPU and network
    of hardware.yaml, `from_calibration` reads another calibration table."""

    peak_flops: float = _PLANNER["peak_flops"]
    base_mfu: float = _PLANNER["base_mfu"]
    nvlink_bw: float = _PLANNER["nvlink_bw"]
    internode_bw: float = _PLANNER["internode_bw"]
    hbm_bw: float = _PLANNER["hbm_bw"]
    gemm_tokens_half: float = _PLANNER["gemm_tokens_half"]
    gemm_width_half: float = _PLANNER["gemm_width_half"]
    bucket_size: int = _PLANNER["bucket_size"]
    fp8_gemm_speedup: tuple[tuple[str, float], ...] = _PLANNER["fp8_gemm_speedup"]

    @classmethod
    def from_calibration(cls, cal: Calibration) -> SpeedAssumptions:
        return cls(**_planner_numbers(cal))

    @classmethod
    def for_hardware(cls, hw: Hardware) -> SpeedAssumptions:
        """The same model on another GPU: its peak, HBM, link (against NVLink 4's 450 GB/s) and network share."""
        base = cls()
        return replace(
            base,
            peak_flops=hw.gpu.peak_flops,
            hbm_bw=base.hbm_bw * hw.gpu.hbm_bw / 4.8e12,
            nvlink_bw=base.nvlink_bw * hw.link.bandwidth / 450e9,
            internode_bw=hw.nic_bandwidth_per_gpu() * load_calibration().network.efficiency,
        )


@dataclass
class Speed:
    step_seconds: float
    tokens_per_sec_per_gpu: float
    mfu: float
    bubble: float
    parts: dict[str, float] = field(default_factory=dict)  # seconds per step


def estimate_speed(
    model: ModelConfig,
    lay: Layout,
    seq_length: int,
    gpus: int,
    gpus_per_node: int,
    hw: SpeedAssumptions = SpeedAssumptions(),
    precision: str = "bf16",
    fp8: str = "none",
    optimizer_name: str = "adamw",
) -> Speed:
    """Expected step time and throughput of a layout (see the module docstring)."""
    a = 4 if precision == "fp32" else 2
    h, L = model.hidden_size, model.num_layers
    tokens = lay.micro_batch_size * seq_length / lay.cp  # this rank's part of a micro-batch
    model_flops = flops_per_token(model, seq_length)
    attention_fwd = 4.0 * L * h * seq_length
    layers_fwd = 2.0 * L * active_layer_params(model) + attention_fwd
    # Partial recompute (--recompute-layers N) re-runs N of each chunk's layers (even splits assumed).
    per_chunk = L / (lay.pp * lay.vpp)
    share = 1.0 if lay.recompute_layers is None else min(lay.recompute_layers, per_chunk) / per_chunk
    extra = share * {"none": 0.0, "selective": attention_fwd, "full": layers_fwd}[lay.recompute]
    # FP8 runs the decoder's linears (forward, backward and a full recompute's forward) that much faster.
    linear = 2.0 * L * active_layer_params(model) * (3 + (share if lay.recompute == "full" else 0))
    extra -= linear * (1 - 1 / dict(hw.fp8_gemm_speedup)[fp8])
    extra += moe_flops_change(model, model_flops)
    width = h / lay.tp
    efficiency = hw.base_mfu * tokens / (tokens + hw.gemm_tokens_half) * width / (width + hw.gemm_width_half)
    compute = tokens * (model_flops + extra) / (lay.tp * lay.pp) / (hw.peak_flops * efficiency)
    layers_here = L / lay.pp
    tp_comm = 0.0
    if lay.tp > 1:
        collectives = 8 + (4 * share if lay.recompute == "full" else 0)
        tp_comm = layers_here * collectives * (lay.tp - 1) / lay.tp * tokens * h * a / hw.nvlink_bw
    cp_comm = context_comm_seconds(model, lay, seq_length, gpus_per_node, hw, a, share)
    p2p = 0.0
    if lay.pp > 1:
        bw = hw.nvlink_bw if gpus <= gpus_per_node else hw.internode_bw
        p2p = 2 * lay.vpp * tokens * h * a / (lay.tp if lay.sequence_parallel else 1) / bw
    fsdp_comm = fsdp_comm_seconds(model, lay, compute, gpus_per_node, hw, a) if lay.fsdp else 0.0
    per_micro_batch = compute + tp_comm + cp_comm + p2p + fsdp_comm
    m = lay.micro_batches
    bubble = (lay.pp - 1) / (m * lay.vpp)
    pipeline = per_micro_batch * m * (1 + bubble)
    params = max(stage_params(model, lay.tp, lay.pp, r, L // lay.pp, lay.ep)[0] for r in range(lay.pp))
    reduce_exposed, gather_exposed = (
        _replica_comm_exposed(lay, params, per_micro_batch, gpus_per_node, hw, a) if not lay.fsdp else (0.0, 0.0)
    )
    owned = params / lay.dense_shards
    optimizer = (30 * owned + 8 * (owned if lay.fsdp else params)) / hw.hbm_bw
    if optimizer_name == "muon":
        optimizer += muon_seconds(model, lay, gpus_per_node, hw)
    step = pipeline + reduce_exposed + gather_exposed + optimizer
    tokens_per_gpu = lay.global_batch_size * seq_length / step / gpus
    return Speed(
        step,
        tokens_per_gpu,
        tokens_per_gpu * model_flops / hw.peak_flops,
        bubble,
        {
            "compute": compute * m,
            "tp_comm": tp_comm * m,
            "cp_comm": cp_comm * m,
            "p2p": p2p * m,
            "fsdp_comm": fsdp_comm * m,
            "bubble": pipeline - per_micro_batch * m,
            "dp_exposed": reduce_exposed + gather_exposed,
            "optimizer": optimizer,
        },
    )


def muon_seconds(model: ModelConfig, lay: Layout, gpus_per_node: int, hw: SpeedAssumptions) -> float:
    """Muon's Newton-Schulz (at the base MFU) and its extra traffic (planning/muon_cost.py), exposed: they run
    after the gradients are reduced."""
    cost = muon_cost(model, lay, model.num_layers / lay.pp)
    dp_bw = hw.nvlink_bw if lay.tp * lay.replicas <= gpus_per_node else hw.internode_bw
    return cost.flops / (hw.peak_flops * hw.base_mfu) + cost.tp_bytes / hw.nvlink_bw + cost.dp_bytes / dp_bw


def moe_flops_change(model: ModelConfig, model_flops: float) -> float:
    """Hardware FLOPs per token a mixture of experts' options add to the model FLOPs (models/moe_balance.py): the
    dropped choices' expert work taken away (a capacity factor), the routing pass's forward added (global-batch
    balancing: forward = a third of forward + backward)."""
    if not model.is_moe:
        return 0.0
    per_expert = sum(layer.params("expert") for layer in layers(model)) / model.num_experts
    dropped = 6.0 * per_expert * (model.experts_per_token - experts_taken(model))
    routing = (model_flops - dropped) / 3 if model.router_aux_loss_scope == "global_batch" else 0.0
    return routing - dropped


def context_comm_seconds(
    model: ModelConfig,
    lay: Layout,
    seq_length: int,
    gpus_per_node: int,
    hw: SpeedAssumptions = SpeedAssumptions(),
    act_bytes: int = 2,
    recompute_share: float = 1.0,
) -> float:
    """Seconds of context-parallel traffic per micro-batch on a pipeline rank: each layer all-gathers the whole
    sequence's K/V in forward (again when recomputed) and reduce-scatters their gradients in backward. Exposed
    in full: context.py does not overlap the gather with attention."""
    if lay.cp == 1:
        return 0.0
    # Rank order tp, cp, dp, pp: a cp group spans tp*cp consecutive ranks, inside a node when they fit.
    bw = hw.nvlink_bw if lay.tp * lay.cp <= gpus_per_node else hw.internode_bw
    gathered = lay.micro_batch_size * seq_length * gathered_kv_bytes(model, act_bytes, lay.tp, lay.cp) / lay.cp
    collectives = 2 + (recompute_share if lay.recompute != "none" else 0.0)
    layers_here = model.num_layers / lay.pp
    return layers_here * collectives * (lay.cp - 1) / lay.cp * gathered / bw


def _replica_comm_exposed(
    lay: Layout, params: int, per_micro_batch: float, gpus_per_node: int, hw: SpeedAssumptions, act_bytes: int
) -> tuple[float, float]:
    """Seconds of the gradient reduction over the dp x cp replicas, and of the distributed optimizer's
    all-gather, that the last micro-batch's backward (forward) does not hide; never less than one bucket."""
    if lay.replicas == 1:
        return 0.0, 0.0
    bw = hw.nvlink_bw if lay.tp * lay.replicas <= gpus_per_node else hw.internode_bw
    share = (lay.replicas - 1) / lay.replicas
    last_bucket = min(1.0, hw.bucket_size / params)
    reduce = (1 if lay.distributed_optimizer else 2) * share * params * 4 / bw
    reduce_exposed = max(reduce - per_micro_batch * 2 / 3, reduce * last_bucket)
    if not lay.distributed_optimizer:
        return reduce_exposed, 0.0
    gather = share * params * act_bytes / bw
    return reduce_exposed, max(gather - per_micro_batch / 3, gather * last_bucket)


def fsdp_comm_seconds(
    model: ModelConfig, lay: Layout, compute: float, gpus_per_node: int, hw: SpeedAssumptions, act_bytes: int = 2
) -> float:
    """Seconds of --fsdp's traffic per micro-batch on a pipeline rank that compute does not hide (parallel/fsdp.py):
    every micro-batch all-gathers each layer's weights in forward, prefetched under the previous layer's forward
    (the first unit's is waited for), again in backward unless --fsdp-keep-params-in-backward, and
    reduce-scatters each layer's fp32 gradient; in backward the gather of layer i-1 and the reduce-scatter of
    layer i share the group's stream under layer i-1's backward (2/3 of a layer's compute, forward 1/3). Hybrid
    sharding all-reduces each shard over the replicate group (across nodes) on the compute stream: exposed."""
    dense, experts = layer_shards(model, lay.tp, lay.ep)
    ds, es = lay.dense_shards, lay.expert_shards
    moved = dense * (ds - 1) / ds + experts * (es - 1) / es  # elements of a layer that come from other ranks
    if moved == 0:
        return 0.0
    bw = hw.nvlink_bw if lay.tp * ds <= gpus_per_node else hw.internode_bw
    gather, reduce = moved * act_bytes / bw, moved * 4 / bw
    layers = model.num_layers / lay.pp
    forward, backward = compute / layers / 3, 2 * compute / layers / 3
    regather = 0.0 if lay.fsdp_keep_params else gather
    exposed = gather + layers * (max(0.0, gather - forward) + max(0.0, regather + reduce - backward))
    if lay.fsdp_shard_group:
        groups = lay.replicas // lay.fsdp_shard_group
        exposed += 2 * (groups - 1) / groups * layers * (dense / ds) * 4 / hw.internode_bw
    return exposed
