"""Which kernels a model runs (--attention-backend, --swiglu-backend, --rmsnorm-backend, --rope-backend,
--cross-entropy-backend), chosen per model: kernels/choices.py's KernelChoices, given to each layer.

`apply_kernels` gives each layer instance its own choice, which its forward reads: nothing is process-wide, so
two models in one process, and their compiled graphs, each run their own. A model built without it runs auto
everywhere: Triton kernels on CUDA when Triton is installed, torch elsewhere, SDPA's own pick of kernel.
"""

from __future__ import annotations

from torch import nn

from ..kernels.choices import KernelChoices
from .blocks import SwiGLU
from .layers import Attention, RMSNorm
from .moe import Experts, SharedExpert


def apply_kernels(model: nn.Module, choices: KernelChoices) -> None:
    """Set the choice of every layer in `model` (a Transformer, a pipeline chunk or one block). The loss's
    (`cross_entropy`) is the objective's to read (objectives/language_model.py), `adamw` the optimizer's. Resolved
    choices come here through `KernelChoices.in_layers`."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.backend = choices.rmsnorm
        elif isinstance(module, Attention):
            module.backend, module.rope_backend = choices.attention, choices.rope
        elif isinstance(module, SwiGLU):
            module.backend = choices.swiglu
        elif isinstance(module, (Experts, SharedExpert)):
            module.swiglu_backend = choices.swiglu


__all__ = ["KernelChoices", "apply_kernels"]
