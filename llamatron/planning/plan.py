"""The planner's model: the memory per GPU of a layout, and how fast it should run (plan_search.py searches the
layouts that fit a model on a cluster with it).

Memory model (bytes on the busiest GPU: every pipeline rank is evaluated, the largest is reported)
---------------------------------------------------------------------------------------------------
Weights, gradients, optimizer state: per parameter the rank holds, as the optimizer (llamatron/optim/) allocates them:
bf16 params 2 + fp32 grads 4 + (fp32 master 4 + moments 8) / s; fp32 params 4 + 4 + 8 / s (s = dp x cp, the
replicas holding the same weights, with the distributed optimizer, else 1); --optimizer muon keeps one 4-byte
momentum instead of the 8 bytes of moments for the decoder layers' matrices and experts (muon_cost.py, which
also prices its Newton-Schulz FLOPs and traffic for speed.py and the simulator). Tensor-parallel shards divide by
tp (KV heads stay >= 1 per rank), norms are replicated, the vocabulary is padded to 128*tp (parallel/tensor.py);
the embedding sits on the first stage, the head and final norm on the last, and a tied embedding keeps a copy
there when pp > 1. --fsdp: every bucket's shard, 2 + 4 + 12 bytes a parameter over the shard group
(fsdp_memory.py, which also counts the layers gathered and the gradients being reduce-scattered as buffers).

Activations: see plan_activations.py (what autograd saves per layer and chunk, per token). Context parallelism
(--cp) gives each rank seq/cp tokens of every sequence: activations, the loss and the batch count those, plus
the K/V each layer gathers over the cp ranks (kept per layer without recompute, plan_activations.py).

Buffers:
  temporaries   the larger of the loss peak on the last stage (per token and local vocabulary entry: 12 bytes
                for torch's eager cross-entropy at tp = 1 (fp32 log-softmax saved, its gradient, the incoming
                one), 2 x the activation dtype for the compiled one and the Triton one (the logits and their
                gradient; measured for the compiled one);
                10 for the vocabulary-parallel one, 14 when the shard holds padding) and the backward of one
                layer (gradients and re-computed tensors: about one layer's eager activations; with cp its
                gathered K/V and their gradients before the reduce-scatter)
  staging       bf16 copies of the gradient buckets (--grad-reduce-dtype bf16, 2 per param, during backward);
                the distributed optimizer's all-gather sources (a/dp per param) live after the step, when the
                activations are freed, and count only by how much they exceed the backward peak
  param_grad    the largest parameter's .grad in the parameter dtype before it is added into main_grad
  batch         the step's token ids and labels on the device, 16 bytes per token (this rank's seq/cp; with
                cp > 1 also their positions, 8 more)
  fragmentation 15% of the dynamic part (activations + the above); the flat parameter/gradient/optimizer
                buffers are few and large and do not fragment
  runtime       outside PyTorch's allocator: CUDA context and libraries 1 GiB, plus 0.5 GiB of NCCL buffers
                per communicator in use: tp, pp, cp and the replicas' (dp x cp; dp's own without cp)
`allocated` (everything but fragmentation and runtime) is what torch.cuda.max_memory_allocated() should read.

Speed model: speed.py (the ranking model), llamatron/planning/simulator/ (the step simulator).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..adapters.nf4 import nf4_base_bytes
from ..config.settings import RunConfig
from ..kernels.choices import KernelChoices
from ..models import ModelConfig
from ..parallel.layout import LayoutChoice, layout_values
from ..parallel.pipeline import split_layers
from ..parallel.tensor import padded_vocab_size
from ..training.kernel_settings import kernel_choices
from ..training.validate import validate
from .activations import (
    chunk_activation_bytes,
    chunks_in_flight,
    gathered_kv_bytes,
    layer_activation_bytes,
)
from .fsdp_memory import fsdp_buffers, fsdp_state_bytes
from .layout import Layout as Layout  # re-exported: the planner's public names
from .layout import Precision as Precision
from .muon_cost import matrix_share
from .params import bytes_per_param as bytes_per_param
from .params import (
    expert_layer_params,
    local_vocab,
    stage_layers,
    stage_params,
)
from .params import layer_params as layer_params
from .speed import Speed as Speed
from .speed import SpeedAssumptions as SpeedAssumptions
from .speed import context_comm_seconds as context_comm_seconds
from .speed import estimate_speed as estimate_speed

GB = 1e9
GiB = 2**30
FRAGMENTATION = 0.15
RUNTIME_BASE, RUNTIME_PER_COMM = 1 * GiB, 0.5 * GiB


@dataclass
class Memory:
    """Bytes on the busiest GPU (pipeline rank `stage`)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: dict[str, float]
    stage: int = 0
    temporaries_kind: str = ""

    @property
    def static(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def buffers_total(self) -> float:
        return sum(self.buffers.values())

    @property
    def total(self) -> float:
        return self.static + self.activations + self.buffers_total

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated() should read."""
        return self.total - self.buffers["fragmentation"] - self.buffers["runtime"]


@dataclass
class Plan:
    layout: Layout
    memory: Memory
    speed: Speed

    def to_dict(self) -> dict:
        m = self.memory
        return {
            **asdict(self.layout),
            "micro_batches": self.layout.micro_batches,
            "memory_gb": {
                "weights": m.weights / GB,
                "gradients": m.gradients / GB,
                "optimizer": m.optimizer / GB,
                "activations": m.activations / GB,
                "buffers": m.buffers_total / GB,
                "total": m.total / GB,
                "buffer_parts": {k: v / GB for k, v in m.buffers.items()},
            },
            "peak_stage": m.stage,
            "tokens_per_sec_per_gpu": self.speed.tokens_per_sec_per_gpu,
            "mfu": self.speed.mfu,
            "bubble": self.speed.bubble,
            "step_seconds": self.speed.step_seconds,
        }


def loss_bytes_per_token(
    model: ModelConfig, tp: int, compiled: bool = False, act_bytes: int = 2, fused: bool = False
) -> float:
    """Peak of the loss's temporaries per token on the last stage (see the module docstring)."""
    vocab = local_vocab(model, tp)
    if tp == 1 and (compiled or fused):  # no fp32 copy of the logits: the logits and their gradient only
        return 2.0 * act_bytes * vocab
    if tp == 1:
        return 12.0 * vocab
    padded = padded_vocab_size(model.vocab_size, tp) > model.vocab_size
    return (14.0 if padded else 10.0) * vocab


# ---- memory of a layout -------------------------------------------------------------------------------------


def static_memory(model: ModelConfig, lay: Layout, precision: Precision = Precision()) -> float:
    """Weights + gradients + optimizer state on the busiest pipeline rank, which context parallelism does not
    shrink (cp splits the sequence, not the weights): with runtime_memory, a lower bound of layout_memory."""
    chunks = stage_layers(model, lay.pp, lay.vpp, lay.pp_layers)
    return max(sum(_state_bytes(model, lay, precision, sum(chunks[r]), r)) for r in range(lay.pp))


def _state_bytes(
    model: ModelConfig, lay: Layout, prec: Precision, layers: int, rank: int
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes on pipeline rank `rank`: expert weights' optimizer state is
    sharded over the dp/ep ranks holding the same experts, the rest over dp x cp."""
    if lay.fsdp:
        return fsdp_state_bytes(model, lay, prec, layers, rank)
    params = stage_params(model, lay.tp, lay.pp, rank, layers, lay.ep)[0]
    experts = layers * expert_layer_params(model, lay.tp, lay.ep)
    share = matrix_share(model, lay, prec, params - experts, layers)
    w, g, o = bytes_per_param(prec.dtype, lay.distributed_optimizer, lay.replicas, prec.optimizer, share)
    o_expert = bytes_per_param(prec.dtype, lay.distributed_optimizer, lay.expert_replicas, prec.optimizer, 1.0)[2]
    return w * params, g * params, o * (params - experts) + o_expert * experts


def runtime_memory(lay: Layout) -> float:
    """Memory outside PyTorch's allocator: the CUDA context and libraries, and NCCL's buffers per communicator
    that moves data: tp, pp, cp and the replicas' (dp x cp; the dp group's own without cp; hybrid sharding's
    shard and replicate groups instead)."""
    hybrid = 1 if lay.fsdp and lay.fsdp_shard_group else 0
    return RUNTIME_BASE + RUNTIME_PER_COMM * (sum(1 for n in (lay.tp, lay.pp, lay.cp, lay.replicas) if n > 1) + hybrid)


def layout_memory(
    model: ModelConfig,
    layout: Layout,
    seq_length: int,
    precision: Precision = Precision(),
    recompute_layers: int | None = None,
) -> Memory:
    """Peak memory per GPU of a layout: the largest over its pipeline ranks."""
    if recompute_layers is None:
        recompute_layers = layout.recompute_layers
    ranks = [_rank_memory(model, layout, seq_length, precision, recompute_layers, r) for r in range(layout.pp)]
    return max(ranks, key=lambda m: m.total)


def memory_within(
    model: ModelConfig, layout: Layout, seq_length: int, precision: Precision, gpu_memory: float
) -> Memory | None:
    """layout_memory where its total is at most gpu_memory, else None: answered at the first pipeline rank that
    overflows, the first (the most micro-batches in flight) and the last (the loss) weighed before the others."""
    ranks: dict[int, Memory] = {}
    for r in dict.fromkeys([0, layout.pp - 1, *range(1, layout.pp - 1)]):
        ranks[r] = _rank_memory(model, layout, seq_length, precision, layout.recompute_layers, r)
        if ranks[r].total > gpu_memory:
            return None
    return max((ranks[r] for r in range(layout.pp)), key=lambda m: m.total)


def _rank_memory(
    model: ModelConfig,
    lay: Layout,
    seq_length: int,
    prec: Precision,
    recompute_layers: int | None,
    rank: int,
) -> Memory:
    a = prec.act_bytes
    chunks = stage_layers(model, lay.pp, lay.vpp, lay.pp_layers)[rank]
    params, largest = stage_params(model, lay.tp, lay.pp, rank, sum(chunks), lay.ep)
    weights, gradients, optimizer = _state_bytes(model, lay, prec, sum(chunks), rank)
    tokens = lay.micro_batch_size * seq_length // lay.cp  # this rank's part of each micro-batch
    kernels = prec.layer_kernels(model)
    per_chunk = [
        chunk_activation_bytes(
            model,
            layers,
            rank == 0 and v == 0,
            rank == lay.pp - 1 and v == lay.vpp - 1,
            a,
            lay.tp,
            lay.sequence_parallel,
            lay.recompute,
            lay.pp > 1,
            kernels,
            recompute_layers,
            lay.cp,
        )
        for v, layers in enumerate(chunks)
    ]
    in_flight = chunks_in_flight(lay.pp, lay.vpp, lay.micro_batches, rank)
    activations = in_flight * sum(per_chunk) / len(per_chunk) * tokens
    # One layer's backward; with cp its gathered K/V (kept or re-gathered) and their not yet reduce-scattered grads.
    one_layer = tokens * (
        layer_activation_bytes(model, a, lay.tp, lay.sequence_parallel, "none", cp=lay.cp)
        + gathered_kv_bytes(model, a, lay.tp, lay.cp)
    )
    loss = (
        loss_bytes_per_token(model, lay.tp, prec.compiled, a, prec.fused_loss) * tokens if rank == lay.pp - 1 else 0.0
    )
    temporaries, kind = (loss, "logits/loss") if loss > one_layer else (one_layer, "one layer's backward")
    bucketed = not lay.fsdp and lay.replicas > 1  # --fsdp stages its gradients per layer (fsdp_buffers)
    reduce_staging = 2.0 * params if prec.grad_reduce_dtype == "bf16" and bucketed else 0.0
    gather_staging = a * params / lay.replicas if lay.distributed_optimizer and bucketed else 0.0
    during_backward = activations + temporaries + a * largest + reduce_staging
    staging = reduce_staging + max(0.0, gather_staging - during_backward)
    buffers = {
        "temporaries": temporaries,
        "staging": staging,
        "param_grad": float(a * largest),
        # ids and labels of this rank's seq/cp tokens; with cp also their positions (parallel/context.py)
        "batch": (16.0 if lay.cp == 1 else 24.0) * seq_length / lay.cp * lay.global_batch_size / lay.dp,
    }
    if lay.fsdp:
        buffers.update(fsdp_buffers(model, lay, prec, rank))
    sharded = buffers.get("gathered", 0.0) + buffers.get("reduce_inputs", 0.0)
    buffers["fragmentation"] = FRAGMENTATION * (activations + temporaries + staging + a * largest + sharded)
    buffers["runtime"] = runtime_memory(lay)
    return Memory(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        buffers=buffers,
        stage=rank,
        temporaries_kind=kind,
    )


def run_layout(run_config: RunConfig, dp: int) -> Layout:
    """The Layout of a run's configuration (dp: its data-parallel size, from training.validate)."""
    p, t = run_config.parallel, run_config.train
    return Layout(
        **{**layout_values(p, LayoutChoice), "fsdp_shard_group": p.fsdp_shard_group if p.fsdp else None},
        dp=dp,
        recompute=t.recompute,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        recompute_layers=t.recompute_layers,
        fsdp_keep_params=p.fsdp and p.fsdp_keep_params_in_backward,
    )


def _with_nf4_base(run_config: RunConfig, mem: Memory, itemsize: int) -> Memory:
    """`mem` with its stage's decoder linears held as NF4 (adapters/nf4.py) instead of dense."""
    model, p = run_config.model_config(), run_config.parallel
    counts = split_layers(model.num_layers, p.pp, p.vpp, p.pp_layers)  # chunk c (model order) on rank c % pp
    starts = [sum(counts[:c]) for c in range(len(counts))]
    layers = {i for c in range(mem.stage, len(counts), p.pp) for i in range(starts[c], starts[c] + counts[c])}
    held, dense = nf4_base_bytes(model, itemsize, layers)
    return replace(mem, weights=mem.weights - dense + held)


def predict_peak_memory(run_config: RunConfig, world_size: int) -> dict:
    """Predicted peak memory per GPU (bytes) of a training run, for comparing with a measured peak.

    `allocated` compares with torch.cuda.max_memory_allocated() (the metrics' peak_mem_gib is that in GiB);
    `total` adds the allocator's fragmentation and memory outside PyTorch, and is what must fit in the GPU.
    """
    derived = validate(run_config, world_size, cuda_available=run_config.train.device != "cpu")
    p = run_config.parallel
    flags = KernelChoices.of(run_config.train, run_config.optim)
    kernels = kernel_choices(flags, p.tp, derived.device, derived.dtype_name, run_config.model_config())
    precision = Precision(
        "fp32" if derived.dtype_name == "fp32" else "bf16",
        derived.compile,
        p.grad_reduce_dtype,
        fused_norms=kernels.rmsnorm == "triton",
        fused_rope=kernels.rope == "triton",
        fused_swiglu=kernels.swiglu == "triton",
        fused_loss=kernels.cross_entropy == "triton",
    )
    mem = layout_memory(
        run_config.model_config(),
        run_layout(run_config, derived.dp),
        run_config.data.seq_length,
        precision,
    )
    if run_config.lora.base_precision == "nf4":
        mem = _with_nf4_base(run_config, mem, 4 if derived.dtype_name == "fp32" else 2)
    return {
        "weights": mem.weights,
        "gradients": mem.gradients,
        "optimizer": mem.optimizer,
        "activations": mem.activations,
        "buffers": mem.buffers_total,
        "buffer_parts": dict(mem.buffers),
        "allocated": mem.allocated,
        "total": mem.total,
        "stage": mem.stage,
        "allocated_gib": mem.allocated / GiB,
        "total_gib": mem.total / GiB,
    }
