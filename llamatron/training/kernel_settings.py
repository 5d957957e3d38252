"""What the kernel flags (--attention-backend, --swiglu-backend, --rmsnorm-backend, --rope-backend,
--cross-entropy-backend, --adamw-kernel) run, auto resolved, and the rules they must follow."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError
from ..models import ModelConfig
from ..models.families import family_of
from ..models.flash4_op import SUPPORTED_HEAD_DIMS, unavailable_reason
from ..models.inventory import layers
from ..models.rope_op import supports_head_dim
from ..triton_check import HAS_TRITON

if TYPE_CHECKING:  # config imports this module to validate: the type only
    from ..config.settings import RunConfig


def kernel_choices(cfg: RunConfig, device: str, model: ModelConfig | None = None) -> dict[str, str]:
    """What each kernel switch runs on `device`: auto resolved as the code resolves it (triton on CUDA with Triton
    installed, else torch), "-" where the model has no such layer (a GELU MLP, LayerNorm). Attention
    under auto: FlashAttention 4 where it can run (installed, Hopper or newer, bf16/fp16, a head dim it tunes:
    measured 3% faster per llama-1b step than SDPA's cuDNN on an H200, RESULTS.md run 5), else SDPA's pick."""
    model = model or cfg.model_config()
    t = cfg.train
    triton_here = device == "cuda" and HAS_TRITON

    def pick(setting: str, supported: bool = True) -> str:
        return "triton" if setting != "torch" and triton_here and supported else "torch"

    layer = layers(model)[0]
    swiglu, rmsnorm = layer.mlp == "swiglu", layer.norm == "rmsnorm"
    attention = t.attention_backend
    if attention == "auto" and device == "cuda" and fa4_problem(model.head_dim, dtype_name(cfg, device)) is None:
        attention = "fa4"
    return {
        "attention": attention,
        "swiglu": pick(t.swiglu_backend) if swiglu else "-",
        "rmsnorm": pick(t.rmsnorm_backend) if rmsnorm else "-",
        "rope": pick(t.rope_backend, supports_head_dim(model.head_dim) and not layer.qk_norm),
        "cross_entropy": pick(t.cross_entropy_backend) if cfg.parallel.tp == 1 else "-",
        "adamw": pick(cfg.optim.adamw_kernel),
    }


def dtype_name(cfg: RunConfig, device: str) -> str:
    """--precision with auto resolved (bf16 on CUDA, fp32 elsewhere)."""
    p = cfg.train.precision
    return p if p != "auto" else ("bf16" if device == "cuda" else "fp32")


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


def check_kernel_settings(cfg: RunConfig, model: ModelConfig, device: str, dtype_name: str) -> None:
    """The kernel flags against the model, the device and the precision (config.validate calls this)."""
    p, t = cfg.parallel, cfg.train
    if t.attention_backend not in ("auto", "math") and device != "cuda":  # math is what runs off CUDA anyway
        raise ConfigError(
            f"--attention-backend {t.attention_backend} picks a CUDA kernel; on {device} leave it at auto"
        )
    problem = fa4_problem(model.head_dim, dtype_name) if t.attention_backend == "fa4" and device == "cuda" else None
    if problem is not None:
        raise ConfigError(f"--attention-backend fa4 {problem}")
    layer, family = layers(model)[0], family_of(model).description
    if t.swiglu_backend == "triton" and layer.mlp != "swiglu":
        raise ConfigError(
            f"--swiglu-backend triton: {family} models use a {layer.mlp.upper()} MLP, not SwiGLU; leave it at auto"
        )
    if t.rmsnorm_backend == "triton" and layer.norm != "rmsnorm":
        raise ConfigError(f"--rmsnorm-backend triton: {family} models use LayerNorm, not RMSNorm; leave it at auto")
    if t.rope_backend == "triton" and layer.qk_norm:
        raise ConfigError(
            f"--rope-backend triton: {family} models normalise each query and key head between the projection and "
            "the rotary embedding, which the fused kernel does not; leave it at auto"
        )
    if t.cross_entropy_backend == "triton" and p.tp > 1:
        raise ConfigError(
            f"--cross-entropy-backend triton: with --tp {p.tp} the loss is the vocabulary-parallel "
            "one, which has no Triton kernels; leave it at auto"
        )
    if t.rope_backend == "triton" and not supports_head_dim(model.head_dim):
        raise ConfigError(
            f"--rope-backend triton needs a power-of-two head dim; this model's is {model.head_dim}: "
            "leave it at auto (which runs the torch expression here)"
        )
    kernels = {
        "--swiglu-backend": t.swiglu_backend,
        "--rmsnorm-backend": t.rmsnorm_backend,
        "--rope-backend": t.rope_backend,
        "--cross-entropy-backend": t.cross_entropy_backend,
        "--adamw-kernel": cfg.optim.adamw_kernel,
    }
    for flag, value in kernels.items():
        if value == "triton" and device != "cuda":
            raise ConfigError(f"{flag} triton runs on CUDA only; on {device} leave it at auto (which runs torch)")
    if "triton" in kernels.values() and not HAS_TRITON:
        raise ConfigError(
            "--swiglu-backend/--rmsnorm-backend/--rope-backend/--cross-entropy-backend/--adamw-kernel "
            "triton need the triton package (pip install triton); or leave them at auto, which then "
            "runs the torch kernels"
        )
