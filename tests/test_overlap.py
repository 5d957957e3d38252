"""Data-parallel overlap, shown by the gradient buffer's own record of its collectives (not wall time): with
overlap on, backward issues every bucket's gradient reduction as the bucket fills, last layers first, and the
next forward waits for each bucket's parameter all-gather just before the layer that uses it."""

import pytest
from dist_utils import spawn

from llamatron.config.settings import config_from_values
from llamatron.data.batches import micro_batches_for_rank
from llamatron.data.mock import MockDataset
from llamatron.parallel.mesh import build_mesh
from llamatron.training.engine import build_engine, train_step
from llamatron.training.validate import validate

SETTINGS = {
    "model": "llama-test4",
    "device": "cpu",
    "precision": "fp32",
    "seq_length": 16,
    "micro_batch_size": 1,
    "global_batch_size": 4,
    "distributed_optimizer": True,
    "bucket_size": 6000,  # several buckets, each a few layers' worth
}


def _two_steps(rank: int, world: int, overlap: bool, out) -> None:
    cfg = config_from_values({**SETTINGS, "overlap_grad_reduce": overlap, "overlap_param_gather": overlap})
    derived = validate(cfg, world)
    mesh = build_mesh()
    engine = build_engine(cfg, derived, mesh)
    data = MockDataset(engine.model_cfg.vocab_size, 16, 0)
    for step in range(2):  # the second step's forward waits for the first step's parameter all-gathers
        train_step(engine, micro_batches_for_rank(data, 4 * step, 4, 1, mesh), step)
    buffer = engine.buffers[0]
    forward_order = ["embed", *(f"layers.{i}" for i in range(4)), "norm"]
    if rank == 0:
        out.put((len(buffer.buckets), list(buffer.stats.events), forward_order))


def _events(overlap: bool):
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    spawn(_two_steps, 2, overlap, queue)
    return queue.get()


@pytest.fixture(scope="module")
def overlapped():
    return _events(overlap=True)


def test_backward_issues_each_buckets_reduction_as_it_fills(overlapped):
    buckets, events, _ = overlapped
    reduces = [(b, when) for kind, b, when in events if kind == "reduce"]
    assert buckets >= 4 and sorted(b for b, _ in reduces) == list(range(buckets))
    assert [b for b, _ in reduces] == list(range(buckets))  # in backward's order: the last layers' bucket first
    in_backward = [b for b, when in reduces if when == "backward"]
    assert len(in_backward) >= buckets - 1, reduces  # all of them before backward ends, but perhaps the last


def test_the_next_forward_waits_for_each_bucket_just_before_its_layer(overlapped):
    buckets, events, forward_order = overlapped
    waits = [(b, where) for kind, b, where in events if kind == "gather wait"]
    assert sorted(b for b, _ in waits) == list(range(buckets))  # every bucket's gather was in flight
    places = [where for _, where in waits]
    assert "after forward" not in places and len(set(places)) >= 3, waits  # layer by layer, not all at once
    positions = [forward_order.index(p) for p in places]
    assert positions == sorted(positions), waits  # in forward order


def test_without_overlap_the_buffer_reduces_after_backward_and_gathers_before_forward():
    buckets, events, _ = _events(overlap=False)
    assert [when for kind, _, when in events if kind == "reduce"] == ["after backward"] * buckets
    assert not [e for e in events if e[0] == "gather wait"]


def test_the_event_record_is_one_steps(overlapped):
    assert len(overlapped[1]) <= 2 * overlapped[0]  # cleared by zero_grad: it cannot grow over a run
