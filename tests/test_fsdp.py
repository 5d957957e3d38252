"""Fully sharded data parallelism (--fsdp, issue 35) against the single-process run, its resumes across layouts,
the parameter memory it holds and the order of its collectives."""

import layout
import pytest
import torch
from dist_utils import spawn
from layout import assert_matches

from llamatron.checkpoint.reader import CheckpointReader, load_full_tensors
from llamatron.config.settings import config_from_values
from llamatron.errors import ConfigError
from llamatron.models import build_model, get_preset
from llamatron.training.validate import validate

SAVES = ["--save-interval", "2"]
# Every run here clips (the gradient norms are 0.6-1.2): the norm over the shards scales every shard's update.
CLIP = ["--clip-grad", "0.5"]


def run_train(args, nproc, workdir, **kw):
    return layout.run_train([*CLIP, *args], nproc, workdir, **kw)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def reference(workdir):
    return run_train(["--save", "ref", *SAVES], 1, workdir)


@pytest.fixture(scope="module")
def fsdp2(workdir):
    """fsdp 2 with full recompute: each layer's forward runs again in backward, after its re-gather."""
    return run_train(["--fsdp", "--recompute", "full", "--save", "ck-fsdp2", *SAVES], 2, workdir)


def _same_final_weights(workdir, a: str, b: str) -> None:
    ref, got = load_full_tensors(workdir / a / "step-5"), load_full_tensors(workdir / b / "step-5")
    assert ref.keys() == got.keys()
    for k, v in ref.items():
        assert (v - got[k]).abs().max() <= 1e-5, k


def test_fsdp2_matches_single_process_and_saves_full_tensors(workdir, reference, fsdp2):
    assert_matches(reference, fsdp2)
    # layout-free: every weight of the single-device model under its global name, whole, from both ranks' pieces
    reader = CheckpointReader(workdir / "ck-fsdp2")
    plain = {n: tuple(p.shape) for n, p in build_model(get_preset("llama-test")).named_parameters()}
    assert {n: reader.stored("model", n).shape for n in reader.names("model")} == plain
    assert {p.file for n in plain for p in reader.stored("model", n).pieces} == {
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    }
    _same_final_weights(workdir, "ref", "ck-fsdp2")


@pytest.mark.parametrize(
    "nproc, extra",
    [
        (4, ["--micro-batch-size", "1"]),  # 2 micro-batches per rank: the shards accumulate two reduce-scatters
        (4, ["--fsdp-shard-group", "2", "--micro-batch-size", "1"]),  # hsdp 2 x 2
        # fsdp 2 x cp 2: the weights sharded over the dp x cp ranks that hold them; no re-gather, no prefetch
        (4, ["--cp", "2", "--fsdp-keep-params-in-backward", "--no-fsdp-prefetch"]),
    ],
)
def test_fsdp_layouts_match_single_process(workdir, reference, nproc, extra):
    name = f"ck-{nproc}-{'-'.join(x.strip('-') for x in extra)}"
    assert_matches(reference, run_train(["--fsdp", *extra, "--save", name], nproc, workdir))
    _same_final_weights(workdir, "ref", name)


def test_fsdp2_tp2_sequence_parallel_matches_single_process(workdir):
    """llama3-test has one KV head: under tp 2 both ranks hold it (replicated rows, their gradients summed over
    tp), and sequence parallelism's norms are whole on each tp rank with partial gradients; fsdp shards the tp
    shards again over dp."""
    alone = run_train([], 1, workdir, model="llama3-test")
    layout = run_train(
        ["--fsdp", "--tp", "2", "--sequence-parallel", "--save", "ck-tp"], 4, workdir, model="llama3-test"
    )
    assert_matches(alone, layout)
    plain = {n: tuple(p.shape) for n, p in build_model(get_preset("llama3-test")).named_parameters()}
    reader = CheckpointReader(workdir / "ck-tp")
    assert {n: reader.stored("model", n).shape for n in reader.names("model")} == plain


def test_fsdp2_pp2_matches_single_process(workdir):
    """Stage-local fsdp: each stage's chunk sharded over its dp ranks. falcon-test ties its embedding: the first and
    last stage's copies are summed over the stages (whole gradients, kept until the end of backward) before their
    reduce-scatter."""
    alone = run_train([], 1, workdir, model="falcon-test")
    assert_matches(
        alone, run_train(["--fsdp", "--pp", "2", "--micro-batch-size", "1"], 4, workdir, model="falcon-test")
    )


