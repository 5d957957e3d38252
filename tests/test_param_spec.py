"""Parameter identity (llamatron/parallel/param_spec.py): names are global names, and nothing is stored on a Parameter.

The engines are built in one process for each rank of a tp x pp layout: building needs no process group
(collectives run only in a step), so every rank's chunks, specs and buffers can be inspected here.
"""

from __future__ import annotations

from collections import Counter

import pytest

from llamatron.config.settings import config_from_values
from llamatron.models import build_model, get_preset
from llamatron.parallel.layout import ParallelLayout
from llamatron.parallel.mesh import Mesh
from llamatron.training.engine import build_engine
from llamatron.training.validate import validate


def _engine(model: str, tp: int, pp: int, tp_rank: int, pp_rank: int, **values):
    cfg = config_from_values(
        {
            "model": model,
            "mock_data": True,
            "device": "cpu",
            "seq_length": 16,
            "tp": tp,
            "pp": pp,
            "micro_batch_size": 1,
            "global_batch_size": 2 * pp,
            **values,
        }
    )
    mesh = Mesh(
        ParallelLayout(tp=tp, pp=pp),
        rank=pp_rank * tp + tp_rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        pp_ranks=[r * tp + tp_rank for r in range(pp)],
    )
    return build_engine(cfg, validate(cfg, world_size=tp * pp), mesh)


@pytest.mark.parametrize(
    "model, extra",
    [
        ("falcon-test4", {"sequence_parallel": True, "recompute": "full"}),  # tied embeddings across stages
        ("llama-test4", {"vpp": 2, "recompute": "selective"}),
    ],
)
def test_stage_and_shard_parameter_names_are_the_global_names_and_no_parameter_has_attributes(model, extra):
    tp, pp = 2, 2
    expected = {n: tuple(p.shape) for n, p in build_model(get_preset(model)).named_parameters()}
    tied_copies = 0
    for tp_rank in range(tp):
        held: Counter = Counter()
        for pp_rank in range(pp):
            engine = _engine(model, tp, pp, tp_rank, pp_rank, **extra)
            for chunk, buf in zip(engine.chunks, engine.buffers):
                for name, p in chunk.named_parameters():
                    assert p.__dict__ == {}, f"{name} carries {sorted(p.__dict__)}"
                    spec = buf.spec_of[p]
                    assert spec.local_shape == tuple(p.shape) and spec.full_shape == expected[spec.global_name]
                    if spec.shared_replica:  # the last stage's copy of the tied embedding
                        assert (name, spec.global_name) == ("lm_head.weight", "embed.weight")
                        tied_copies += 1
                    else:
                        assert name == spec.global_name, "a stage's parameter names are the global names"
                        held[name] += 1
        assert held == Counter(expected.keys()), "every parameter held once over the stages of a tp rank"
    assert tied_copies == (tp if get_preset(model).tie_embeddings else 0)
