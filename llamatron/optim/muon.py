"""Muon (momentum orthogonalised by a Newton-Schulz iteration) on the decoder layers' hidden matrices, AdamW on the
rest (embeddings, the output head, norms, biases, routers), as torch.optim.Muon and the published recipes split them.

Per hidden matrix W with gradient G (clipped and unscaled as AdamW's), as torch.optim.Muon computes it:
  B <- mu B + (1 - mu) G;   U = (1 - mu) G + mu B  (Nesterov; else U = B)
  O = NS_k(U): U / ||U||_F, then k steps of X <- a X + (b A + c A^2) X with A = X X^T, in bf16 (on U^T when tall)
  W <- W (1 - lr wd) - lr' O;   lr' = lr 0.2 sqrt(max(A, B)) (match_rms_adamw, Moonlight's) or lr sqrt(max(1, A/B))
A MoE's stacked experts are orthogonalised one expert at a time.

Whole matrices on every layout: the momentum is elementwise, kept in the same flat segments as AdamW's moments (so
checkpoints store and reshard it as theirs). When a buffer is sharded (--distributed-optimizer, --fsdp: each rank
updates a flat range across rows), each matrix is owned by one rank of the shard group (balanced by elements):
the ranks' segments of U are summed onto it, it runs NS, and broadcasts O back; the sums and broadcasts are
asynchronous, so one matrix's travel overlaps another's NS. Under tensor parallelism the owner's tp ranks gather
U over tp and NS the whole matrix (each shard alone would be another optimizer). Unsharded, every rank runs NS
on its own matrices (tp: the whole, gathered, each keeping its part). The cost is `plan`'s (planning/).
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
    owner: int | None = None  # the global rank that orthogonalises it (a sharded buffer); None: every rank its own


# Matrices whose updates are in flight at once (their summed updates and orthogonalised results live together):
# enough to overlap one matrix's communication with another's Newton-Schulz, bounded in memory.
WINDOW_ELEMENTS = 1 << 26


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


def is_hidden_matrix(kind: str, shape: tuple[int, ...]) -> bool:
    """Whether a weight of this kind (models/inventory.weight_kind) and full shape is Muon's: a MoE's experts, or a
    linear's weight with both sides above 1 (a 1-row matrix, a shared expert's gate, is a vector: Newton-Schulz
    would only normalise it)."""
    return kind == "expert" or (kind == "matmul" and len(shape) == 2 and min(shape) > 1)


def hidden_matrices(chunks: Sequence[nn.Module], specs: Sequence[ParamSpecs]) -> frozenset[str]:
    """Global names of the decoder layers' matrices (linears' weights, a MoE's experts) that train: Muon's."""
    out = set()
    for chunk, chunk_specs in zip(chunks, specs):
        for prefix, layer in chunk.get_submodule("layers").named_children():
            modules = dict(layer.named_modules())
            for name, p in layer.named_parameters():
                owner, _, leaf = name.rpartition(".")
                kind = weight_kind(modules[owner], leaf, owner)
                spec = chunk_specs[f"layers.{prefix}.{name}"]
                shape = spec.full_shape  # not the shard's: every layout picks the same matrices
                if p.requires_grad and is_hidden_matrix(kind, tuple(shape)):
                    out.add(spec.global_name)
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
        _assign_owners(self.matrices)
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
            window: list[_Matrix] = []
            for m in self.matrices:
                window.append(m)
                if sum(math.prod(w.spec.local_shape) for w in window) >= WINDOW_ELEMENTS:
                    self._update(window, grads, lr, grad_scale)
                    window = []
            self._update(window, grads, lr, grad_scale)
            if self.muon_segments:
                torch._foreach_add_([self.steps[i] for i in self.muon_segments], 1.0)
            self.write_back(self.muon_segments)
        return norm, found_inf

    def _update(self, window: list[_Matrix], grads: list[torch.Tensor], lr: float, scale: torch.Tensor | None) -> None:
        """Muon on these matrices: every momentum step and update sum started, then each owner's Newton-Schulz as
        its sum arrives, its result sent back to the group while the next is computed, then the weights."""
        started = [self._whole_update(m, grads, scale) for m in window]
        results = [self._orthogonalise(m, whole, work) for m, (whole, work) in zip(window, started)]
        for m, (ortho, work) in zip(window, results):
            if work is not None:
                work.wait()
            if m.segment is None:
                continue
            seg, master = self.segments[m.segment], self.master[m.segment]
            flat = ortho.reshape(-1)[seg.param_offset : seg.param_offset + master.numel()]
            master.mul_(1 - lr * self.weight_decay)
            master.add_(flat, alpha=-adjusted_lr(lr, self.muon.adjust_lr, m.spec.full_shape))

    def _whole_update(self, m: _Matrix, grads: list[torch.Tensor], grad_scale: torch.Tensor | None) -> tuple:
        """The momentum step on this rank's segment, and the update U of the whole local (tp) matrix, flat: summed
        onto its owner (async: the work to wait for) when the buffer is sharded."""
        s = self.muon
        part = None
        if m.segment is not None:
            g = grads[m.segment] if grad_scale is None else grads[m.segment] / grad_scale
            buf = self.momentum[m.segment]
            buf.lerp_(g, 1 - s.momentum)
            part = g.lerp(buf, s.momentum) if s.nesterov else buf.clone()
        if m.owner is None:
            assert part is not None  # an unsharded buffer's segments are whole parameters
            return part, None
        # Each rank adds its segment into a zero tensor, summed on the owner.
        whole = torch.zeros(math.prod(m.spec.local_shape), device=self.device)
        if part is not None:
            offset = self.segments[m.segment].param_offset  # type: ignore[index]
            whole[offset : offset + part.numel()] = part
        return whole, dist.reduce(whole, dst=m.owner, group=m.buffer.dp_group, async_op=True)

    def _orthogonalise(self, m: _Matrix, whole: torch.Tensor, work) -> tuple:
        """The orthogonalised update in the local shape, on the owner (or every rank where there is none), and the
        broadcast that brings it to the group's other ranks (async: the work to wait for)."""
        if work is not None:
            work.wait()
        if m.owner is None:
            return self._orthogonalised(m.spec, whole), None
        if m.owner == dist.get_rank():
            ortho = self._orthogonalised(m.spec, whole).contiguous()
        else:
            ortho = torch.empty(m.spec.local_shape, dtype=self.muon.ns_dtype, device=self.device)
        return ortho, dist.broadcast(ortho, src=m.owner, group=m.buffer.dp_group, async_op=True)

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


def _assign_owners(matrices: list[_Matrix]) -> None:
    """Each matrix of a sharded buffer to one rank of its data-parallel group, the least loaded so far (by
    elements): the same on every rank, which see the same matrices in the same order."""
    loads: dict[int, list[int]] = {}
    for m in matrices:
        if not _sharded(m.buffer):
            continue
        group = m.buffer.dp_group
        assert group is not None  # sharded: dp > 1
        load = loads.setdefault(id(group), [0] * m.buffer.dp)
        r = load.index(min(load))
        load[r] += math.prod(m.spec.local_shape)
        m.owner = dist.get_global_rank(group, r)


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
