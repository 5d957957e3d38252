"""Which kernels a model runs (--attention-backend, --swiglu-backend, --rmsnorm-backend, --rope-backend,
--cross-entropy-backend), chosen per model.

`apply_kernels` gives each layer instance its own choice, which its forward reads: nothing is process-wide, so
two models in one process, and their compiled graphs, each run their own. A model built without it runs auto
everywhere: Triton kernels on CUDA when Triton is installed, torch elsewhere, SDPA's own pick of kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import nn

from ..kernels.triton_check import TRITON_SETTINGS
from .attention import ATTENTION_BACKENDS
from .blocks import SwiGLU
from .layers import Attention, RMSNorm
from .moe import Experts, SharedExpert


@dataclass(frozen=True)
class KernelChoices:
    """attention: one of ATTENTION_BACKENDS; the others: auto, triton or torch (triton_check.kernels_on)."""

    attention: str = "auto"
    swiglu: str = "auto"
    rmsnorm: str = "auto"
    rope: str = "auto"
    cross_entropy: str = "auto"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            names = ", ".join(ATTENTION_BACKENDS)
            raise ValueError(f"unknown attention backend {self.attention!r}; use one of {names}")
        for name in ("swiglu", "rmsnorm", "rope", "cross_entropy"):
            if getattr(self, name) not in TRITON_SETTINGS:
                raise ValueError(f"unknown {name} backend {getattr(self, name)!r}; use auto, triton or torch")

    @classmethod
    def from_resolved(cls, resolved: dict[str, str]) -> KernelChoices:
        """From training/kernel_settings.py's kernel_choices dict: "-" (the model has no such layer, or tensor
        parallelism's own loss) leaves the default; its other keys (adamw) are not the model's."""
        return cls(**{f.name: resolved[f.name] for f in fields(cls) if resolved[f.name] != "-"})


def apply_kernels(model: nn.Module, choices: KernelChoices) -> None:
    """Set the choice of every layer in `model` (a Transformer, a pipeline chunk or one block). The loss's
    (`cross_entropy`) is the objective's to read (objectives/language_model.py)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.backend = choices.rmsnorm
        elif isinstance(module, Attention):
            module.backend, module.rope_backend = choices.attention, choices.rope
        elif isinstance(module, SwiGLU):
            module.backend = choices.swiglu
        elif isinstance(module, (Experts, SharedExpert)):
            module.swiglu_backend = choices.swiglu
