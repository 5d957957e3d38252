"""Muon (momentum orthogonalised by a Newton-Schulz iteration) on the decoder layers' hidden matrices, AdamW on the
rest (embeddings, the output head, norms, biases, routers), as torch.optim.Muon and the published recipes split them.

Per hidden matrix W with gradient G (clipped and unscaled as AdamW's), as torch.optim.Muon computes it:
  B <- mu B + (1 - mu) G;   U = (1 - mu) G + mu B  (Nesterov; else U = B)
  O = NS_k(U): U / ||U||_F, then k steps of X <- a X + (b A + c A^2) X with A = X X^T, in bf16 (on U^T when tall)
  W <- W (1 - lr wd) - lr' O;   lr' = lr 0.2 sqrt(max(A, B)) (match_rms_adamw, Moonlight's) or lr sqrt(max(1, A/B))
A MoE's stacked experts are orthogonalised one expert at a time.

Whole matrices on every layout: the momentum is elementwise, kept in the same flat segments as AdamW's moments (so
checkpoints store and reshard it as theirs); U is made whole before NS: summed over the data-parallel shard group
when the buffer is sharded (--distributed-optimizer, --fsdp), gathered over tensor parallelism when the matrix is
split; every rank then runs NS on the whole matrix and keeps its own part of O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..models.inventory import weight_kind
from ..parallel.fsdp import Buffer
from ..parallel.param_spec import ParamSpec, ParamSpecs
from .adamw import DistributedAdamW

MOMENTUM = "momentum_buffer"  # its state kind, as torch.optim.Muon names it
ADJUST_LR = ("match_rms_adamw", "original")
NS_EPS = 1e-7  # torch.optim.Muon's


@dataclass(frozen=True)
class MuonSettings:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    adjust_lr: str = "match_rms_adamw"
    adamw_lr_ratio: float = 1.0  # the AdamW part's learning rate over Muon's (the schedule scales both)
    # torch.optim.Muon's bf16; fp32 for a layout's check against one process, where bf16 rounds a last-bit
    # difference in the summation order into a visible one
    ns_dtype: torch.dtype = torch.bfloat16


@dataclass
class _Matrix:
    """A hidden matrix of one buffer, on every rank of its group (the segment: this rank's part, if any)."""

    spec: ParamSpec
    buffer: Buffer
    segment: int | None


def newton_schulz(
    x: torch.Tensor, coefficients: tuple[float, float, float], steps: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards the nearest semi-orthogonal matrix (in bf16: torch.optim.Muon's)."""
    a, b, c = coefficients
    out = x.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        out = out.T
    out = out / out.norm().clamp(min=NS_EPS)  # spectral norm at most 1
    for _ in range(steps):
        gram = out @ out.T
        out = torch.addmm(out, torch.addmm(gram, gram, gram, beta=b, alpha=c), out, beta=a)
    return out.T if tall else out


def adjusted_lr(lr: float, how: str, shape: tuple[int, ...]) -> float:
    """The learning rate of a matrix of `shape` (rows, cols): the update's RMS made AdamW's (match_rms_adamw), or
    Keller Jordan's original sqrt(max(1, rows/cols))."""
    rows, cols = shape[-2:]
    return lr * (0.2 * math.sqrt(max(rows, cols)) if how == "match_rms_adamw" else math.sqrt(max(1, rows / cols)))


def hidden_matrices(chunks: Sequence[nn.Module], specs: Sequence[ParamSpecs]) -> frozenset[str]:
    """Global names of the decoder layers' matrices (linears' weights, a MoE's experts) that train: Muon's."""
    out = set()
    for chunk, chunk_specs in zip(chunks, specs):
        for prefix, layer in chunk.get_submodule("layers").named_children():
            modules = dict(layer.named_modules())
            for name, p in layer.named_parameters():
                owner, _, leaf = name.rpartition(".")
                kind = weight_kind(modules[owner], leaf, owner)
                # a 1-row matrix (a shared expert's gate) is a vector: NS would only normalise it
                if p.requires_grad and (kind == "expert" or (kind == "matmul" and p.ndim == 2 and min(p.shape) > 1)):
                    out.add(chunk_specs[f"layers.{prefix}.{name}"].global_name)
    return frozenset(out)


class Muon(DistributedAdamW):
    def __init__(self, adamw: dict[str, Any], settings: MuonSettings, hidden: frozenset[str]):
        """adamw: DistributedAdamW's arguments (the AdamW part's); hidden: the matrices Muon updates."""
        self.hidden, self.muon = hidden, settings
        super().__init__(**adamw)
        owned = {id(seg.param): i for i, seg in enumerate(self.segments)}
        self.matrices = [
            _Matrix(spec, buf, owned.get(id(p)))
            for buf in self.buffers
            for p, spec in buf.spec_of.items()
            if spec.global_name in hidden
        ]
        self.muon_segments = [m.segment for m in self.matrices if m.segment is not None]
        self.momentum = self._zeros(set(self.muon_segments))

    def _adamw_indices(self) -> list[int]:
        return [i for i, seg in enumerate(self.segments) if seg.spec.global_name not in self.hidden]

    def state(self, i: int) -> dict[str, torch.Tensor]:
        return {MOMENTUM: self.momentum[i]} if self.segments[i].spec.global_name in self.hidden else super().state(i)

    @torch.no_grad()
    def step(self, lr: float, loss_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        norm, found_inf, grad_scale = self.norm_and_scale(loss_scale)
        grads = self.grads()
        self.adamw_step(self.adamw_segments, grads, lr * self.muon.adamw_lr_ratio, grad_scale, found_inf)
        # A skipped step leaves the matrices as they are; Muon's collectives need every rank to agree, as the
        # norm (all-reduced) makes them: one host sync.
        if self.matrices and not bool(found_inf.item()):
            for m in self.matrices:
                self._update(m, grads, lr, grad_scale)
            if self.muon_segments:
                torch._foreach_add_([self.steps[i] for i in self.muon_segments], 1.0)
            self.write_back(self.muon_segments)
        return norm, found_inf

    def _update(self, m: _Matrix, grads: list[torch.Tensor], lr: float, grad_scale: torch.Tensor | None) -> None:
        update = self._whole_update(m, grads, grad_scale)
        ortho = self._orthogonalised(m.spec, update).reshape(-1)
        if m.segment is None:
            return
        seg, master = self.segments[m.segment], self.master[m.segment]
        master.mul_(1 - lr * self.weight_decay)
        master.add_(ortho[seg.param_offset : seg.param_offset + master.numel()], alpha=-self._lr(lr, m.spec))

    def _lr(self, lr: float, spec: ParamSpec) -> float:
        return adjusted_lr(lr, self.muon.adjust_lr, spec.full_shape)

    def _whole_update(self, m: _Matrix, grads: list[torch.Tensor], grad_scale: torch.Tensor | None) -> torch.Tensor:
        """The momentum step on this rank's segment, and the update U of the whole local (tp) matrix, flat."""
        s = self.muon
        part = None
        if m.segment is not None:
            g = grads[m.segment] if grad_scale is None else grads[m.segment] / grad_scale
            buf = self.momentum[m.segment]
            buf.lerp_(g, 1 - s.momentum)
            part = g.lerp(buf, s.momentum) if s.nesterov else buf.clone()
        if not _sharded(m.buffer):
            assert part is not None  # an unsharded buffer's segments are whole parameters
            return part
        numel = math.prod(m.spec.local_shape)
        # The buffer is sharded over its data-parallel group: each rank adds its segment into a zero tensor.
        whole = torch.zeros(numel, device=self.device)
        if part is not None:
            offset = self.segments[m.segment].param_offset  # type: ignore[index]
            whole[offset : offset + part.numel()] = part
        dist.all_reduce(whole, group=m.buffer.dp_group)
        return whole

    def _orthogonalised(self, spec: ParamSpec, flat: torch.Tensor) -> torch.Tensor:
        """NS of the whole matrix (gathered over tensor parallelism), this rank's part of it in the local shape."""
        local = flat.view(spec.local_shape)
        layout = spec.tp_layout
        full = local if layout is None else layout.gather(local)
        s = self.muon
        if full.ndim == 3:  # stacked experts: each its own matrix
            out = torch.stack([newton_schulz(e, s.ns_coefficients, s.ns_steps, s.ns_dtype) for e in full])
        else:
            out = newton_schulz(full, s.ns_coefficients, s.ns_steps, s.ns_dtype)
        return out if layout is None else layout.shard(out)


def _sharded(buf: Buffer) -> bool:
    """Whether each rank of the buffer's data-parallel group updates only its shard (decided for the whole group:
    a parameter may lie in one rank's shard whole, and every rank must still join the sum)."""
    bucket = buf.buckets[0]
    return buf.dp > 1 and buf.shard_range(bucket, 0) != (bucket.start, bucket.end)


def muon_problems(optim: Any) -> list[str]:
    """Muon's settings that cannot work (each number's range is declared on its flag)."""
    if len(optim.muon_ns_coefficients) != 3:
        return [
            f"--muon-ns-coefficients takes three numbers (a b c of the quintic iteration), "
            f"got {len(optim.muon_ns_coefficients)}"
        ]
    return []


def muon_state_bytes(dtype: str, matrix_share: float) -> float:
    """fp32 state per parameter: a momentum for the hidden matrices, AdamW's two moments for the rest, and the
    master weight unless the weights are fp32."""
    return (0.0 if dtype == "fp32" else 4.0) + 4.0 * matrix_share + 8.0 * (1.0 - matrix_share)
