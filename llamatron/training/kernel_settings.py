"""What the kernel flags (--attention-backend, --swiglu-backend, --rmsnorm-backend, --rope-backend,
--cross-entropy-backend, --adamw-kernel) run, auto resolved, and the rules they must follow."""

from __future__ import annotations

import torch

from ..kernels.choices import NOT_RUN, KernelChoices
from ..kernels.flash4_op import SUPPORTED_HEAD_DIMS, unavailable_reason
from ..kernels.rope_op import supports_head_dim
from ..kernels.triton_check import HAS_TRITON
from ..models import ModelConfig
from ..models.families import family_of
from ..models.inventory import layers


def kernel_choices(flags: KernelChoices, tp: int, device: str, dtype_name: str, model: ModelConfig) -> KernelChoices:
    """What each kernel switch runs on `device`: auto resolved as the code resolves it (triton on CUDA with Triton
    installed, else torch), NOT_RUN ("-") where the model has no such layer (a GELU MLP, LayerNorm). Attention
    under auto: FlashAttention 4 where it can run (installed, Hopper or newer, bf16/fp16, a head dim it tunes:
    measured 3% faster per llama-1b step than SDPA's cuDNN on an H200, RESULTS.md run 5), else SDPA's pick."""
    triton_here = device == "cuda" and HAS_TRITON

    def pick(setting: str, supported: bool = True) -> str:
        return "triton" if setting != "torch" and triton_here and supported else "torch"

    layer = layers(model)[0]
    swiglu, rmsnorm = layer.block.swiglu_kernel, layer.block.rmsnorm_kernel  # what the layer declares
    attention = flags.attention
    if attention == "auto" and device == "cuda" and fa4_problem(model.head_dim, dtype_name) is None:
        attention = "fa4"
    return KernelChoices(
        attention=attention,
        swiglu=pick(flags.swiglu) if swiglu else NOT_RUN,
        rmsnorm=pick(flags.rmsnorm) if rmsnorm else NOT_RUN,
        rope=pick(flags.rope, layer.attention.fused_rope),  # its attention declares it
        cross_entropy=pick(flags.cross_entropy) if tp == 1 else NOT_RUN,
        adamw=pick(flags.adamw),
    )


def fa4_problem(head_dim: int, dtype_name: str) -> str | None:
    """Why FlashAttention 4 cannot run this model here (None: it can), with the fix."""
    if dtype_name not in ("bf16", "fp16"):
        return f"runs in bf16 or fp16, not {dtype_name}: use --precision bf16 or --attention-backend auto"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return (
            f"supports head dims {', '.join(map(str, SUPPORTED_HEAD_DIMS))} (FlashAttention 4's tuned ones); this "
            f"model's is {head_dim}: use --attention-backend auto"
        )
    reason = unavailable_reason()
    if reason is not None:
        return (
            f"needs FlashAttention 4 ({reason}): pip install -e '.[fa4]' in llamatron's checkout (or pip install "
            "'flash-attn-4[cu13]==4.0.0b36', the tested version), or use --attention-backend auto"
        )
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return (
            f"runs on Hopper (compute capability 9.0) or newer; this GPU is {major}.{minor}: use "
            "--attention-backend auto"
        )
    return None


def kernel_problems(flags: KernelChoices, tp: int, model: ModelConfig, device: str, dtype_name: str) -> list[str]:
    """The kernel flags against the model, the device and the precision (training/validate.py asks)."""
    f, out = flags, []
    if f.attention not in ("auto", "math") and device != "cuda":  # math is what runs off CUDA anyway
        out.append(f"--attention-backend {f.attention} picks a CUDA kernel; on {device} leave it at auto")
    problem = fa4_problem(model.head_dim, dtype_name) if f.attention == "fa4" and device == "cuda" else None
    if problem is not None:
        out.append(f"--attention-backend fa4 {problem}")
    layer, family = layers(model)[0], family_of(model).description
    if f.swiglu == "triton" and not layer.block.swiglu_kernel:
        out.append(
            f"--swiglu-backend triton: {family} models use a {layer.mlp.upper()} MLP, not SwiGLU; leave it at auto"
        )
    if f.rmsnorm == "triton" and not layer.block.rmsnorm_kernel:
        out.append(f"--rmsnorm-backend triton: {family} models use LayerNorm, not RMSNorm; leave it at auto")
    if f.rope == "triton" and layer.qk_norm:
        out.append(
            f"--rope-backend triton: {family} models normalise each query and key head between the projection and "
            "the rotary embedding, which the fused kernel does not; leave it at auto"
        )
    if f.cross_entropy == "triton" and tp > 1:
        out.append(
            f"--cross-entropy-backend triton: with --tp {tp} the loss is the vocabulary-parallel "
            "one, which has no Triton kernels; leave it at auto"
        )
    if f.rope == "triton" and not supports_head_dim(model.head_dim):
        out.append(
            f"--rope-backend triton needs a power-of-two head dim; this model's is {model.head_dim}: "
            "leave it at auto (which runs the torch expression here)"
        )
    return out or _triton_problems(f, device)


def _triton_problems(f: KernelChoices, device: str) -> list[str]:
    kernels = {
        "--swiglu-backend": f.swiglu,
        "--rmsnorm-backend": f.rmsnorm,
        "--rope-backend": f.rope,
        "--cross-entropy-backend": f.cross_entropy,
        "--adamw-kernel": f.adamw,
    }
    for flag, value in kernels.items():
        if value == "triton" and device != "cuda":
            return [f"{flag} triton runs on CUDA only; on {device} leave it at auto (which runs torch)"]
    if "triton" in kernels.values() and not HAS_TRITON:
        return [
            "--swiglu-backend/--rmsnorm-backend/--rope-backend/--cross-entropy-backend/--adamw-kernel "
            "triton need the triton package (pip install triton); or leave them at auto, which then "
            "runs the torch kernels"
        ]
    return []
