"""A planner layout through the step simulator: the step with data-parallel overlap as asked and without it
(how much traffic the overlap hides on this network), the MFU on the FLOPs contract of docs/design.md, and what
training T tokens would take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...models import ModelConfig
from ...models.inventory import active_params, num_params
from ...parallel.layout import ParallelLayout, layout_values
from ..muon_cost import muon_cost
from ..params import expert_layer_params, layer_shards, stage_layers
from ..plan import GB, Layout, Precision
from .calibration import Calibration, load_calibration
from .costs import Costs, Shape, StepOptions
from .fsdp import FsdpOptions
from .hardware import Hardware
from .step import StepResult, simulate_step, step_seconds_bound

MFU_FORMULA = "tokens/s/GPU x flops_per_token(ModelConfig, seq) / dense bf16 peak (active parameters for MoE)"


@dataclass(frozen=True)
class SimSettings:
    overlap: bool = True  # gradient reduce-scatter during backward, parameter all-gather during forward
    schedule: str = "1f1b"  # "zb-h1": the zero-bubble schedule (predicted, not in the trainer)
    attention: str = "auto"  # the attention backend's measured efficiency: auto (cuDNN), fa4, flash
    bucket_size: int = 40_000_000
    grad_reduce_dtype: str = "fp32"
    tp_comm_overlap: bool = True
    tp_overlap_all: bool = False  # Megatron-core's userbuffers: every tp collective under its GEMM (published runs)
    fused_grad_accumulation: bool = False  # Megatron-core's: the weight-gradient GEMM accumulates in fp32 itself
    fp8_experts: bool = False  # --fp8 on the experts' grouped GEMMs too (Transformer Engine's; not llamatron's)
    ep_dispatcher: str = "alltoall"  # or "hybridep" (Megatron-core's flex dispatcher, HybridEP: published runs)
    fp8_param_gather: bool = False  # Megatron-core's: FP8 weights all-gathered, 1 byte each (published runs)


@dataclass
class Simulation:
    model: ModelConfig
    layout: Layout
    seq_length: int
    hardware: Hardware
    settings: SimSettings
    result: StepResult
    other: StepResult  # the same step with the data-parallel overlap switched the other way
    all_to_all_bytes: float  # per rank and step (MoE)
    precision: Precision = Precision()
    fsdp: dict[str, float] | None = None  # --fsdp's traffic per rank and step (fsdp_traffic)

    @property
    def with_overlap(self) -> StepResult:
        return self.result if self.settings.overlap else self.other

    @property
    def without_overlap(self) -> StepResult:
        return self.other if self.settings.overlap else self.result

    def train_cost(self, tokens: float, price_per_gpu_hour: float | None = None) -> dict[str, float | None]:
        per_gpu = self.result.tokens_per_sec_per_gpu
        gpu_hours = tokens / per_gpu / 3600
        return {
            "tokens": tokens,
            "days": gpu_hours / self.result.gpus / 24,
            "gpu_hours": gpu_hours,
            "cost": gpu_hours * price_per_gpu_hour if price_per_gpu_hour is not None else None,
        }

    def to_dict(self, train_tokens: float | None = None, price: float | None = None) -> dict[str, Any]:
        r, m = self.result, self.model
        on, off = self.with_overlap, self.without_overlap
        parts = r.parts
        out: dict[str, Any] = {
            "hardware": self.hardware.describe(),
            "schedule": self.settings.schedule,
            "overlap": self.settings.overlap,
            "step_seconds": r.step_seconds,
            "tokens_per_sec_per_gpu": r.tokens_per_sec_per_gpu,
            "tflops_per_gpu": r.mfu * r.peak_flops / 1e12,
            "mfu": r.mfu,
            "mfu_formula": MFU_FORMULA,
            "parameters": num_params(m),
            "active_parameters": active_params(m),
            "flops_per_token": r.model_flops_per_token,
            "parts_seconds": dict(parts),
            "exposed_comm_seconds": {
                "tp": parts.get("tp", 0.0),
                "cp": parts.get("cp", 0.0),
                "ep": parts.get("ep", 0.0),
                "dp": r.dp_exposed_seconds,
                "pipeline_bubble_and_p2p": parts.get("bubble", 0.0),
            },
            "data_parallel": {
                "comm_seconds": on.dp_comm_seconds,
                "exposed_with_overlap": on.dp_exposed_seconds,
                "exposed_without_overlap": off.dp_exposed_seconds,
                "hidden_by_overlap": off.dp_exposed_seconds - on.dp_exposed_seconds,
                "step_seconds_with_overlap": on.step_seconds,
                "step_seconds_without_overlap": off.step_seconds,
            },
        }
        if m.is_moe:
            lay = self.layout
            layers = max(sum(chunk) for chunk in stage_layers(m, lay.pp, lay.vpp, lay.pp_layers))
            out["moe"] = {
                "experts_per_rank": m.num_experts
                // (lay.ep * (lay.tp if lay.experts_fold_tp else 1)),  # whole or split
                "expert_weights_gb_per_rank": layers * expert_layer_params(m, lay.tp, lay.ep) * 2 / GB,
                "all_to_all_gb_per_rank_and_step": self.all_to_all_bytes / GB,
                "all_to_all_seconds_exposed": parts.get("ep", 0.0),
            }
        if self.fsdp is not None:
            out["fsdp"] = dict(self.fsdp)
        if train_tokens:
            out["train"] = self.train_cost(train_tokens, price)
        return out


def layout_shape(lay: Layout, seq_length: int, precision: Precision, settings: SimSettings) -> Shape:
    return Shape(
        **layout_values(lay, ParallelLayout),
        micro_batch_size=lay.micro_batch_size,
        seq_length=seq_length,
        recompute=lay.recompute,
        recompute_layers=lay.recompute_layers,
        act_bytes=precision.act_bytes,
        compiled=precision.compiled,
        fp8=precision.fp8,
        attention=settings.attention,
        tp_comm_overlap=settings.tp_comm_overlap,
        tp_overlap_all=settings.tp_overlap_all,
        fused_grad_accumulation=settings.fused_grad_accumulation,
        fp8_experts=settings.fp8_experts,
        ep_dispatcher=settings.ep_dispatcher,
    )


def _options(lay: Layout, settings: SimSettings, overlap: bool, act_bytes: int, extra: float = 0.0) -> StepOptions:
    """The step's options; extra: the optimizer's seconds beyond AdamW's (optimizer_seconds)."""
    return StepOptions(
        micro_batches=lay.micro_batches,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        grad_reduce_bytes=2 if settings.grad_reduce_dtype == "bf16" else 4,
        param_gather_bytes=1 if settings.fp8_param_gather else act_bytes,
        bucket_size=settings.bucket_size,
        schedule=settings.schedule,
        fsdp=fsdp_options(lay),
        optimizer_extra=extra,
    )


