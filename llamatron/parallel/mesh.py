"""Process groups and rank coordinates for tensor x context x data x pipeline parallelism.

Rank order (fastest-varying first): tensor, context, data, pipeline.

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

so the ranks of one tensor-parallel group are adjacent and stay inside a node
(tp <= GPUs per node), context-parallel peers (a K/V all-gather every layer)
come next, data-parallel peers after them, and pipeline stages are farthest
apart (their point-to-point traffic is the lightest).

The ranks that hold the same weights are the dp x cp "replicas": context
parallelism splits each sequence, not the weights, so gradients are reduced,
and the distributed optimizer shards, over all of them (`replica_group`).
Data loading follows `dp` alone: the cp ranks of one data-parallel slot read
the same samples and each keeps its part of every sequence.

Expert parallelism (`ep`, parallel/expert.py) is carved out of the data-parallel
ranks: dp rank d holds experts group d % ep, so ep adjacent dp ranks (an
`ep_group`) together hold every expert and exchange tokens all-to-all. Dense
weights stay replicated over all dp x cp ranks; an expert's weights over the
(dp / ep) x cp ranks holding the same experts (`expert_replica_group`), where
its gradients are reduced and its optimizer state sharded.

Expert tensor parallelism 1 (`etp` 1, Megatron-core's "MoE parallel folding") keeps every expert whole under
tp > 1: the tp ranks act as more expert-parallel ranks, so the all-to-all (`expert_group`) spans the ep x tp
ranks of one ep_group's dp ranks, expert rank (d % ep) * tp + t; the experts' replicas are unchanged (they share
t and d % ep), and ep_group stays the dp part (the grad norm sums the experts over it, the tp part over mp_group).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .layout import LayoutChoice, ParallelLayout


@dataclass
class Mesh:
    """A rank's place in its layout: the layout (every size), the rank's coordinates and its process groups."""

    layout: ParallelLayout = field(default_factory=ParallelLayout)
    rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    replica_group: dist.ProcessGroup | None = None  # dp x cp: the ranks holding the same weights
    mp_group: dist.ProcessGroup | None = None  # tp x pp: one model replica
    ep_group: dist.ProcessGroup | None = None  # the ep dp ranks that together hold every expert (with their tp peers)
    expert_group: dist.ProcessGroup | None = None  # the all-to-all's: ep_group, or under etp 1 its ep x tp ranks
    expert_replica_group: dist.ProcessGroup | None = None  # (dp / ep) x cp: the ranks holding the same experts
    # Hybrid sharding (--fsdp-shard-group N, layout.hybrid_shards): the replica group cut into groups of N
    # consecutive replicas, which shard the weights among them, and the ranks holding the same shard in each, which
    # all-reduce its gradient.
    fsdp_shard_group: dist.ProcessGroup | None = None
    fsdp_replicate_group: dist.ProcessGroup | None = None
    pp_ranks: list[int] = field(default_factory=lambda: [0])  # global ranks of my pipeline, by stage
    tp_ranks: list[int] = field(default_factory=lambda: [0])
    dp_ranks: list[int] = field(default_factory=lambda: [0])

    @property
    def replica_rank(self) -> int:
        return self.dp_rank * self.layout.cp + self.cp_rank

    @property
    def ep_rank(self) -> int:
        """Which experts this rank holds: the ep_rank-th num_experts / ep of every MoE layer."""
        return self.dp_rank % self.layout.ep

    @property
    def expert_rank(self) -> int:
        """Which expert_parallel-th of every MoE layer's experts this rank holds (its rank in expert_group)."""
        return self.ep_rank * self.layout.tp + self.tp_rank if self.layout.experts_fold_tp else self.ep_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The rank that writes metrics: last pipeline stage (it has the loss), first tp and dp rank."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        lay = self.layout
        return ((pp_rank * lay.dp + dp_rank) * lay.cp + cp_rank) * lay.tp + tp_rank


