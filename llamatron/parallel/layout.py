"""The parallel layout, defined once: how a run splits the model, the sequence and the batch over its ranks.

`LayoutChoice` is what the flags choose (--tp, --pp, --vpp, --cp, --ep, --etp, --pp-layers, --sequence-parallel,
--distributed-optimizer, --fsdp, --fsdp-shard-group): the settings' `parallel` section extends it with the knobs of
how the layout's communication runs (config/settings.py: ParallelConfig). The world size then fixes the
data-parallel size: `LayoutChoice.on(world_size)` checks the two fit and gives the `ParallelLayout`, which
the mesh (parallel/mesh.py: it adds the rank's coordinates and process groups), the planner (planning/layout.py:
it adds recompute and the batch) and the simulator (planning/simulator/costs.py's Shape: it adds the run's other
settings) hold, each without repeating a size.

World = tp x cp x dp x pp ranks; ep of the dp ranks split the experts (see parallel/mesh.py for the rank order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from ..config.ranges import at_least, setting
from ..errors import ConfigError


def divisors(n: int) -> list[int]:
    """1..n's divisors of n, ascending: the sizes a dimension of n can be split into. Found in pairs (d, n // d) up to
    sqrt(n): plan's --gpus may be large."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True, kw_only=True)
class LayoutChoice:
    """The layout as the flags give it, before the world size fixes the data-parallel size (each field is a flag
    and a YAML key: config/settings.py)."""

    tp: int = setting(1, "tensor-parallel size (ranks sharing each layer)", allowed=at_least(1))
    pp: int = setting(1, "pipeline-parallel size (stages)", allowed=at_least(1))
    vpp: int = setting(1, "virtual pipeline chunks per rank (interleaved 1F1B)", allowed=at_least(1))
    cp: int = setting(
        1, "context-parallel size (ranks that split every sequence and share the weights)", allowed=at_least(1)
    )
    ep: int = setting(
        1,
        "expert-parallel size: a mixture of experts' experts split over this many of the data-parallel ranks",
        allowed=at_least(1),
    )
    etp: int | None = setting(
        None,
        "expert tensor-parallel size: 1 keeps every expert whole, the tp ranks becoming more expert-parallel ranks "
        "(experts split over ep x tp ranks; each tp rank routes its sequence shard; needs --sequence-parallel), "
        "or the --tp size (every expert's ffn split over the tp ranks, as the MLP's); default: --tp",
        allowed=at_least(1, "1 or the --tp size"),
    )
    pp_layers: str | None = setting(None, "comma-separated decoder layers per stage, e.g. 7,9,9,7")
    sequence_parallel: bool = setting(False, "shard norms/dropout along the sequence inside the tensor-parallel group")
    distributed_optimizer: bool = setting(False, "shard optimizer state and master weights over data-parallel ranks")
    fsdp: bool = setting(
        False,
        "fully sharded data parallelism (ZeRO-3): parameters, gradients and optimizer state sharded over the "
        "data-parallel ranks, each layer's parameters all-gathered just before use and freed after",
    )
    fsdp_shard_group: int | None = setting(
        None,
        "with --fsdp, hybrid sharding: shard over groups of this many data-parallel ranks, replicate across them "
        "(gradients all-reduced between the groups; e.g. the GPUs of one node)",
        allowed=at_least(2, "or left unset to shard over every data-parallel rank"),
    )

    @property
    def experts_fold_tp(self) -> bool:
        """--etp 1 under tp > 1: every expert whole, the tp ranks more expert-parallel ranks (the all-to-all's)."""
        return self.etp == 1 and self.tp > 1

    @property
    def expert_parallel(self) -> int:
        """Ranks the experts are split over (the all-to-all's size): ep, or ep x tp under --etp 1."""
        return self.ep * self.tp if self.experts_fold_tp else self.ep

    @property
    def hybrid_shards(self) -> int:
        """--fsdp-shard-group's N under --fsdp (replicas sharding the weights among them); 0: no hybrid sharding."""
        return (self.fsdp_shard_group or 0) if self.fsdp else 0

    def world_problems(self, world_size: int, world_flag: str | None = None) -> list[str]:
        """Why `world_size` ranks cannot form a tp x cp x dp x pp mesh with ep | dp (empty when they can).
        world_flag: the flag the world size came from (plan's --gpus), named in the fix instead of the launcher."""
        tp, pp, cp, ep = self.tp, self.pp, self.cp, self.ep
        out = [f"--{name} must be >= 1" for name, size in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)) if size < 1]
        if not out and world_size % (tp * pp * cp):
            names, sizes = ("tp*cp*pp", f"{tp}*{cp}*{pp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")
            more = (
                f"give {world_flag} a multiple of {tp * cp * pp}"
                if world_flag
                else f"launch a multiple of {tp * cp * pp} processes (--nproc-per-node N, torchrun or srun)"
            )
            out.append(
                f"world size {world_size} is not divisible by {names} = {sizes}; {more} or change --tp/--cp/--pp"
            )
        elif not out and (world_size // (tp * pp * cp)) % ep:
            dp = world_size // (tp * pp * cp)
            out.append(
                f"--ep {ep} must divide the data-parallel size {dp} (experts are split over data-parallel ranks); "
                f"use --ep in {divisors(dp)} or launch {ep * tp * pp * cp}·k processes"
            )
        return out

    def on(self, world_size: int) -> ParallelLayout:
        """This choice on `world_size` ranks (the data-parallel size their quotient); raises ConfigError, before any
        group or memory, if they cannot form it."""
        problems = self.world_problems(world_size)
        if problems:
            raise ConfigError("; ".join(problems))
        return ParallelLayout(**layout_values(self, LayoutChoice), dp=world_size // (self.tp * self.pp * self.cp))


def layout_values(layout: LayoutChoice, kind: type[LayoutChoice]) -> dict[str, Any]:
    """The fields `kind` declares, of `layout` (a settings section, or a layout with more fields): to build another
    kind of layout from."""
    return {f.name: getattr(layout, f.name) for f in fields(kind)}


@dataclass(frozen=True, kw_only=True)
class ParallelLayout(LayoutChoice):
    """The layout on a world: the chosen sizes and the data-parallel size, and the sizes that follow from them."""

    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights: gradients are reduced, and the optimizer sharded, over dp x cp."""
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts ((dp / ep) x cp): their gradients are reduced, and the optimizer
        sharded, over these."""
        return max(1, self.replicas // self.ep)

    @property
    def dense_shards(self) -> int:
        """Ranks one copy of the dense weights is cut over: --fsdp's shard group (hybrid sharding: N), else dp x cp
        with the distributed optimizer or --fsdp, else 1 (what the optimizer state is divided by)."""
        if self.hybrid_shards:
            return self.hybrid_shards
        return self.replicas if self.fsdp or self.distributed_optimizer else 1

    @property
    def expert_shards(self) -> int:
        """As dense_shards, for the experts (sharded over their own replicas; ep with hybrid sharding is refused)."""
        return self.expert_replicas if self.fsdp or self.distributed_optimizer else 1