def optimizer_seconds(model: ModelConfig, lay: Layout, hw: Hardware, precision: Precision) -> float:
    """What --optimizer muon adds to a step (planning/muon_cost.py): its Newton-Schulz FLOPs at the GEMM efficiency
    and its updates' traffic (tp over the node's links; the shard group's over them or the network), exposed."""
    if precision.optimizer != "muon":
        return 0.0
    cost = muon_cost(model, lay, model.num_layers / lay.pp)
    dp_bw = hw.link.bandwidth if lay.tp * lay.replicas <= hw.gpus_per_node else hw.nic_bandwidth_per_gpu()
    gemm = hw.gpu.peak_flops * load_calibration().gemm_efficiency
    return cost.flops / gemm + cost.tp_bytes / hw.link.bandwidth + cost.dp_bytes / dp_bw


def fsdp_options(lay: Layout) -> FsdpOptions | None:
    """The simulator's view of a layout's --fsdp (None without it)."""
    if not lay.fsdp:
        return None
    replicate = lay.replicas // lay.fsdp_shard_group if lay.fsdp_shard_group else 1
    return FsdpOptions(lay.dense_shards, lay.expert_shards, replicate, lay.fsdp_keep_params, lay.ep)


def fsdp_traffic(model: ModelConfig, lay: Layout, result: StepResult, grad_bytes: int, gather_bytes: int) -> dict:
    """GB a rank all-gathers, reduce-scatters and (hybrid) all-reduces per step, and the seconds exposed."""
    fs = fsdp_options(lay)
    assert fs is not None
    dense, experts = layer_shards(model, lay.tp, lay.ep)
    layers = max(sum(chunk) for chunk in stage_layers(model, lay.pp, lay.vpp, lay.pp_layers)) * lay.micro_batches
    off = dense * (fs.dense_shards - 1) / fs.dense_shards + experts * (fs.expert_shards - 1) / fs.expert_shards
    gathers = 1 if lay.fsdp_keep_params else 2
    reduce_all = 2 * (fs.replicate - 1) / fs.replicate * dense / fs.dense_shards if fs.replicate > 1 else 0.0
    return {
        "all_gather_gb": layers * gathers * off * gather_bytes / GB,
        "reduce_scatter_gb": layers * off * grad_bytes / GB,
        "all_reduce_gb": layers * reduce_all * grad_bytes / GB,
        "exposed_seconds": result.parts.get("fsdp", 0.0),
    }


