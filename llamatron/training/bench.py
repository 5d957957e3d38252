"""What `llamatron bench` measures: synthetic training steps, one row of throughput and where the time goes.

The headline numbers come from plain, un-instrumented steps (no host sync
inside a step). The breakdown comes from one more step, the same `train_step`
training runs, whose phase hooks synchronise the device and read the clock:
  forward    forward passes of all micro-batches (pp 1; graph kept, as in training)
  backward   forward+backward minus forward (pp > 1: forward_backward, the whole schedule)
  grad_sync  waiting for gradient reductions after the last backward and the tensor-parallel
             gradient sync (exposed communication)
  optimizer  clipping, AdamW (with the step's learning rate and loss scale) and publishing parameters
Pipeline bubble is the schedule's idle fraction, (pp-1) / (m*vpp + pp-1), for m micro-batches.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict

import torch
from torch import nn

from ..adapters.nf4 import quantize_frozen
from ..config.settings import RunConfig
from ..data.batches import micro_batches_for_rank, to_device
from ..data.mock import MockDataset
from ..kernels.choices import KernelChoices
from ..models.inventory import active_params, flops_per_token, num_params
from ..optim import bytes_per_param
from ..parallel.mesh import build_mesh, init_distributed, sum_from_last_stage
from .engine import Engine, build_engine, train_step
from .kernel_settings import kernel_choices
from .metrics import objective_fields, peak_memory_gib, peak_tflops, sync_device, throughput
from .trainer import build_datasets
from .validate import validate


def run_bench(cfg: RunConfig, steps: int, warmup: int) -> dict:
    """`warmup` untimed and `steps` timed training steps on one batch (synthetic tokens, or the first of --data /
    --sft-data when given: real documents for document masks), then one instrumented step for the breakdown: the
    row `llamatron bench` prints (every rank returns it; rank 0 prints it)."""
    derived = validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), torch.cuda.is_available())
    init_distributed(derived.device, cfg.train.dist_timeout)
    mesh = build_mesh(cfg.parallel, cfg.parallel.dp_comm_max_ctas)
    model_cfg = cfg.model_config()
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, derived, mesh, model_cfg)
    quantize_frozen(cfg.lora.base_precision, engine.chunks, model_cfg, engine.frozen)  # QLoRA: the base to NF4
    t, device = cfg.train, engine.device
    real = cfg.data.data is not None or cfg.data.sft_data is not None
    data = (
        build_datasets(cfg, model_cfg, mesh).train
        if real
        else MockDataset(model_cfg.vocab_size, cfg.data.seq_length, t.seed)
    )
    batch = to_device(micro_batches_for_rank(data, 0, t.global_batch_size, t.micro_batch_size, mesh), device)
    for step in range(warmup):
        train_step(engine, batch, step)
    sync_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for step in range(steps):
        out = train_step(engine, batch, warmup + step)
    sync_device(device)
    elapsed = time.perf_counter() - start
    # The last step's global loss (each rank holds its data-parallel share; only the last stage computes it).
    last_loss = out["loss"]
    assert isinstance(last_loss, torch.Tensor)
    loss = sum_from_last_stage(last_loss.detach().float().reshape(1), mesh).item()
    peak_mem = peak_memory_gib(device)
    state = state_memory(engine)
    breakdown = _breakdown(engine, batch, warmup + steps)
    tokens = t.global_batch_size * cfg.data.seq_length * steps
    speed = throughput(
        tokens, elapsed, flops_per_token(model_cfg, cfg.data.seq_length), mesh.world_size, peak_tflops(device)
    )
    p = cfg.parallel
    m = derived.grad_accum_steps
    return {
        "model": t.model,
        "model_overrides": dict(cfg.model_overrides),
        "gpus": mesh.world_size,
        "tp": p.tp,
        "pp": p.pp,
        "vpp": p.vpp,
        "dp": mesh.layout.dp,
        "cp": mesh.layout.cp,
        "sp": p.sequence_parallel,
        "dist_opt": p.distributed_optimizer,
        "fsdp": p.fsdp,
        "fsdp_shard_group": p.fsdp_shard_group if p.fsdp else None,
        "recompute": t.recompute,
        "compile": derived.compile,
        "precision": derived.dtype_name,
        "fp8": t.fp8,
        "fp8_experts": t.fp8 != "none" and t.fp8_experts,
        "mbs": t.micro_batch_size,
        "gbs": t.global_batch_size,
        "seq": cfg.data.seq_length,
        "data": os.path.basename(cfg.data.data or cfg.data.sft_data or "mock"),
        "document_mask": cfg.data.reset_attention_mask or cfg.data.sft_data is not None,
        "step_ms": 1000 * elapsed / steps,
        **speed,
        "peak_mem_gib": peak_mem,
        **state,
        **breakdown,
        "bubble_frac": (p.pp - 1) / (m * p.vpp + p.pp - 1) if p.pp > 1 else 0.0,
        "loss": loss,
        **_moe_fields(engine, out),
        # what ran: auto resolved
        "kernels": asdict(
            kernel_choices(KernelChoices.of(t, cfg.optim), p.tp, device.type, derived.dtype_name, model_cfg)
        ),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def _moe_fields(engine: Engine, out: dict) -> dict:
    """A mixture of experts' row also says its parameters against the active ones (MFU counts the active: the
    FLOPs contract), its expert-parallel size and the last step's router statistics."""
    model_cfg = engine.model_cfg
    if not model_cfg.is_moe:
        return {}
    return {
        "params": num_params(model_cfg),
        "active_params": active_params(model_cfg),
        "ep": engine.mesh.layout.ep,
        **objective_fields(engine, out),
    }


