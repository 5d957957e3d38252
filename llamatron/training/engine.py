"""Builds a trainable model for a config and a mesh, and runs one optimizer step.

Order: plain model (or this rank's pipeline stage chunks) on meta, with their
parameter specs -> tensor parallelism -> expert parallelism (MoE layers) -> FP8 matmuls (--fp8)
-> materialise (layout-independent init) -> recompute -> compile -> gradient buffers (the experts' own
under --ep) -> optimizer. Nothing touches device memory before the config is validated. Under --fsdp the
chunk stays on meta until its sharded buffer (parallel/fsdp.py) writes this rank's shard of each parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from ..adapters.lora import place_adapters
from ..adapters.peft_format import read_peft_dir
from ..adapters.targets import adapter_specs, apply_lora, find_targets, requested
from ..checkpoint.loading import TensorsInMemory, read_weights
from ..config.settings import Derived, RunConfig
from ..dtypes import DTYPES
from ..models import KernelChoices, ModelConfig, Transformer, apply_kernels, build_model, materialize
from ..models.init import init_full_tensor
from ..models.layer_input import LayerInput
from ..models.layers import Attention
from ..models.moe import MoE
from ..models.transformer import batch_inputs
from ..objectives import Objective
from ..objectives.registry import build_objective
from ..optim import BuildArgs, DynamicLossScaler, SegmentOptimizer, hidden_matrices, lr_at, optimizer_kind
from ..parallel.context import apply_context_parallel
from ..parallel.expert import ExpertParallelDispatch, TensorParallelShards, apply_expert_parallel
from ..parallel.fsdp import Buffer, ShardedBuffer
from ..parallel.grad_buffer import GradBuffer, mark_last_microbatch
from ..parallel.mesh import Mesh
from ..parallel.param_spec import ParamSpec, ParamSpecs, param_specs
from ..parallel.pipeline import build_stage_chunks, pipeline_forward_backward, pipeline_forward_each
from ..parallel.tensor import apply_tensor_parallel, sync_tensor_parallel_grads
from .fp8 import apply_fp8
from .kernel_settings import kernel_choices

# (engine, this rank's micro-batches, the objective's normaliser) -> the summed loss on this rank (device)
ForwardBackward = Callable[["Engine", list[dict], torch.Tensor], torch.Tensor]


# Called inside train_step after each phase ("forward_backward", "grad_sync", "optimizer"): bench's instrumented
# step syncs the device and reads the clock there. Plain steps pass none (no extra work, no host sync).
OnPhase = Callable[[str], None]


@dataclass(slots=True)  # declared fields only: setting any other attribute raises AttributeError
class Engine:
    """What a run trains: the model chunks of this rank, their gradient buffers and optimizer, the mesh.

    The run's other state (the save in flight, metadata inherited from a loaded checkpoint, logging) lives
    with the Trainer's components (train.py), not here."""

    cfg: RunConfig
    derived: Derived
    mesh: Mesh
    model_cfg: ModelConfig
    chunks: list[Transformer]
    buffers: list[Buffer]
    optimizer: SegmentOptimizer
    device: torch.device
    dtype: torch.dtype
    forward_backward: ForwardBackward
    objective: Objective  # what a step minimises (objectives/): the plain step, the pipeline and evaluation use it
    loss_scaler: DynamicLossScaler | None = None  # fp16 only
    # Parameters that do not train (LoRA's base model), with their specs: loaded and saved, not in the buffers.
    frozen: list[tuple[nn.Parameter, ParamSpec]] = field(default_factory=list)


