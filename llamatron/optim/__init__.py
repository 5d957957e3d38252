"""Optimizers as plug-ins: each one a registered `OptimizerKind` (its `--optimizer` name, how it is built, the state
kinds it keeps, its bytes per parameter for the planner and its rules). The engine builds the one a run names; the
checkpoint writer and reader iterate the state kinds an optimizer declares (`SegmentOptimizer.state`), the planner
and bench read its bytes per parameter: nothing outside this package names an optimizer's state.

Adding one: a module here with a `SegmentOptimizer` subclass (base.py: segments, master weights, the gradient norm
and clipping are shared), one `OptimizerKind` in OPTIMIZERS, its name among `--optimizer`'s choices
(config/settings.py), and a test against its torch reference (CONTRIBUTING.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.fsdp import Buffer
from ..parallel.mesh import Mesh
from .adamw import MOMENTS, DistributedAdamW, adamw_state_bytes
from .base import Segment, SegmentOptimizer
from .loss_scale import DynamicLossScaler
from .muon import MOMENTUM, Muon, MuonSettings, hidden_matrices, muon_problems, muon_state_bytes
from .schedule import lr_at, lr_problems


@dataclass(frozen=True)
class BuildArgs:
    """What the engine gives an optimizer to build it: the run's optim settings, this rank's buffers and mesh."""

    optim: Any  # config/settings.py's OptimConfig
    buffers: list[Buffer]
    mesh: Mesh
    distributed: bool  # --distributed-optimizer or --fsdp: each replica updates its shard
    kernel: str  # the AdamW kernel resolved (training/kernel_settings.py)
    shard_group: dist.ProcessGroup | None
    hidden_matrices: frozenset[str]  # global names of the decoder layers' matrices (and experts)


@dataclass(frozen=True)
class OptimizerKind:
    name: str
    build: Callable[[BuildArgs], SegmentOptimizer]
    state_kinds: tuple[str, ...]  # the fp32 per-element state it may keep (checkpoint kinds)
    # fp32 state bytes per parameter before sharding, master weight included (dtype, the hidden matrices' share)
    state_bytes: Callable[[str, float], float]
    problems: Callable[[Any], list[str]]  # its rules on the optim settings


def _adamw_args(a: BuildArgs) -> dict[str, Any]:
    o = a.optim
    return {
        "buffers": a.buffers,
        "mesh": a.mesh,
        "lr": o.lr,
        "weight_decay": o.weight_decay,
        "betas": (o.adam_beta1, o.adam_beta2),
        "eps": o.adam_eps,
        "clip_grad": o.clip_grad,
        "distributed": a.distributed,
        "kernel": a.kernel,
        "shard_group": a.shard_group,
    }


def _build_adamw(a: BuildArgs) -> SegmentOptimizer:
    return DistributedAdamW(**_adamw_args(a))


def _build_muon(a: BuildArgs) -> SegmentOptimizer:
    o = a.optim
    adamw_lr = o.lr if o.muon_adamw_lr is None else o.muon_adamw_lr
    settings = MuonSettings(
        momentum=o.muon_momentum,
        nesterov=o.muon_nesterov,
        ns_steps=o.muon_ns_steps,
        ns_coefficients=tuple(o.muon_ns_coefficients),
        adjust_lr=o.muon_adjust_lr,
        adamw_lr_ratio=adamw_lr / o.lr if o.lr > 0 else 1.0,
        ns_dtype=torch.float32 if o.muon_ns_dtype == "fp32" else torch.bfloat16,
    )
    return Muon(_adamw_args(a), settings, a.hidden_matrices)


def _no_problems(optim: Any) -> list[str]:
    return []


ADAMW = OptimizerKind("adamw", _build_adamw, MOMENTS, lambda dtype, share: adamw_state_bytes(dtype), _no_problems)
MUON = OptimizerKind("muon", _build_muon, (*MOMENTS, MOMENTUM), muon_state_bytes, muon_problems)
OPTIMIZERS: dict[str, OptimizerKind] = {k.name: k for k in (ADAMW, MUON)}


def optimizer_kind(name: str) -> OptimizerKind:
    return OPTIMIZERS[name]


def bytes_per_param(
    dtype: str, distributed_optimizer: bool, replicas: int, optimizer: str = "adamw", matrix_share: float = 0.0
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter held, as the optimizer allocates them (replicas:
    dp x cp, over which the distributed optimizer shards; matrix_share: the part of the parameters that are hidden
    matrices, for an optimizer that keeps other state for them)."""
    shards = replicas if distributed_optimizer else 1
    state = OPTIMIZERS[optimizer].state_bytes(dtype, matrix_share)
    return (4.0 if dtype == "fp32" else 2.0), 4.0, state / shards


def optimizer_problems(optim: Any) -> list[str]:
    """The run's --optimizer settings that cannot work, from its optimizer's rules, and the learning rates'."""
    return lr_problems(optim.lr, optim.min_lr) + OPTIMIZERS[optim.optimizer].problems(optim)


__all__ = [
    "OPTIMIZERS",
    "BuildArgs",
    "DynamicLossScaler",
    "OptimizerKind",
    "Segment",
    "SegmentOptimizer",
    "bytes_per_param",
    "hidden_matrices",
    "lr_at",
    "lr_problems",
    "optimizer_kind",
    "optimizer_problems",
]