def simulate_layout(
    model: ModelConfig,
    lay: Layout,
    seq_length: int,
    hw: Hardware,
    precision: Precision = Precision(),
    settings: SimSettings = SimSettings(),
    cal: Calibration | None = None,
    result: StepResult | None = None,
) -> Simulation:
    """Simulate one step of `lay`, with the data-parallel overlap as `settings` say and the other way (`cal`:
    calibration.yaml's numbers unless given; `result`: the first, when LayoutSteps.step has simulated it)."""
    shape = layout_shape(lay, seq_length, precision, settings)
    extra = optimizer_seconds(model, lay, hw, precision)
    result = result or simulate_step(
        model, shape, hw, _options(lay, settings, settings.overlap, shape.act_bytes, extra), cal
    )
    other = simulate_step(model, shape, hw, _options(lay, settings, not settings.overlap, shape.act_bytes, extra), cal)
    a2a = 0.0
    if model.is_moe and lay.ep > 1:
        per_layer = Costs(model, shape, hw, cal or load_calibration()).all_to_all_bytes()
        layers = model.num_layers / lay.pp
        a2a = per_layer * layers * lay.micro_batches * (4 + (2 if lay.recompute == "full" else 0))
    grad_bytes = 2 if settings.grad_reduce_dtype == "bf16" else 4
    gather_bytes = 1 if settings.fp8_param_gather else precision.act_bytes
    fsdp = fsdp_traffic(model, lay, result, grad_bytes, gather_bytes) if lay.fsdp else None
    return Simulation(model, lay, seq_length, hw, settings, result, other, a2a, precision, fsdp)


@dataclass(frozen=True)
class LayoutSteps:
    """The steps of a search's layouts: one model, sequence, hardware, precision and simulator settings."""

    model: ModelConfig
    seq_length: int
    hw: Hardware
    precision: Precision = Precision()
    settings: SimSettings = SimSettings()

    def step(self, lay: Layout) -> StepResult:
        """simulate_layout's step as the settings say only (half its work: what ranking layouts needs)."""
        shape, options = self._inputs(lay)
        return simulate_step(self.model, shape, self.hw, options)

    def bound(self, lay: Layout) -> float:
        """An upper bound of step(lay)'s tokens/s per GPU, without its timeline (step.step_seconds_bound)."""
        shape, options = self._inputs(lay)
        seconds = step_seconds_bound(self.model, shape, self.hw, options)
        tokens = lay.micro_batches * lay.micro_batch_size * self.seq_length * lay.dp  # as StepResult counts them
        return tokens / seconds / (lay.tp * lay.cp * lay.dp * lay.pp)

    def _inputs(self, lay: Layout) -> tuple[Shape, StepOptions]:
        shape = layout_shape(lay, self.seq_length, self.precision, self.settings)
        extra = optimizer_seconds(self.model, lay, self.hw, self.precision)
        return shape, _options(lay, self.settings, self.settings.overlap, shape.act_bytes, extra)
