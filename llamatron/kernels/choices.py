"""Which kernels a run picks: one value per switch (--attention-backend, --swiglu-backend, --rmsnorm-backend,
--rope-backend, --cross-entropy-backend, --adamw-kernel), the one type every stage reads.

The settings parse into it (`KernelChoices.of`), training/kernel_settings.py resolves auto in it (`kernel_choices`:
what runs on the device, "-" where the model has no such layer) and checks it against the model, and
models.apply_kernels hands each layer its own value (`in_layers`); the optimizer reads `adamw`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

# The Triton switches: "auto"/"triton": the op's Triton kernels on CUDA (triton_check.kernels_on); "torch": the
# plain expression (compiled with the layer).
TRITON_SETTINGS = ("auto", "triton", "torch")
# --attention-backend: auto (kernel_settings resolves it: FA4 where installed and usable, else SDPA's own pick), fa4
# (FlashAttention 4 for causal attention and plain sliding windows, flex for other masks) or one forced SDPA kernel.
SDPA_KERNELS = ("cudnn", "flash", "efficient", "math")
ATTENTION_BACKENDS = ("auto", "fa4", *SDPA_KERNELS)
NOT_RUN = "-"  # resolved: the model has no such layer (a GELU MLP, LayerNorm), or tensor parallelism's own loss


@dataclass(frozen=True)
class KernelChoices:
    """attention: one of ATTENTION_BACKENDS; the others: auto, triton or torch (triton_check.kernels_on), or
    NOT_RUN once resolved."""

    attention: str = "auto"
    swiglu: str = "auto"
    rmsnorm: str = "auto"
    rope: str = "auto"
    cross_entropy: str = "auto"
    adamw: str = "auto"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            names = ", ".join(ATTENTION_BACKENDS)
            raise ValueError(f"unknown attention backend {self.attention!r}; use one of {names}")
        for f in fields(self)[1:]:
            if getattr(self, f.name) not in (*TRITON_SETTINGS, NOT_RUN):
                raise ValueError(f"unknown {f.name} backend {getattr(self, f.name)!r}; use auto, triton or torch")

    @classmethod
    def of(cls, train: Any, optim: Any) -> KernelChoices:
        """From the train and optim settings (config/settings.py's sections)."""
        return cls(
            train.attention_backend,
            train.swiglu_backend,
            train.rmsnorm_backend,
            train.rope_backend,
            train.cross_entropy_backend,
            optim.adamw_kernel,
        )

    def in_layers(self) -> KernelChoices:
        """What the layers are given: NOT_RUN (no such layer, or tensor parallelism's loss) back at auto."""
        return replace(self, **{f.name: "auto" for f in fields(self) if getattr(self, f.name) == NOT_RUN})