def test_fsdp2_pp2_vpp2_matches_single_process(workdir):
    """--fsdp under the interleaved schedule: each rank's two chunks are buffers of their own, sharded over its dp
    ranks, with several micro-batches in flight per chunk (a chunk's last layer kept gathered between them); the
    final weights too."""
    alone = run_train(["--save", "ref4", *SAVES], 1, workdir, model="llama-test4")
    args = ["--fsdp", "--pp", "2", "--vpp", "2", "--micro-batch-size", "1", "--save", "ck-vpp", *SAVES]
    assert_matches(alone, run_train(args, 4, workdir, model="llama-test4"))
    _same_final_weights(workdir, "ref4", "ck-vpp")


def test_fsdp4_ep2_matches_single_process(workdir):
    """mixtral-test: the dense weights sharded over 4 ranks, each expert's over the 2 holding it (with the z-loss's
    gradient too), the router statistics as in one process."""
    (workdir / "z.yaml").write_text("model_overrides:\n  router_z_loss_coef: 0.001\n")
    args = ["--config", "z.yaml"]
    alone = run_train(args, 1, workdir, model="mixtral-test")
    got = run_train([*args, "--fsdp", "--ep", "2", "--micro-batch-size", "1"], 4, workdir, model="mixtral-test")
    assert_matches(alone, got, keys=("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"))
    for ref, rec in zip(alone, got):
        assert rec["expert_token_share"] == pytest.approx(ref["expert_token_share"], abs=1e-6), rec["step"]


def test_fsdp_with_fp8_matches_fp8_in_one_process(workdir):
    """The same FP8 matmuls (same scales: each sees the whole weight) as one process, up to summation order."""
    args = ["--precision", "bf16", "--fp8-emulate", "--fp8", "tensorwise", "--lr", "3e-3", "--train-steps", "2"]
    alone = run_train(args, 1, workdir)
    assert_matches(alone, run_train([*args, "--fsdp"], 2, workdir), rtol=1e-5)


def test_resume_across_fsdp_single_process_and_distributed_optimizer(workdir, reference, fsdp2):
    """fsdp 2 -> 1 process; fsdp 2 -> dp 2 with the distributed optimizer -> fsdp 2 again (two steps after a
    resume: the second shows whether the optimizer state came across)."""
    alone = run_train(["--load", "ck-fsdp2/step-2"], 1, workdir)
    assert_matches(reference[2:], alone)
    distopt = run_train(
        ["--distributed-optimizer", "--load", "ck-fsdp2/step-2", "--save", "ck-do", "--save-interval", "3"], 2, workdir
    )
    assert_matches(reference[2:], distopt)
    back = run_train(["--fsdp", "--load", "ck-do/step-3"], 2, workdir)
    assert_matches(reference[3:], back)


# ---- in-process: what a rank holds, and when it gathers ----------------------------------------------------------


def _engine(world: int, **values):
    from llamatron.parallel.mesh import build_mesh
    from llamatron.training.engine import build_engine

    cfg = config_from_values(
        {
            "model": "llama-test4",
            "mock_data": True,
            "seq_length": 16,
            "micro_batch_size": 1,
            "global_batch_size": world,
            "device": "cpu",
            "fsdp": True,
            **values,
        }
    )
    return build_engine(cfg, validate(cfg, world), build_mesh())


def _step(engine, world: int, rank: int) -> None:
    from llamatron.data.batches import micro_batches_for_step
    from llamatron.data.mock import MockDataset
    from llamatron.training.engine import train_step

    mbs = micro_batches_for_step(MockDataset(256, 16, 0), 0, world, 1, world, rank)
    train_step(engine, mbs, 0)


def _parameter_memory(rank, world):
    for keep in (False, True):
        _peak_parameter_memory(rank, world, keep)


