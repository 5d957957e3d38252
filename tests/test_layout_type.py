"""The parallel layout defined once (parallel/layout.py): the settings parse into it, and the mesh, the planner and
the simulator hold it, each with its own job beside it, without a size of their own."""

from __future__ import annotations

import dataclasses

import pytest

from llamatron.config.settings import ParallelConfig, config_from_values, section_of
from llamatron.errors import ConfigError
from llamatron.parallel.layout import LayoutChoice, ParallelLayout, layout_values
from llamatron.parallel.mesh import Mesh, build_mesh
from llamatron.planning.layout import Layout
from llamatron.planning.plan import run_layout
from llamatron.planning.simulator.costs import Shape

# The parallel section's flags and YAML keys before the layout was defined once (main at edc76eb): none may go.
PARALLEL_SETTINGS = [
    "tp", "pp", "vpp", "cp", "ep", "etp", "pp_layers", "sequence_parallel", "distributed_optimizer", "fsdp",
    "fsdp_keep_params_in_backward", "fsdp_prefetch", "fsdp_shard_group", "tp_comm_overlap", "overlap_grad_reduce",
    "overlap_param_gather", "bucket_size", "grad_reduce_dtype", "dp_comm_max_ctas",
]  # fmt: skip
GIVEN = {"tp": 2, "pp": 2, "vpp": 2, "cp": 2, "ep": 2, "etp": 1, "sequence_parallel": True, "fsdp": True}


def test_the_parallel_settings_keep_their_names_and_are_the_layouts_fields():
    names = [f.name for f in dataclasses.fields(ParallelConfig)]
    assert sorted(names) == sorted(PARALLEL_SETTINGS)
    assert all(section_of(name) == "parallel" for name in PARALLEL_SETTINGS)
    chosen = {f.name for f in dataclasses.fields(LayoutChoice)}
    # the layout's fields are declared once, by LayoutChoice: every other layout type inherits them
    for kind in (ParallelLayout, Layout, Shape):
        assert chosen <= {f.name for f in dataclasses.fields(kind)} and issubclass(kind, LayoutChoice)
    # the mesh holds it (mesh.layout) beside the rank's coordinates and process groups (fsdp_shard_group: a group)
    sizes = {f.name for f in dataclasses.fields(Mesh) if not f.name.endswith("_group")}
    assert sizes & (chosen | {"dp", "world_size"}) == set()


def test_settings_parse_into_the_layout_that_every_reader_holds():
    cfg = config_from_values(GIVEN)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel.tp = 4  # type: ignore[misc]
    layout = cfg.parallel.on(32)  # 32 ranks over tp 2 x cp 2 x pp 2: dp 4
    assert (layout.dp, layout.world_size, layout.replicas, layout.expert_replicas) == (4, 32, 8, 4)
    assert (layout.experts_fold_tp, layout.expert_parallel, layout.hybrid_shards) == (True, 4, 0)
    planned = run_layout(cfg, layout.dp)
    shape = Shape(**layout_values(planned, ParallelLayout))
    for reader in (planned, shape):
        assert layout_values(reader, ParallelLayout) == layout_values(layout, ParallelLayout)
    assert build_mesh().layout == ParallelLayout()  # one process: every size 1


def test_a_world_the_layout_cannot_fill_is_refused_in_one_line_naming_the_fix():
    with pytest.raises(ConfigError, match=r"world size 12 is not divisible by tp\*cp\*pp = 2\*2\*2; launch a multiple"):
        config_from_values(GIVEN).parallel.on(12)
    assert "use --ep in [1, 3]" in LayoutChoice(ep=2).world_problems(3)[0]