class _Checkpointed:
    """A layer's forward run without keeping its activations; recomputes them in backward.

    Installed as the layer's `forward`, so the layer keeps its place and its parameter names, and its forward
    pre-hooks (the gradient buffer's parameter-gather waits) run once, outside the checkpoint.
    """

    def __init__(self, forward: Callable, contexts: Callable = noop_context_fn):
        self.forward = forward  # the layer's own forward (apply_compile compiles it, inside the checkpoint)
        self.contexts = contexts  # checkpoint's context_fn: (first forward's, recompute's) context managers

    def __call__(self, x: torch.Tensor, inputs: LayerInput) -> torch.Tensor:
        # The inputs' tensors as arguments of their own: the checkpoint saves tensor arguments for backward (where
        # saved-tensor hooks, and the planner's measurement, see them); of an object's it would only keep a reference.
        return checkpoint(self._run, x, inputs, *inputs.tensors(), use_reentrant=False, context_fn=self.contexts)

    def _run(
        self, x: torch.Tensor, inputs: LayerInput, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        return self.forward(x, inputs.with_tensors(cos, sin, positions))


def _recompute_contexts(moes: list[MoE]) -> tuple[_Recomputing, _Recomputing]:
    return _Recomputing(moes, False), _Recomputing(moes, True)


class _Recomputing:
    """Marks a layer's MoE modules as recomputing during full recompute's second forward (they counted their
    router statistics in the first)."""

    def __init__(self, moes: list[MoE], value: bool):
        self.moes, self.value = moes, value

    def __enter__(self) -> None:
        for m in self.moes:
            m.recomputing = self.value

    def __exit__(self, *exc) -> None:
        for m in self.moes:
            m.recomputing = False


def recompute_problems(mode: str, layers: int | None, largest_chunk: int, chunks: int) -> list[str]:
    """--recompute-layers against --recompute and the layers of the largest model chunk (of `chunks` = pp*vpp)."""
    if layers is None:
        return []
    if mode == "none":
        return [f"--recompute-layers {layers} needs --recompute full or selective"]
    if layers > largest_chunk:  # >= 0: its declared range
        return [
            f"--recompute-layers {layers}: a model chunk holds at most {largest_chunk} layers (pp*vpp = {chunks}); "
            f"give 0..{largest_chunk}"
        ]
    return []


def apply_recompute(model: Transformer, mode: str, num_layers: int | None) -> None:
    """full: keep only each layer's input; selective: recompute the attention core (its softmax inputs)."""
    for i, layer in enumerate(model.layers.values()):
        if num_layers is not None and i >= num_layers:
            break
        if mode == "full":
            moes = [m for m in layer.modules() if isinstance(m, MoE)]  # found once, not at every call
            contexts = partial(_recompute_contexts, moes) if moes else noop_context_fn
            layer.forward = _Checkpointed(layer.forward, contexts)
        elif mode == "selective":
            attn = cast(Attention, layer.get_submodule("attn"))
            core = attn.core
            attn.core = lambda *a, _core=core: checkpoint(_core, *a, use_reentrant=False)


def apply_compile(model: Transformer) -> None:
    """Compile each decoder layer's forward (fuses norms, rotary, SwiGLU); hooks on the layer stay eager. (The
    objective compiles its loss: LanguageModelObjective.build.)"""
    for module in model.modules():
        if isinstance(module, MoE) and isinstance(module.dispatch, ExpertParallelDispatch):
            module.dispatch.run_eagerly_under_compile()
        if isinstance(module, MoE) and isinstance(module.shards, TensorParallelShards):
            module.shards.run_eagerly_under_compile()
    for layer in model.layers.values():
        inner = layer.forward if isinstance(layer.forward, _Checkpointed) else layer  # compile inside the checkpoint
        inner.forward = torch.compile(inner.forward, dynamic=False)


def _build_chunks(
    cfg: RunConfig, model_cfg: ModelConfig, mesh: Mesh
) -> tuple[list[Transformer], list[ParamSpecs], ForwardBackward]:
    """This rank's model chunks on the meta device (a pipeline's stages, or the whole model), their parameters'
    specs, and how a step runs them."""
    p = cfg.parallel
    if p.pp > 1:
        chunks, specs = build_stage_chunks(model_cfg, mesh, vpp=p.vpp, pp_layers=p.pp_layers)
        return chunks, specs, pipeline_forward_backward
    model = build_model(model_cfg)
    return [model], [param_specs(model)], forward_backward_no_pipeline


def _split_and_adapt(
    cfg: RunConfig, model_cfg: ModelConfig, mesh: Mesh, chunk: Transformer, specs: ParamSpecs
) -> ParamSpecs:
    """Tensor and expert parallelism applied to `chunk` (on meta), then LoRA's adapters, which follow the
    tensor-parallel split; returns the chunk's specs."""
    p, lo = cfg.parallel, cfg.lora
    # Found before tensor parallelism splits the linears. The whole model's targets were checked (validate): a
    # pipeline stage may hold few layers.
    targets = find_targets(chunk, model_cfg, requested(lo.lora_targets), strict=False) if lo.lora_rank else []
    if p.tp > 1:
        specs = apply_tensor_parallel(
            chunk, mesh, sequence_parallel=p.sequence_parallel, comm_overlap=p.tp_comm_overlap, specs=specs
        )
    if model_cfg.is_moe:
        specs = apply_expert_parallel(chunk, mesh, p.sequence_parallel, specs)
    if targets:
        apply_lora(chunk, targets, lo.lora_rank, lo.lora_alpha, lo.lora_dropout)
        specs = adapter_specs(chunk, specs)
    return specs


def _initial_adapters(cfg: RunConfig, model_cfg: ModelConfig) -> TensorsInMemory | None:
    """--lora-init-from's adapters as full tensors by global name (a PEFT adapter is small)."""
    lo = cfg.lora
    if not lo.lora_init_from:
        return None
    targets = find_targets(build_model(model_cfg), model_cfg, requested(lo.lora_targets))
    return TensorsInMemory(read_peft_dir(lo.lora_init_from, targets, lo.lora_rank))


def build_engine(cfg: RunConfig, derived: Derived, mesh: Mesh, model_cfg: ModelConfig | None = None) -> Engine:
    model_cfg = model_cfg or cfg.model_config()
    device = (
        torch.device(derived.device, torch.cuda.current_device()) if derived.device == "cuda" else torch.device("cpu")
    )
    dtype = DTYPES[derived.dtype_name]
    p = cfg.parallel
    resolved = kernel_choices(KernelChoices.of(cfg.train, cfg.optim), p.tp, device.type, derived.dtype_name, model_cfg)
    # off CUDA every layer keeps auto, as before (SDPA's pick even for math)
    kernels = resolved.in_layers() if device.type == "cuda" else KernelChoices()
    chunks, specs, forward_backward = _build_chunks(cfg, model_cfg, mesh)
    adapters = _initial_adapters(cfg, model_cfg)
    frozen: list[tuple[nn.Parameter, ParamSpec]] = []
    for i, chunk in enumerate(chunks):
        specs[i] = _split_and_adapt(cfg, model_cfg, mesh, chunk, specs[i])
        train = cfg.train  # apply_fp8 keeps the parameters: specs and init unchanged
        apply_fp8(chunk, train.fp8, train.fp8_emulate, train.fp8_head, train.fp8_experts)
        if not p.fsdp:  # else the sharded buffer writes this rank's shard of each parameter
            materialize(chunk, model_cfg, cfg.train.seed, device, dtype, specs[i])
        place_adapters(chunk)  # LoRA's row maps on the device, before any compiled forward
        if adapters is not None:  # before the optimizer: its fp32 master copies start from these
            named = ((p_, specs[i][n]) for n, p_ in chunk.named_parameters())
            read_weights(adapters, [(p_, spec) for p_, spec in named if spec.global_name in adapters.tensors])
        frozen += [(param, specs[i][name]) for name, param in chunk.named_parameters() if not param.requires_grad]
        apply_kernels(chunk, kernels)
        apply_context_parallel(chunk, mesh)  # before recompute, which then recomputes its K/V gather
        if cfg.train.recompute != "none":
            apply_recompute(chunk, cfg.train.recompute, cfg.train.recompute_layers)
        if derived.compile:
            apply_compile(chunk)
    buffer = partial(_buffer, cfg, mesh, model_cfg, device, dtype)

    # One buffer per chunk, in chunk order (the pipeline's tied-embedding sum pairs them); the experts' after them.
    split = mesh.layout.ep > 1
    buffers = [buffer(chunk, chunk_specs, False if split else None) for chunk, chunk_specs in zip(chunks, specs)]
    if split:  # (none where the experts are frozen: LoRA adapts the dense linears)
        buffers += [buffer(c, c_specs, True) for c, c_specs in zip(chunks, specs) if _trains_experts(c, c_specs)]
    optimizer = _optimizer(cfg, buffers, mesh, resolved.adamw, hidden_matrices(chunks, specs))
    scaler = DynamicLossScaler(device, cfg.train.initial_loss_scale) if dtype == torch.float16 else None
    objective = build_objective(cfg.objective, chunks, model_cfg, mesh, device, kernels.cross_entropy, derived.compile)
    return Engine(
        cfg,
        derived,
        mesh,
        model_cfg,
        chunks,
        buffers,
        optimizer,
        device,
        dtype,
        forward_backward,
        objective,
        scaler,
        frozen,
    )


def _buffer(
    cfg: RunConfig,
    mesh: Mesh,
    model_cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    chunk: Transformer,
    chunk_specs: ParamSpecs,
    experts: bool | None,
) -> Buffer:
    """The gradient buffer of `chunk` (--fsdp: its sharded buffer, which also materialises it). experts None:
    every parameter; False / True: the dense ones / the experts (reduced over their replicas)."""
    p = cfg.parallel
    group, replicas = (
        (mesh.expert_replica_group, mesh.layout.expert_replicas)
        if experts
        else (mesh.replica_group, mesh.layout.replicas)
    )
    if mesh.layout.hybrid_shards:  # hybrid sharding
        group, replicas = mesh.fsdp_shard_group, mesh.layout.hybrid_shards
    grad_dtype = torch.float32
    reduce_dtype = torch.bfloat16 if p.grad_reduce_dtype == "bf16" else None
    if p.fsdp:
        return ShardedBuffer(
            chunk,
            group,
            replicas,
            chunk_specs,
            partial(_initial_local, model_cfg, cfg.train.seed, device),
            dtype,
            device,
            grad_dtype=grad_dtype,
            reduce_dtype=reduce_dtype,
            keep_params_in_backward=p.fsdp_keep_params_in_backward,
            prefetch=p.fsdp_prefetch,
            replicate_group=mesh.fsdp_replicate_group,
            tp_group=mesh.tp_group if mesh.layout.tp > 1 else None,
            select=None if experts is None else partial(_is_expert, experts),
        )
    return GradBuffer(
        chunk,
        group,
        replicas,
        grad_dtype=grad_dtype,
        bucket_size=p.bucket_size,
        distributed=p.distributed_optimizer,
        overlap_grad_reduce=p.overlap_grad_reduce,
        reduce_dtype=reduce_dtype,
        specs=chunk_specs,
        select=None if experts is None else partial(_is_expert, experts),
    )


def _optimizer(
    cfg: RunConfig, buffers: list[Buffer], mesh: Mesh, adamw_kernel: str, matrices: frozenset[str]
) -> SegmentOptimizer:
    """The run's --optimizer over the buffers' parameters; adamw_kernel auto: the Triton pass on CUDA, measured
    2 ms faster of a 351 ms llama-1b step on an H200 (RESULTS.md run 4)."""
    distributed = cfg.parallel.distributed_optimizer or cfg.parallel.fsdp
    args = BuildArgs(cfg.optim, buffers, mesh, distributed, adamw_kernel, mesh.fsdp_shard_group, matrices)
    return optimizer_kind(cfg.optim.optimizer).build(args)


def _initial_local(model_cfg: ModelConfig, seed: int, device: torch.device, spec: ParamSpec) -> torch.Tensor:
    """A parameter's initial fp32 value as this rank holds it before data-parallel sharding (--fsdp), as
    models.init.materialize draws it."""
    return spec.shard(init_full_tensor(spec.global_name, torch.Size(spec.full_shape), model_cfg, seed, device))


def _trains_experts(chunk: Transformer, specs: ParamSpecs) -> bool:
    return any(p.requires_grad and specs[n].is_expert for n, p in chunk.named_parameters())


def _is_expert(experts: bool, spec: ParamSpec) -> bool:
    return spec.is_expert == experts


def forward_each(engine: Engine, micro_batches: list[dict], on_output: Callable[[nn.Module, torch.Tensor, dict], None]):
    """Forward every micro-batch (no backward, eval mode) and call on_output(chunk, its logits, the micro-batch):
    through the pipeline's forward-only schedule (on its last stage), or the one chunk. Evaluation and DPO's
    reference pass use it."""
    if engine.mesh.layout.pp > 1:
        pipeline_forward_each(engine, micro_batches, on_output)
        return
    model = engine.chunks[0]
    was_training = model.training
    model.eval()
    try:
        for mb in micro_batches:
            on_output(model, model(mb["input_ids"], **batch_inputs(mb)), mb)
    finally:
        model.train(was_training)


def forward_backward_no_pipeline(engine: Engine, micro_batches: list[dict], normaliser: torch.Tensor) -> torch.Tensor:
    """Gradient accumulation over micro-batches; each adds the objective's share of the step's loss."""
    model = engine.chunks[0]
    loss_sum = torch.zeros((), device=engine.device)
    for i, mb in enumerate(micro_batches):
        mark_last_microbatch(engine.buffers, model, i == len(micro_batches) - 1)
        loss = engine.objective.loss(model(mb["input_ids"], **batch_inputs(mb)), mb, normaliser)
        loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def train_step(
    engine: Engine, micro_batches: list[dict], step: int, on_phase: OnPhase | None = None
) -> dict[str, torch.Tensor | float | None]:
    """One optimizer step over this rank's micro-batches. Returns device tensors (no host sync).

    on_phase: called after each phase, for bench's breakdown; the training loop passes none."""
    cfg = engine.cfg
    normaliser = engine.objective.normaliser(micro_batches)
    for buf in engine.buffers:
        buf.zero_grad()
    scaler = engine.loss_scaler
    sequences = sum(int(mb["input_ids"].shape[0]) for mb in micro_batches) * engine.mesh.layout.dp  # the step's samples
    engine.objective.begin_step(sequences, None if scaler is None else scaler.scale)
    engine.objective.before_forward(lambda: forward_each(engine, micro_batches, _ignore_output))
    if scaler is None:
        loss = engine.forward_backward(engine, micro_batches, normaliser)
    else:  # fp16: dividing by normaliser/scale multiplies every gradient by the scale
        loss = engine.forward_backward(engine, micro_batches, normaliser / scaler.scale) / scaler.scale
    if on_phase is not None:
        on_phase("forward_backward")
    for buf in engine.buffers:
        buf.finish_grad_sync()
    if (
        engine.mesh.layout.tp > 1
    ):  # gradients each tp rank holds only part of (sequence-parallel norms, replicated KV heads)
        sync_tensor_parallel_grads([g for buf in engine.buffers for g in buf.tp_partial_grads], engine.mesh.tp_group)
    if on_phase is not None:
        on_phase("grad_sync")
    lr = lr_at(
        step, cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.train.train_steps, cfg.optim.lr_schedule
    )
    grad_norm, found_inf = engine.optimizer.step(lr, None if scaler is None else scaler.scale)
    if scaler is not None:
        scaler.update(found_inf)
    engine.objective.end_step()
    engine.optimizer.publish_params(overlap=cfg.parallel.overlap_param_gather)
    if on_phase is not None:
        on_phase("optimizer")
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "found_inf": found_inf,
        "lr": lr,
        "loss_scale": None if scaler is None else scaler.scale,
        "stats": engine.objective.local_stats(),  # reduced only if the step is logged (metrics.py)
        "sequences": sequences,
    }


def _ignore_output(chunk: nn.Module, logits: torch.Tensor, mb: dict) -> None:
    pass
