"""Layout-independent initialisation.

Every parameter is drawn from its own generator, seeded by the run seed and
the parameter's global name, over its *full* shape; a sharded parameter then
keeps only its slice. So a tp=2 or pp=4 model starts from exactly the weights
of the single-device model, and no rank ever holds more than one full tensor.
Global names, full shapes and slices come from the parameter specs that
parallelism builds (parallel/param_spec.py).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from .config import ModelConfig


class ParamSpec(Protocol):
    """What initialisation reads of a parameter's spec (parallel/param_spec.py's ParamSpec: the model code does
    not depend on parallel/)."""

    @property
    def global_name(self) -> str: ...

    @property
    def full_shape(self) -> tuple[int, ...]: ...

    def shard(self, full: torch.Tensor) -> torch.Tensor: ...


# Output projections of each residual branch get std / sqrt(2 * layers) (GPT-2 / Megatron scaled init).
_RESIDUAL_OUTPUTS = ("attn.o.weight", "mlp.down.weight", "mlp.experts.down")


def init_full_tensor(name: str, shape: torch.Size, cfg: ModelConfig, seed: int, device: torch.device) -> torch.Tensor:
    """The fp32 initial value of the full parameter called `name`."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "lora_b":  # LoRA starts as no change (adapters/lora.py)
        return torch.zeros(shape, device=device)
    if leaf == "lora_a":  # as PEFT: nn.Linear's default, Kaiming uniform with a = sqrt(5): U(+-1/sqrt(in))
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape, device=device).uniform_(-bound, bound, generator=_generator(name, seed, device))
    if "norm" in name:
        return torch.ones(shape, device=device) if leaf == "weight" else torch.zeros(shape, device=device)
    if leaf in ("bias", "expert_bias"):  # expert_bias: a MoE's balancing bias starts neutral (models/moe_balance.py)
        return torch.zeros(shape, device=device)
    std = cfg.init_std
    if name.endswith(_RESIDUAL_OUTPUTS):
        std = std / math.sqrt(2.0 * cfg.num_layers)
    return torch.empty(shape, device=device).normal_(0.0, std, generator=_generator(name, seed, device))


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return gen


def to_empty(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Module.to_empty(device=...) without torch's Python reference of empty_like, which meta tensors dispatch to
    and whose first call imports sympy (0.35 s of CPU in every process that builds a model, a third of a test
    rank's work after imports). Strides kept, as empty_like keeps them."""
    return module._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))


def materialize(
    model: nn.Module,
    cfg: ModelConfig,
    seed: int,
    device: torch.device | str,
    dtype: torch.dtype,
    specs: Mapping[str, ParamSpec] | None = None,
) -> nn.Module:
    """Give every meta parameter of `model` its initial value on `device`.

    `specs` (parallel/param_spec.py), by local parameter name: each parameter is initialised over its spec's
    full shape under its global name, then sharded. Without specs every name is global and every shape full.
    """
    device = torch.device(device)
    model.to(dtype=dtype)  # still on meta: free
    to_empty(model, device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if specs is None:
                param.copy_(init_full_tensor(name, param.shape, cfg, seed, device).to(dtype))
                continue
            spec = specs[name]
            full = init_full_tensor(spec.global_name, torch.Size(spec.full_shape), cfg, seed, device)
            param.copy_(spec.shard(full).to(dtype))
    for name, param in model.named_parameters():
        if name.endswith("expert_bias"):  # moved by 1e-3 steps, which bf16 would lose: fp32 at any precision
            param.data = param.data.float()
    return model
