"""The planner's model: the memory per GPU of a layout, and how fast it should run (plan_search.py searches the
layouts that fit a model on a cluster with it).

Memory model (bytes on the busiest GPU: every pipeline rank is evaluated, the largest is reported)
---------------------------------------------------------------------------------------------------
Weights, gradients, optimizer state: per parameter the rank holds, as parallel/optimizer.py allocates them:
bf16 params 2 + fp32 grads 4 + (fp32 master 4 + moments 8) / s; fp32 params 4 + 4 + 8 / s (s = dp x cp, the
replicas holding the same weights, with the distributed optimizer, else 1). Tensor-parallel shards divide by
tp (KV heads stay >= 1 per rank), norms are replicated, the vocabulary is padded to 128*tp (parallel/tensor.py);
the embedding sits on the first stage, the head and final norm on the last, and a tied embedding keeps a copy
there when pp > 1.

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

Speed model (ranks a search's layouts; a fixed layout, and a search's best with --simulate, go through the
step simulator of llamatron/planning/simulator/, docs/simulator.md; both take their numbers from
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
  optimizer step: memory-bound, about 30 bytes per owned parameter plus 8 per held parameter;
  --fp8: the decoder's linear FLOPs (6 x layer parameters per token, 2 more with full recompute) run
    SpeedAssumptions.fp8_gemm_speedup times faster (fitted to RESULTS.md run 9); memory is the bf16 figure (the
    measured FP8 peaks were 2-5 GiB below bf16's: a margin, not modelled).
  Calibrated against llamatron's own compiled bf16 runs on H200s (benchmarks/h200_peak_memory.json: 21
  runs of llama-1b and Llama 2 7B on one and two GPUs, each within 10%, tested); eager runs are ~27% slower
  than it says. It models the layout, not the kernel choices (FA4, the Triton kernels).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..config.settings import ParallelConfig, RunConfig
from ..models import ModelConfig
from ..models.inventory import flops_per_token, layers
from ..models.rope_op import supports_head_dim as rope_supports_head_dim
from ..parallel.tensor import padded_vocab_size
from ..training.kernel_settings import KernelFlags, kernel_choices
from ..training.validate import validate
from .activations import (
    LayerKernels,
    chunk_activation_bytes,
    chunks_in_flight,
    gathered_kv_bytes,
    layer_activation_bytes,
)
from .params import (
    active_layer_params,
    expert_layer_params,
    local_vocab,
    stage_layers,
    stage_params,
)
from .params import bytes_per_param as bytes_per_param  # re-exported: the planner's public names
from .params import layer_params as layer_params
from .simulator.calibration import Calibration, load_calibration
from .simulator.hardware import Hardware, resolve_hardware

GB = 1e9
GiB = 2**30
FRAGMENTATION = 0.15
RUNTIME_BASE, RUNTIME_PER_COMM = 1 * GiB, 0.5 * GiB


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int
    dp: int
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: str
    micro_batch_size: int
    global_batch_size: int
    recompute_layers: int | None = None  # --recompute-layers: only the first N layers of each chunk
    cp: int = 1  # --cp: ranks that split every sequence (world = tp x cp x dp x pp)
    ep: int = 1  # --ep: a mixture of experts' experts split over this many of the dp ranks

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts: their gradients are reduced, and the optimizer sharded, over these."""
        return max(1, self.replicas // self.ep)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per data-parallel rank per step (m; the cp ranks of a dp slot share the samples)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights: gradients are reduced, and the optimizer sharded, over dp x cp."""
        return self.dp * self.cp

    @property
    def label(self) -> str:
        """The parallel sizes in words, for messages: 'tp 8 x cp 2 x pp 1, dp 1'."""
        return f"tp {self.tp} x cp {self.cp} x pp {self.pp}, dp {self.dp}" + (f" (ep {self.ep})" if self.ep > 1 else "")

    @property
    def recompute_label(self) -> str:
        """'full', or 'full:N' when only the first N layers of each chunk are recomputed."""
        return self.recompute if self.recompute_layers is None else f"{self.recompute}:{self.recompute_layers}"

    def train_flags(self, seq_length: int) -> str:
        """The `llamatron train` flags that run this layout (launched on tp x cp x pp x dp processes)."""
        flags = [f"--tp {self.tp}", f"--pp {self.pp}"]
        flags += [f"--cp {self.cp}"] if self.cp > 1 else []
        flags += [f"--ep {self.ep}"] if self.ep > 1 else []
        flags += [f"--vpp {self.vpp}"] if self.vpp > 1 else []
        flags += ["--sequence-parallel"] if self.sequence_parallel else []
        flags += ["--distributed-optimizer"] if self.distributed_optimizer and self.replicas > 1 else []
        if self.recompute != "none":
            flags.append(f"--recompute {self.recompute}")
            flags += [f"--recompute-layers {self.recompute_layers}"] if self.recompute_layers is not None else []
        flags += [
            f"--micro-batch-size {self.micro_batch_size}",
            f"--global-batch-size {self.global_batch_size}",
            f"--seq-length {seq_length}",
        ]
        return " ".join(flags)


@dataclass(frozen=True)
class Precision:
    """How the run computes: parameter/activation dtype, compiled layers, gradient-reduction dtype."""

    dtype: str = "bf16"
    compiled: bool = True
    grad_reduce_dtype: str = "fp32"
    fused_norms: bool = True  # RMSNorm as Triton kernels (models/rmsnorm_op.py), the default on CUDA
    fused_rope: bool = True  # QKV split + rotary as Triton kernels (models/rope_op.py), the default on CUDA
    fused_swiglu: bool = True  # SwiGLU as Triton kernels (models/swiglu_op.py), the default on CUDA
    fused_loss: bool = True  # the cross-entropy as Triton kernels (models/cross_entropy_op.py), the default on CUDA
    fp8: str = "none"  # --fp8: the decoder's linears in FP8 (speed: SpeedAssumptions.fp8_gemm_speedup)

    @property
    def act_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    def layer_kernels(self, model: ModelConfig) -> LayerKernels:
        """What a decoder layer of `model` runs: the RMSNorm and SwiGLU kernels where it has those layers, the
        rotary kernel where the head dim is a power of two and no q/k norm sits between projection and rotary."""
        layer = layers(model)[0]
        return LayerKernels(
            self.compiled,
            self.fused_norms and layer.norm == "rmsnorm",
            self.fused_rope and rope_supports_head_dim(model.head_dim) and not layer.qk_norm,
            self.fused_swiglu and layer.mlp == "swiglu",
        )


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


def static_memory(
    model: ModelConfig, lay: Layout, precision: Precision = Precision(), pp_layers: str | None = None
) -> float:
    """Weights + gradients + optimizer state on the busiest pipeline rank, which context parallelism does not
    shrink (cp splits the sequence, not the weights): with runtime_memory, a lower bound of layout_memory."""
    chunks = stage_layers(model, lay.pp, lay.vpp, pp_layers)
    return max(sum(_state_bytes(model, lay, precision, sum(chunks[r]), r)) for r in range(lay.pp))


def _state_bytes(
    model: ModelConfig, lay: Layout, prec: Precision, layers: int, rank: int
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes on pipeline rank `rank`: expert weights' optimizer state is
    sharded over the dp/ep ranks holding the same experts, the rest over dp x cp."""
    params = stage_params(model, lay.tp, lay.pp, rank, layers, lay.ep)[0]
    experts = layers * expert_layer_params(model, lay.tp, lay.ep)
    w, g, o = bytes_per_param(prec.dtype, lay.distributed_optimizer, lay.replicas)
    o_expert = bytes_per_param(prec.dtype, lay.distributed_optimizer, lay.expert_replicas)[2]
    return w * params, g * params, o * (params - experts) + o_expert * experts


def runtime_memory(lay: Layout) -> float:
    """Memory outside PyTorch's allocator: the CUDA context and libraries, and NCCL's buffers per communicator
    that moves data: tp, pp, cp and the replicas' (dp x cp; the dp group's own without cp)."""
    return RUNTIME_BASE + RUNTIME_PER_COMM * sum(1 for n in (lay.tp, lay.pp, lay.cp, lay.replicas) if n > 1)


def layout_memory(
    model: ModelConfig,
    layout: Layout,
    seq_length: int,
    precision: Precision = Precision(),
    pp_layers: str | None = None,
    recompute_layers: int | None = None,
) -> Memory:
    """Peak memory per GPU of a layout: the largest over its pipeline ranks."""
    if recompute_layers is None:
        recompute_layers = layout.recompute_layers
    ranks = [
        _rank_memory(model, layout, seq_length, precision, pp_layers, recompute_layers, r) for r in range(layout.pp)
    ]
    return max(ranks, key=lambda m: m.total)


def _rank_memory(
    model: ModelConfig,
    lay: Layout,
    seq_length: int,
    prec: Precision,
    pp_layers: str | None,
    recompute_layers: int | None,
    rank: int,
) -> Memory:
    a = prec.act_bytes
    chunks = stage_layers(model, lay.pp, lay.vpp, pp_layers)[rank]
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
    reduce_staging = 2.0 * params if prec.grad_reduce_dtype == "bf16" and lay.replicas > 1 else 0.0
    gather_staging = a * params / lay.replicas if lay.distributed_optimizer and lay.replicas > 1 else 0.0
    during_backward = activations + temporaries + a * largest + reduce_staging
    staging = reduce_staging + max(0.0, gather_staging - during_backward)
    buffers = {
        "temporaries": temporaries,
        "staging": staging,
        "param_grad": float(a * largest),
        # ids and labels of this rank's seq/cp tokens; with cp also their positions (parallel/context.py)
        "batch": (16.0 if lay.cp == 1 else 24.0) * seq_length / lay.cp * lay.global_batch_size / lay.dp,
    }
    buffers["fragmentation"] = FRAGMENTATION * (activations + temporaries + staging + a * largest)
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
        p.tp,
        p.pp,
        p.vpp,
        dp,
        p.sequence_parallel,
        p.distributed_optimizer,
        t.recompute,
        t.micro_batch_size,
        t.global_batch_size,
        t.recompute_layers,
        p.cp,
        p.ep,
    )


def predict_peak_memory(run_config: RunConfig, world_size: int) -> dict:
    """Predicted peak memory per GPU (bytes) of a training run, for comparing with a measured peak.

    `allocated` compares with torch.cuda.max_memory_allocated() (the metrics' peak_mem_gib is that in GiB);
    `total` adds the allocator's fragmentation and memory outside PyTorch, and is what must fit in the GPU.
    """
    derived = validate(run_config, world_size, cuda_available=run_config.train.device != "cpu")
    p = run_config.parallel
    flags = KernelFlags.of(run_config.train, run_config.optim)
    kernels = kernel_choices(flags, p.tp, derived.device, derived.dtype_name, run_config.model_config())
    precision = Precision(
        "fp32" if derived.dtype_name == "fp32" else "bf16",
        derived.compile,
        p.grad_reduce_dtype,
        fused_norms=kernels["rmsnorm"] == "triton",
        fused_rope=kernels["rope"] == "triton",
        fused_swiglu=kernels["swiglu"] == "triton",
        fused_loss=kernels["cross_entropy"] == "triton",
    )
    mem = layout_memory(
        run_config.model_config(),
        run_layout(run_config, derived.dp),
        run_config.data.seq_length,
        precision,
        p.pp_layers,
    )
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


# ---- speed --------------------------------------------------------------------------------------------------


def estimate_speed(
    model: ModelConfig,
    lay: Layout,
    seq_length: int,
    gpus: int,
    gpus_per_node: int,
    hw: SpeedAssumptions = SpeedAssumptions(),
    precision: str = "bf16",
    fp8: str = "none",
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
    per_micro_batch = compute + tp_comm + cp_comm + p2p
    m = lay.micro_batches
    bubble = (lay.pp - 1) / (m * lay.vpp)
    pipeline = per_micro_batch * m * (1 + bubble)
    params = max(stage_params(model, lay.tp, lay.pp, r, L // lay.pp, lay.ep)[0] for r in range(lay.pp))
    reduce_exposed, gather_exposed = _replica_comm_exposed(lay, params, per_micro_batch, gpus_per_node, hw, a)
    owned = params / (lay.replicas if lay.distributed_optimizer else 1)
    optimizer = (30 * owned + 8 * params) / hw.hbm_bw
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
            "bubble": pipeline - per_micro_batch * m,
            "dp_exposed": reduce_exposed + gather_exposed,
            "optimizer": optimizer,
        },
    )


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