def state_memory(engine: Engine) -> dict[str, float]:
    """Weights + gradients + optimizer state: allocated between steps (no activations alive) vs the formula.

    The formula is the optimizer's (llamatron/optim's bytes_per_param, which the planner uses): bf16 params
    2 + grads 4 + its state / s (AdamW: master 4 + moments 8), s = dp with the distributed optimizer.
    The measured figure also holds the step's batch and the small tensors of the optimizer's bookkeeping.
    """
    if engine.device.type != "cuda":
        return {}
    for buf in engine.buffers:
        buf.finish_param_gather()
    sync_device(engine.device)
    params = sum(p.numel() for b in engine.buffers for p in b.param_range)
    opt = engine.optimizer
    share = sum(p.numel() for b in engine.buffers for p, s in b.spec_of.items() if s.global_name in opt.hidden) / params
    kind = engine.cfg.optim.optimizer
    per_param = sum(bytes_per_param(engine.derived.dtype_name, opt.distributed, engine.mesh.layout.dp, kind, share))
    return {
        "state_mem_gib": torch.cuda.memory_allocated(engine.device) / 2**30,
        "state_formula_gib": params * per_param / 2**30,
    }


def _breakdown(engine: Engine, batch: list[dict], step: int) -> dict[str, float]:
    """Milliseconds per phase of one instrumented train_step (syncs between phases)."""
    device = engine.device
    for buf in engine.buffers:  # the last timed step's parameter all-gather is not this step's work
        buf.finish_param_gather()
    marks: dict[str, float] = {}

    def on_phase(name: str) -> None:
        sync_device(device)
        marks[name] = time.perf_counter()

    forwards = _ForwardClock(engine.chunks[0], device) if engine.mesh.layout.pp == 1 else None
    sync_device(device)
    start = time.perf_counter()
    try:
        train_step(engine, batch, step, on_phase=on_phase)
    finally:
        if forwards is not None:
            forwards.remove()
    fwd_bwd = 1000 * (marks["forward_backward"] - start)
    if forwards is not None:
        times = {"forward_ms": 1000 * forwards.seconds, "backward_ms": fwd_bwd - 1000 * forwards.seconds}
    else:
        times = {"forward_backward_ms": fwd_bwd}
    times["grad_sync_ms"] = 1000 * (marks["grad_sync"] - marks["forward_backward"])
    times["optimizer_ms"] = 1000 * (marks["optimizer"] - marks["grad_sync"])
    return times


class _ForwardClock:
    """The time of every forward of `model` (pp 1: one per micro-batch, each followed by its backward, as in a
    real step), between device syncs, through module hooks that `remove` takes off again."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.device, self.seconds, self._started = device, 0.0, 0.0
        self._hooks = [model.register_forward_pre_hook(self._start), model.register_forward_hook(self._stop)]

    def _start(self, module: nn.Module, args: tuple) -> None:
        sync_device(self.device)
        self._started = time.perf_counter()

    def _stop(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        sync_device(self.device)
        self.seconds += time.perf_counter() - self._started

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def format_row(row: dict) -> str:
    mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
    layout = (
        f"tp{row['tp']} pp{row['pp']} vpp{row['vpp']} dp{row['dp']}"
        + (" sp" if row["sp"] else "")
        + (" distopt" if row["dist_opt"] else "")
        + (" fsdp" if row.get("fsdp") else "")
        + (f" rc={row['recompute']}" if row["recompute"] != "none" else "")
    )
    phases = " ".join(
        f"{k[:-3]}={row[k]:.0f}ms"
        for k in ("forward_ms", "backward_ms", "forward_backward_ms", "grad_sync_ms", "optimizer_ms")
        if k in row
    )
    cpu = row["device"] == "cpu"  # per process, and the process's peak resident memory rather than GPU memory
    header = (
        f"{'model':<12} {'layout':<34} {'tok/s/rank' if cpu else 'tok/s/gpu':>10} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'RSS GiB' if cpu else 'mem GiB':>8}  breakdown"
    )
    overrides = row.get("model_overrides") or {}
    model = row["model"] + ("*" if overrides else "")  # * the preset was changed: the changes follow the row
    tflops = row["tflops_per_gpu"]
    tflops_text = f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"  # CPU runs reach a fraction of one
    line = (
        f"{model:<12} {layout:<34} {row['tokens_per_sec']:>10.0f} {tflops_text:>8} {mfu:>6} "
        f"{row['peak_mem_gib']:>8.1f}  {phases} step={row['step_ms']:.0f}ms bubble={row['bubble_frac']:.0%}"
    )
    if overrides:
        line += "\n* model_overrides: " + ", ".join(f"{k}={v}" for k, v in overrides.items())
    return header + "\n" + line
