"""Which linears LoRA adapts, and how each maps onto Hugging Face's (and so PEFT's) modules.

A target is a linear of the decoder layers named by its Hugging Face module (`q_proj`, `query_key_value`, ...) or
that name without `_proj` (`q`, `gate`); `all-linear` is every one. The family's weight rules say which Hugging
Face tensors each llamatron linear is made of and how its rows split back into them: an adapted linear gets one
adapter per matching Hugging Face module, over exactly that module's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from ..interop.hf import TensorRule, config_to_hf, weight_rules
from ..models import ModelConfig, build_model
from ..parallel.param_spec import ParamSpec, ParamSpecs
from ..parallel.tensor_layers import ColumnParallelLinear, RowParallelLinear
from .lora import LoraLinear, adapt_parallel

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraTarget:
    module: str  # the llamatron linear, e.g. layers.0.attn.qkv
    hf_modules: tuple[str, ...]  # one per adapter (segment), e.g. model.layers.0.self_attn.q_proj
    rows: tuple[torch.Tensor, ...]  # each adapter's output rows of the linear, in the Hugging Face tensor's order
    shape: tuple[int, int]  # the linear's weight: (out, in)


def _matches(hf_module: str, targets: Sequence[str]) -> bool:
    base = hf_module.rsplit(".", 1)[-1]
    return ALL_LINEAR in targets or base in targets or base.removesuffix("_proj") in targets


def _layer_linears(model: nn.Module, cfg: ModelConfig) -> list[tuple[str, nn.Linear, TensorRule]]:
    modules = dict(model.named_modules())
    out = []
    for rule in weight_rules(cfg, config_to_hf(cfg)):
        name = rule.name.removesuffix(".weight")
        if rule.name.endswith(".weight") and name.startswith("layers.") and type(modules.get(name)) is nn.Linear:
            out.append((name, modules[name], rule))
    return out


def find_targets(model: nn.Module, cfg: ModelConfig, targets: Sequence[str], strict: bool = True) -> list[LoraTarget]:
    """The adapted linears of `model` (built for `cfg`, not yet adapted); a target naming no linear is an error
    unless not `strict` (a pipeline stage: the whole model's targets were checked, a stage may hold few layers)."""
    found, available = [], set()
    for name, linear, rule in _layer_linears(model, cfg):
        index = torch.arange(linear.out_features, dtype=torch.float64).unsqueeze(1)
        # the Hugging Face weights it splits into (not a tensor exported beside them: DeepSeek-V3's zero
        # balancing bias beside the router's weight, for a model trained without one)
        split = [
            (h.removesuffix(".weight"), t) for h, t in zip(rule.hf_names, rule.split(index)) if h.endswith(".weight")
        ]
        available |= {h.rsplit(".", 1)[-1] for h, _ in split}
        keep = [(h, t.flatten().long()) for h, t in split if _matches(h, targets)]
        if keep:
            shape = (linear.out_features, linear.in_features)
            found.append(LoraTarget(name, tuple(h for h, _ in keep), tuple(r for _, r in keep), shape))
    known = available | {a.removesuffix("_proj") for a in available} | {ALL_LINEAR}
    unknown = [t for t in targets if t not in known]
    if strict and (unknown or not found):
        raise ConfigError(
            f"--lora-targets {','.join(unknown or targets)} names no linear of this {cfg.family} model's layers; "
            f"use all-linear or some of {','.join(sorted(available))}"
        )
    return found


def apply_lora(model: nn.Module, targets: list[LoraTarget], rank: int, alpha: float, dropout: float) -> None:
    """Adapt each target linear (a plain one becomes a LoraLinear over the same weight; a tensor-parallel one
    gets its shard of the adapters inside its matmul) and freeze everything but the adapters."""
    for p in model.parameters():
        p.requires_grad_(False)
    for t in targets:
        segment = torch.full((t.shape[0],), -1, dtype=torch.long)
        for s, rows in enumerate(t.rows):
            segment[rows] = s
        parent_name, _, child = t.module.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
            adapt_parallel(linear, segment, rank, alpha, dropout)
        else:
            setattr(parent, child, LoraLinear(linear, segment, rank, alpha, dropout))


def adapter_specs(model: nn.Module, specs: ParamSpecs) -> ParamSpecs:
    """`specs` with the adapters' added: each adapter split like its tensor-parallel linear (column: B's rows with
    the weight's, A whole with a partial gradient; row: A's columns with the weight's inputs, B whole with a
    partial gradient), or whole (with a partial gradient where the linear's weight has one: a replicated linear
    under sequence parallelism)."""
    out = dict(specs)
    for prefix, m in model.named_modules():
        if not isinstance(getattr(m, "lora_a", None), nn.Parameter):
            continue
        a, b = f"{prefix}.lora_a", f"{prefix}.lora_b"
        a_shape, b_shape = tuple(m.get_parameter("lora_a").shape), tuple(m.get_parameter("lora_b").shape)
        if isinstance(m, ColumnParallelLinear):
            out[a] = ParamSpec(a, a_shape, partial_grad=True)
            b_full = (m.layout.full_size, b_shape[1])
            out[b] = ParamSpec(b, b_full).sharded(m.layout, b_full)
        elif isinstance(m, RowParallelLinear):
            a_full = (a_shape[0], m.layout.full_size)
            out[a] = ParamSpec(a, a_full).sharded(m.layout, a_full)
            out[b] = ParamSpec(b, b_shape, partial_grad=True)
        else:  # a replicated linear: on a sequence shard under sp, its adapters' gradients are partial as its weight's
            partial = out[f"{prefix}.weight"].partial_grad
            out[a], out[b] = ParamSpec(a, a_shape, partial_grad=partial), ParamSpec(b, b_shape, partial_grad=partial)
    return out


def requested(targets: Sequence[str]) -> list[str]:
    """--lora-targets as given: space- or comma-separated."""
    return [t for item in targets for t in item.split(",") if t]


def adapter_shapes(model: ModelConfig, rank: int, targets: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The full shapes of the adapters LoRA adds to `model` (none with rank 0), from a model on the meta device."""
    if rank == 0:
        return {}
    built = build_model(model, device="meta")
    plain = {n for n, _ in built.named_parameters()}
    apply_lora(built, find_targets(built, model, requested(targets)), rank, 1.0, 0.0)
    return {n: tuple(p.shape) for n, p in built.named_parameters() if n not in plain}
