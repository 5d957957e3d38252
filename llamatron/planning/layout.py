"""A layout the planner weighs (the parallel sizes, sharding, recompute and batch) and the precision it runs in."""

from __future__ import annotations

from dataclasses import dataclass

from ..models import ModelConfig
from ..models.inventory import layers
from ..parallel.layout import ParallelLayout
from .activations import LayerKernels


@dataclass(frozen=True, kw_only=True)
class Layout(ParallelLayout):
    """The parallel layout (parallel/layout.py: the sizes and sharding) with what else the planner weighs for it:
    recompute, the batch, and whether --fsdp keeps the gathered weights for backward."""

    recompute: str
    micro_batch_size: int
    global_batch_size: int
    recompute_layers: int | None = None  # --recompute-layers: only the first N layers of each chunk
    fsdp_keep_params: bool = False  # --fsdp-keep-params-in-backward: no re-gather in backward

    @property
    def micro_batches(self) -> int:
        """Micro-batches per data-parallel rank per step (m; the cp ranks of a dp slot share the samples)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def label(self) -> str:
        """The parallel sizes in words, for messages: 'tp 8 x cp 2 x pp 1, dp 1'."""
        label = f"tp {self.tp} x cp {self.cp} x pp {self.pp}, dp {self.dp}"
        experts = (
            f" (ep {self.ep}{', etp 1' if self.experts_fold_tp else ''})" if self.ep > 1 or self.experts_fold_tp else ""
        )
        return label + experts + (f", {self.sharding}" if self.fsdp else "")

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
        flags += ["--etp 1"] if self.experts_fold_tp else []
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
    fused_norms: bool = True  # RMSNorm as Triton kernels (kernels/rmsnorm_op.py), the default on CUDA
    fused_rope: bool = True  # QKV split + rotary as Triton kernels (kernels/rope_op.py), the default on CUDA
    fused_swiglu: bool = True  # SwiGLU as Triton kernels (kernels/swiglu_op.py), the default on CUDA
    fused_loss: bool = True  # the cross-entropy as Triton kernels (kernels/cross_entropy_op.py), the default on CUDA
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
            self.fused_norms and layer.block.rmsnorm_kernel,
            self.fused_rope and layer.attention.fused_rope,
            self.fused_swiglu and layer.block.swiglu_kernel,
        )