def coordinates(rank: int, tp: int, dp: int, cp: int = 1) -> tuple[int, int, int, int]:
    """(tp_rank, dp_rank, pp_rank, cp_rank) of a global rank."""
    return rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp), (rank // tp) % cp


def comm_problems(dp_comm_max_ctas: int | None, device: str) -> list[str]:
    """The communication settings against the device (--dp-comm-max-ctas tunes NCCL)."""
    if dp_comm_max_ctas is not None and device != "cuda":
        return [f"--dp-comm-max-ctas {dp_comm_max_ctas} tunes NCCL; on {device} (gloo) leave it unset"]
    return []


# Collectives of every group wait at most this long (--dist-timeout); new_group does not inherit it by itself.
_group_timeout: datetime.timedelta | None = None


def init_distributed(device: str, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the torchrun job if there is one; returns (rank, world_size)."""
    global _group_timeout
    _group_timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def build_mesh(chosen: LayoutChoice | None = None, dp_comm_max_ctas: int | None = None) -> Mesh:
    """Groups for the current job laid out as `chosen` (a single process gets a mesh of size 1 with no groups);
    raises ConfigError before any group is built if the job's world size cannot hold it.

    dp_comm_max_ctas caps the thread blocks NCCL gives the gradient reduction's collectives (the replica group):
    those run beside backward/forward compute, and every SM they take is one the matmuls lose.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    layout = (chosen or LayoutChoice()).on(world_size)
    tp, pp, dp, cp, ep = layout.tp, layout.pp, layout.dp, layout.cp, layout.ep
    tp_rank, dp_rank, pp_rank, cp_rank = coordinates(rank, tp, dp, cp)
    mesh = Mesh(layout, rank, tp_rank, pp_rank, dp_rank, cp_rank)
    if world_size == 1:
        return mesh
    # Every rank must create every group, in the same order, even those it is not in.
    every = [(t, d, p, c) for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)]

    def groups(varying: str, **options) -> tuple[dist.ProcessGroup, list[int]]:
        """My group of the ranks that differ only in the dimensions named in `varying` (of "tdpc")."""
        return groups_by(lambda coord: tuple(x for x, name in zip(coord, "tdpc") if name not in varying), **options)

    def groups_by(key_of, **options) -> tuple[dist.ProcessGroup, list[int]]:
        """My group of the ranks whose (tp, dp, pp, cp) coordinates have the same key."""
        members: dict[tuple[int, ...], list[int]] = {}
        for coord in every:
            key = key_of(coord)
            members.setdefault(key, []).append(mesh.rank_of(*coord))
        mine = None
        for ranks in members.values():  # insertion order: the same on every rank
            group = new_group(ranks, **options)
            if rank in ranks:
                mine = (group, ranks)
        assert mine is not None
        return mine

    mesh.tp_group, mesh.tp_ranks = groups("t")
    mesh.dp_group, mesh.dp_ranks = groups("d", max_ctas=dp_comm_max_ctas)
    mesh.pp_group, mesh.pp_ranks = groups("p")
    mesh.mp_group = groups("tp")[0]
    if cp > 1:
        mesh.cp_group = groups("c")[0]
        mesh.replica_group = groups("dc", max_ctas=dp_comm_max_ctas)[0]
    else:
        mesh.replica_group = mesh.dp_group
    mesh.ep_group, mesh.expert_replica_group = None, mesh.replica_group
    if ep > 1:  # (t, d, p, c): the ep group shares t, p, c and d // ep; expert replicas share t, p and d % ep
        mesh.ep_group = groups_by(lambda c: (c[0], c[1] // ep, c[2], c[3]))[0]
        mesh.expert_replica_group = groups_by(lambda c: (c[0], c[1] % ep, c[2]), max_ctas=dp_comm_max_ctas)[0]
    mesh.expert_group = mesh.ep_group
    if layout.experts_fold_tp:  # the ep_group's dp ranks with all their tp ranks
        mesh.expert_group = mesh.tp_group if ep == 1 else groups_by(lambda c: (c[1] // ep, c[2], c[3]))[0]
    fsdp_shard = layout.hybrid_shards
    if fsdp_shard:  # a replica's index is d * cp + c
        mesh.fsdp_shard_group = groups_by(lambda c: (c[0], c[2], (c[1] * cp + c[3]) // fsdp_shard))[0]
        mesh.fsdp_replicate_group = groups_by(lambda c: (c[0], c[2], (c[1] * cp + c[3]) % fsdp_shard))[0]
    return mesh


def new_group(ranks: list[int], max_ctas: int | None = None) -> dist.ProcessGroup:
    """A process group whose collectives time out after --dist-timeout (like the default group's).

    max_ctas (NCCL only; ignored on gloo) limits the thread blocks of the group's collectives.
    """
    options = None
    if max_ctas is not None and dist.get_backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.config.max_ctas = max_ctas
        options.config.min_ctas = 1
    return dist.new_group(ranks, timeout=_group_timeout, pg_options=options)


# torch 2.13 renamed the flat collectives; 2.11 has only the old names.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def sum_from_last_stage(t: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Sum `t` over the replicas (dp x cp: each holds its share of the global batch's tokens) where the last
    pipeline stage computed it, then give every stage the sum."""
    all_reduce(t, mesh.replica_group)
    if mesh.layout.pp > 1:
        dist.broadcast(t, src=mesh.pp_ranks[-1], group=mesh.pp_group)
    return t
