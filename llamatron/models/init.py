"""Layout-independent initialisation.

Every parameter is drawn from its own generator, seeded by the run seed and
the parameter's global name, over its *full* shape; a sharded parameter then
keeps only its slice. So a tp=2 or pp=4 model starts from exactly the weights
of the single-device model, and no rank ever holds more than one full tensor.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

import torch
from torch import nn

from .config import ModelConfig

# Output projections of each residual branch get std / sqrt(2 * layers) (GPT-2 / Megatron scaled init).
_RESIDUAL_OUTPUTS = ("attn.o.weight", "mlp.down.weight")


def init_full_tensor(name: str, shape: torch.Size, cfg: ModelConfig, seed: int, device: torch.device) -> torch.Tensor:
    """The fp32 initial value of the full parameter called `name`."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name:
        return torch.ones(shape, device=device) if leaf == "weight" else torch.zeros(shape, device=device)
    if leaf == "bias":
        return torch.zeros(shape, device=device)
    std = cfg.init_std
    if name.endswith(_RESIDUAL_OUTPUTS):
        std = std / math.sqrt(2.0 * cfg.num_layers)
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)


def materialize(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device | str, dtype: torch.dtype,
                global_name: Callable[[str], str] = lambda n: n) -> nn.Module:
    """Give every meta parameter of `model` its initial value on `device`.

    A parameter carrying `full_shape` and `shard_fn` (set by tensor parallelism)
    is initialised over the full shape and then sliced. `global_name` maps a
    local parameter name to its name in the unsplit model (pipeline stages
    renumber layers).
    """
    device = torch.device(device)
    # to_empty replaces meta parameters by new objects: carry their attributes (tensor-parallel metadata) over.
    attributes = {name: dict(p.__dict__) for name, p in model.named_parameters()}
    model.to(dtype=dtype)  # still on meta: free
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        param.__dict__.update(attributes[name])
    with torch.no_grad():
        for name, param in model.named_parameters():
            full_shape = getattr(param, "full_shape", param.shape)
            full = init_full_tensor(global_name(name), full_shape, cfg, seed, device)
            shard_fn = getattr(param, "shard_fn", None)
            param.copy_((shard_fn(full) if shard_fn is not None else full).to(dtype))
    return model
