"""A layout the planner weighs (the parallel sizes, sharding, recompute and batch) and the precision it runs in."""

from __future__ import annotations

from dataclasses import dataclass

from ..models import ModelConfig
from ..models.inventory import layers
from .activations import LayerKernels


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
    fsdp: bool = False  # --fsdp: parameters, gradients and optimizer state sharded (parallel/fsdp.py)
    fsdp_shard_group: int | None = None  # --fsdp-shard-group N: hybrid sharding, shard over N replicas
    fsdp_keep_params: bool = False  # --fsdp-keep-params-in-backward: no re-gather in backward
    pp_layers: str | None = None  # --pp-layers: decoder layers per chunk where the split is not even
    # --etp: 1 keeps each expert whole, the experts over ep x tp ranks (None: tp, each expert split over tp). The
    # weights per rank are the same either way; the simulator models the step (simulator/costs.py), the memory model
    # still counts the gathered sequence's dispatched copies (1/tp of them are held under etp 1: an overestimate)
    etp: int | None = None

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts: their gradients are reduced, and the optimizer sharded, over these."""
        return max(1, self.replicas // self.ep)

    @property
    def dense_shards(self) -> int:
        """Ranks one copy of the dense weights is cut over: --fsdp's shard group (hybrid sharding: N), else dp x cp
        with the distributed optimizer or --fsdp, else 1 (what the optimizer state is divided by)."""
        if self.fsdp and self.fsdp_shard_group:
            return self.fsdp_shard_group
        return self.replicas if self.fsdp or self.distributed_optimizer else 1

    @property
    def expert_shards(self) -> int:
        """As dense_shards, for the experts (sharded over their own replicas; ep with hybrid sharding is refused)."""
        return self.expert_replicas if self.fsdp or self.distributed_optimizer else 1

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
        label = f"tp {self.tp} x cp {self.cp} x pp {self.pp}, dp {self.dp}"
        experts = (
            f" (ep {self.ep}{', etp 1' if self.experts_whole else ''})" if self.ep > 1 or self.experts_whole else ""
        )
        return label + experts + (f", {self.sharding}" if self.fsdp else "")

    @property
    def experts_whole(self) -> bool:
        """--etp 1 under tp > 1: every expert whole, the tp ranks more expert-parallel ranks."""
        return self.etp == 1 and self.tp > 1

    @property
    def sharding(self) -> str:
        """How the weights are held, for the table: 'fsdp', 'hsdp N' (shard over N), 'dist-opt' or 'no'."""
        if self.fsdp:
            return f"hsdp {self.fsdp_shard_group}" if self.fsdp_shard_group else "fsdp"
        return "dist-opt" if self.distributed_optimizer and self.replicas > 1 else "no"

    @property
    def recompute_label(self) -> str:
        """'full', or 'full:N' when only the first N layers of each chunk are recomputed."""
        return self.recompute if self.recompute_layers is None else f"{self.recompute}:{self.recompute_layers}"

    def train_flags(self, seq_length: int) -> str:
        """The `llamatron train` flags that run this layout (launched on tp x cp x pp x dp processes)."""
        flags = [f"--tp {self.tp}", f"--pp {self.pp}"]
        flags += [f"--cp {self.cp}"] if self.cp > 1 else []
        flags += [f"--ep {self.ep}"] if self.ep > 1 else []
        flags += ["--etp 1"] if self.experts_whole else []
        flags += [f"--vpp {self.vpp}"] if self.vpp > 1 else []
        flags += [f"--pp-layers {self.pp_layers}"] if self.pp_layers else []
        flags += ["--sequence-parallel"] if self.sequence_parallel else []
        flags += ["--distributed-optimizer"] if self.distributed_optimizer and self.replicas > 1 else []
        flags += ["--fsdp"] if self.fsdp else []
        flags += [f"--fsdp-shard-group {self.fsdp_shard_group}"] if self.fsdp and self.fsdp_shard_group else []
        flags += ["--fsdp-keep-params-in-backward"] if self.fsdp and self.fsdp_keep_params else []
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
    optimizer: str = "adamw"  # --optimizer: its state bytes per parameter; Muon's step cost (muon_cost.py)

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
            self.fused_rope and layer.attention.fused_rope,
            self.fused_swiglu and layer.mlp == "swiglu",
        )