def _peak_parameter_memory(rank, world, keep):
    """Parameter elements held (the shard plus every parameter storage alive), sampled before and after each
    module's forward and before each linear's backward; the peak against the model's size and its layers'."""
    engine = _engine(world, fsdp_keep_params_in_backward=keep)
    model, buf = engine.chunks[0], engine.buffers[0]
    size = buf.param_data.element_size()
    samples: list[int] = []

    def held(*_args) -> None:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        storages.pop(0, None)  # freed storages
        samples.append((sum(storages.values()) + buf.param_data.untyped_storage().nbytes()) // size)

    for m in model.modules():
        m.register_forward_pre_hook(held)
        m.register_forward_hook(held)
        if isinstance(m, torch.nn.Linear):
            m.register_full_backward_pre_hook(held)
    _step(engine, world, rank)
    total = sum(p.numel() for p in model.parameters())
    largest = max(b.numel for b in buf.buckets)
    assert buf.param_data.numel() == buf.numel // world and buf.numel - total < world * 64 * len(buf.buckets)
    gathered = max(samples) - buf.param_data.numel()
    if keep:  # every layer stays gathered from its forward to its backward: nearly the whole model
        assert gathered > 0.9 * total, (gathered, total)
    else:  # the layer computing and the one prefetched
        assert largest <= gathered <= 2 * largest, (gathered, largest, [b.numel for b in buf.buckets])
        assert max(samples) <= buf.numel / world + 2 * largest < total  # (padding: a few elements per unit)
    assert len(samples) > 50


def test_peak_parameter_memory_is_the_shard_and_two_layers():
    """And with --fsdp-keep-params-in-backward (nothing freed until backward) nearly the whole model."""
    spawn(_parameter_memory, 2)


def _collective_orders(rank, world):
    for prefetch in (True, False):
        _collective_order(rank, world, prefetch)


def _collective_order(rank, world, prefetch):
    engine = _engine(world, fsdp_prefetch=prefetch)
    buf = engine.buffers[0]
    _step(engine, world, rank)
    events = buf.stats.events
    n = len(buf.buckets)  # embedding, 4 layers, final norm with the head

    def first(kind: str, i: int, where: str | None = None) -> int:
        return next(k for k, e in enumerate(events) if e[:2] == (kind, i) and where in (None, e[2]))

    # Prefetch: unit i+1's gather is issued before unit i's forward has computed; in backward, unit i-1's before
    # unit i's gradients are reduce-scattered.
    end = first("computed", n - 1)  # the end of forward
    forward = all(first("gather", i + 1) < first("computed", i) for i in range(n - 1))
    regather = [min(k for k in range(end, len(events)) if events[k][:2] == ("gather", i)) for i in range(n - 1)]
    backward = all(regather[i - 1] < first("reduce", i) for i in range(1, n - 1))
    assert forward == prefetch and backward == prefetch
    # Every unit but the last is freed after its forward and gathered again for its backward; every unit's
    # gradients are reduce-scattered during backward, once.
    for i in range(n - 1):
        assert first("free", i, "forward") < end and "backward" in events[regather[i]][2]
    assert sorted(e[1] for e in events if e[0] == "reduce" and e[2] == "backward") == list(range(n))


def test_next_layer_gather_is_issued_before_this_layer_computes():
    """And the check fails with --no-fsdp-prefetch."""
    spawn(_collective_orders, 2)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"fsdp": True, "distributed_optimizer": True}, "shards the optimizer state already; drop --distributed"),
        ({"fsdp": True, "overlap_param_gather": False}, "drop --overlap-param-gather"),
        ({"fsdp": True, "bucket_size": 1000}, "one bucket per layer; drop --bucket-size"),
        ({"fsdp": True, "lora_rank": 4}, "--fsdp does not compose with LoRA"),
        ({"fsdp": True, "fsdp_shard_group": 3}, r"--fsdp-shard-group 3 must divide the 4 .* use one of \[2\]"),
        ({"fsdp_shard_group": 2}, "--fsdp-shard-group 2 needs --fsdp"),
        ({"fsdp_keep_params_in_backward": True}, "--fsdp-keep-params-in-backward needs --fsdp"),
        ({"fsdp_prefetch": False}, "--no-fsdp-prefetch needs --fsdp"),
    ],
)
def test_flags_that_make_no_sense_with_fsdp_are_one_line_errors(values, message):
    cfg = config_from_values({"model": "llama-test", "mock_data": True, "global_batch_size": 8, **values})
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg, 4)
    assert "\n" not in str(err.value)
