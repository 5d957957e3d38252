"""`llamatron plan` with --fsdp (issue 35 step 5): the memory model against what ShardedBuffer and the optimizer
allocate on gloo ranks and against formulas written out, the traffic formulas, the search's choice and its
refusals, the targets of issues 34 and 35."""

import dataclasses

import pytest
from dist_utils import spawn
from plan_layouts import planned

from llamatron.config.settings import config_from_values
from llamatron.models import get_preset
from llamatron.models.inventory import num_params
from llamatron.planning import candidates as C
from llamatron.planning import plan as P
from llamatron.planning import search as S
from llamatron.planning.fsdp_memory import fsdp_buffers, fsdp_state_bytes
from llamatron.planning.params import layer_shards
from llamatron.planning.simulator.evaluate import simulate_layout
from llamatron.planning.simulator.fsdp import FsdpOptions, FsdpTraffic, exposed_per_micro_batch, layer_traffic
from llamatron.planning.simulator.hardware import resolve_hardware
from llamatron.training.validate import validate

GB = 1e9
FP32 = P.Precision(dtype="fp32", compiled=False)


def _lay(dp=4, **kw):
    base = {"fsdp": True, "distributed_optimizer": False, "recompute": "none", "micro_batch_size": 1}
    base.update({"global_batch_size": 8 * dp, **kw})
    return planned(1, 1, 1, dp, False, **base)


# ---- memory: formulas written out ------------------------------------------------------------------------------


def test_fsdp_state_is_everything_over_the_shard_group():
    """llama-test (h 64, 2 layers, KV 32, ffn 160, vocab 256): 2 + 4 + 12 bytes a parameter over dp 4; hybrid
    sharding over its group of 2; the distributed optimizer for contrast (2 + 4 + 12/4)."""
    cfg = get_preset("llama-test")
    h, layers, kv, f, vocab = 64, 2, 32, 160, 256
    params = layers * (h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h) + h + 2 * vocab * h
    mem = P.layout_memory(cfg, _lay(4), 32)
    assert (mem.weights, mem.gradients, mem.optimizer) == pytest.approx((2 * params / 4, 4 * params / 4, 3 * params))
    hybrid = P.layout_memory(cfg, _lay(4, fsdp_shard_group=2), 32)
    assert hybrid.static == pytest.approx(18 * params / 2)
    zero1 = P.layout_memory(cfg, _lay(4, fsdp=False, distributed_optimizer=True), 32)
    assert zero1.static == pytest.approx((6 + 12 / 4) * params)
    assert "gathered" not in zero1.buffers and mem.buffers["staging"] == 0


def test_fsdp_with_experts_stores_a_share_of_every_expert_whatever_ep():
    """mixtral-test on dp 4: under ep 2 each rank holds half the experts, sharded over the 2 holding them, so
    1/4 of all experts; the dense part over all 4."""
    cfg = get_preset("mixtral-test")
    dense, experts = layer_shards(cfg, 1, 1)
    total = num_params(cfg)
    for ep in (1, 2, 4):
        w = fsdp_state_bytes(cfg, _lay(4, ep=ep), P.Precision(), cfg.num_layers, 0)[0]
        assert w == pytest.approx(2 * total / 4), ep
    assert layer_shards(cfg, 1, 2)[1] * 2 == experts


def test_gathered_units_and_reduced_gradients_by_hand():
    """llama-test4 (h 64, 4 layers, vocab 256, untied) on dp 2: forward holds a unit and the next one gathered, the
    head's unit (norm + head) beside the last layer is the largest pair; while a unit's reduce-scatter is issued,
    MAX_REDUCING + 1 units' whole fp32 gradients are its inputs (with their output shards) and the next unit's
    staging fills; keep-params gathers the whole model."""
    cfg = get_preset("llama-test4")
    h, vocab = 64, 256
    layer = sum(layer_shards(cfg, 1, 1))
    embed, head = vocab * h, vocab * h + h
    whole = 4 * layer + embed + head
    lay = _lay(2)
    got = fsdp_buffers(cfg, lay, P.Precision(), 0)
    assert got["gathered"] == 2 * max(2 * layer, embed + layer, head + layer)
    unit = max(layer, embed, head)  # the largest unit being reduced with two layers beside it, a layer filling
    assert got["reduce_inputs"] == pytest.approx(4 * (unit + 2 * layer) * (1 + 1 / 2) + 4 * layer)
    keep = fsdp_buffers(cfg, dataclasses.replace(lay, fsdp_keep_params=True), P.Precision(), 0)
    assert keep["gathered"] == 2 * whole
    bf16 = fsdp_buffers(cfg, lay, dataclasses.replace(P.Precision(), grad_reduce_dtype="bf16"), 0)
    assert bf16["reduce_inputs"] == pytest.approx(2 * (unit + 2 * layer) * (1 + 1 / 2) + 4 * layer)
    one = fsdp_buffers(cfg, _lay(1), P.Precision(), 0)  # one rank: the shard is the bucket
    assert one == {"gathered": 0.0, "reduce_inputs": 0.0}


# ---- memory: against the tensors a gloo run allocates ----------------------------------------------------------


def _held(rank, world):
    from llamatron.data.batches import micro_batches_for_step
    from llamatron.data.mock import MockDataset
    from llamatron.parallel.mesh import build_mesh
    from llamatron.training.engine import build_engine, train_step

    values = {"model": "llama-test4", "mock_data": True, "seq_length": 16, "micro_batch_size": 1}
    values.update({"global_batch_size": 2 * world, "device": "cpu", "fsdp": True})
    cfg = config_from_values(values)
    derived = validate(cfg, world)
    engine = build_engine(cfg, derived, build_mesh())
    buf, opt = engine.buffers[0], engine.optimizer
    state = buf.param_data.nbytes + buf.grad_data.nbytes + sum(t.numel() * 4 for t in opt.exp_avg + opt.exp_avg_sq)
    assert opt.master_is_param  # fp32 on CPU: the shard is the master
    held: list[int] = []
    finish = buf._finish_reduce

    def record(b):  # the gradients being reduced (inputs, output shards) and collected, as one is finished
        reducing = sum(c.reduce[1].nbytes + c.reduce[2].nbytes for c in buf.buckets if c.reduce is not None)
        held.append(reducing + sum(c.staging.nbytes for c in buf.buckets if c.staging is not None))
        finish(b)

    buf._finish_reduce = record
    train_step(engine, micro_batches_for_step(MockDataset(256, 16, 0), 0, 2 * world, 1, world, rank), 0)
    model = get_preset("llama-test4")
    lay = P.run_layout(cfg, derived.dp)
    planned = sum(fsdp_state_bytes(model, lay, FP32, model.num_layers, 0))
    padding = (buf.numel - sum(p.numel() for p in buf.spec_of)) / world  # elements each bucket is padded by
    assert 0 <= state - planned <= 16 * padding + 1, (state, planned)
    reducing = fsdp_buffers(model, lay, FP32, 0)["reduce_inputs"]
    every = 4 * buf.numel * (1 + 1 / world)  # every unit's gradient and shard: what keeping all inputs would hold
    assert held and 0.6 * reducing <= max(held) <= reducing < 0.8 * every, (held, reducing, every)


def test_planned_state_and_kept_gradients_equal_what_two_gloo_ranks_hold():
    spawn(_held, 2)


# the pipelines whose gathered weights are measured: (vpp, layers, model_overrides); pp 2 x dp 2
PIPELINES = [
    (2, 12, {}),  # 3 layers a chunk: the warm-up keeps both chunks' last layers beside the pair computing
    (1, 6, {}),  # 1F1B: the first stage's second forward runs while the first micro-batch's last layer is kept
    (2, 4, {"vocab_size": 1024, "tie_embeddings": True}),  # an embedding and a head larger than a layer
]


def _gathered(rank, world):
    from llamatron.data.batches import micro_batches_for_step
    from llamatron.data.mock import MockDataset
    from llamatron.parallel.layout import LayoutChoice
    from llamatron.parallel.mesh import build_mesh
    from llamatron.training.engine import build_engine, train_step

    for vpp, layers, overrides in PIPELINES:
        values = {"model": "llama-test4", "mock_data": True, "seq_length": 16, "micro_batch_size": 1, "pp": 2}
        values.update({"vpp": vpp, "global_batch_size": 8, "device": "cpu", "fsdp": True})
        cfg = config_from_values({**values, "model_overrides": {"num_layers": layers, **overrides}})
        derived = validate(cfg, world)
        mesh = build_mesh(LayoutChoice(pp=2))
        engine = build_engine(cfg, derived, mesh)
        buckets = [b for buf in engine.buffers for b in buf.buckets]
        peak = [0]
        for buf in engine.buffers:  # the whole weights existing at once, after each gather is issued
            issue = buf._issue_gather

            def gather(i, where, issue=issue, peak=peak, buckets=buckets):
                issue(i, where)
                peak[0] = max(peak[0], sum(b.full.untyped_storage().nbytes() for b in buckets))

            buf._issue_gather = gather
        vocab = cfg.model_config().vocab_size
        train_step(engine, micro_batches_for_step(MockDataset(vocab, 16, 0), 0, 8, 1, 2, mesh.dp_rank), 0)
        lay = P.run_layout(cfg, derived.dp)
        planned = fsdp_buffers(cfg.model_config(), lay, FP32, mesh.pp_rank)["gathered"]
        padding = 4 * sum(b.numel - sum(p.numel() for p in b.params) for b in buckets)
        assert 0 <= peak[0] - planned <= padding, (vpp, layers, mesh.pp_rank, peak[0], planned)


def test_planned_gathered_weights_equal_what_pipeline_ranks_gather():
    """--fsdp under a pipeline (pp 2 x dp 2, interleaved or not): the plan's gathered weights on each stage are the
    most that the gloo ranks' buckets hold gathered at once in a step, up to their padding (the plan counted
    (vpp - 1) kept layers: one too few where a chunk has 3 units or more, or a first stage runs a second forward
    before the first backward)."""
    spawn(_gathered, 4)


# ---- traffic ---------------------------------------------------------------------------------------------------


def test_layer_traffic_is_the_gathers_and_reduce_scatters_the_code_issues():
    calls = []

    def collective(kind, size, ranks, per_node):
        calls.append((kind, size, ranks, per_node))
        return size / 1e9

    fs = FsdpOptions(dense_shards=8, expert_shards=2, replicate=4, expert_stride=4)
    t = layer_traffic(fs, 1000.0, 400.0, 2, 4, collective, lambda stride, size: min(size, 8 // stride))
    assert calls == [
        ("all_gather", 2000.0, 8, 8),
        ("reduce_scatter", 4000.0, 8, 8),
        ("all_gather", 800.0, 2, 2),
        ("reduce_scatter", 1600.0, 2, 2),
        ("all_reduce", 1000.0 / 8 * 4, 4, 1),  # hybrid: the shard over the groups holding it, one per node
    ]
    assert t.gather_bytes == 2000 * 7 / 8 + 800 / 2 and t.reduce_bytes == 4000 * 7 / 8 + 1600 / 2


def test_exposed_fsdp_time_written_out():
    """Forward: the first layer's gather waited for, each next one hidden by as much as the layer before computes;
    backward: gather again plus reduce-scatter beside each layer's backward; hybrid all-reduces exposed in full."""
    t = FsdpTraffic(gather=3.0, reduce=4.0, all_reduce=0.5, gather_bytes=30.0, reduce_bytes=40.0)
    fs = FsdpOptions(4, replicate=2)
    fwd, back, c_fwd, c_back = exposed_per_micro_batch(t, fs, [2.0, 5.0, 1.0], 6.0, 10.0)
    assert fwd == 3.0 + (3.0 - 2.0) + 0.0
    assert back == 3 * ((3.0 + 4.0 - 6.0) + 0.5)
    assert c_fwd == (2.0 + 3.0) * 10.0 / 10.0 and c_back == 3 * 6.0 * (70.0 / 7.0) / 10.0
    keep = exposed_per_micro_batch(t, dataclasses.replace(fs, keep_params=True), [2.0, 5.0, 1.0], 6.0, 10.0)
    assert keep[1] == 3 * (0.0 + 0.5)  # no gather in backward: the reduce-scatter alone fits beside it
    # bytes faster than the contention bandwidth: the compute loses at most the time the collectives run beside it
    fast = exposed_per_micro_batch(t, fs, [2.0, 5.0, 1.0], 6.0, 5.0)
    assert fast[2] == 2.0 + 3.0 and fast[3] == 3 * 6.0


def test_simulated_step_has_the_fsdp_traffic_and_hybrid_all_reduce():
    """llama2-7b on 16 H100s: fsdp over all 16 (across nodes) exposes more than hsdp over a node, whose all-reduce
    over the 2 nodes shows; without fsdp neither part exists. The per-step traffic is written out."""
    model, hw = get_preset("llama2-7b"), resolve_hardware("h100-sxm")
    lay = planned(1, 1, 1, 16, False, False, "none", 1, 32, fsdp=True)
    full = simulate_layout(model, lay, 4096, hw)
    hybrid = simulate_layout(model, dataclasses.replace(lay, fsdp_shard_group=8), 4096, hw)
    plain = simulate_layout(model, dataclasses.replace(lay, fsdp=False, distributed_optimizer=True), 4096, hw)
    assert "fsdp" not in plain.result.parts and plain.fsdp is None
    assert full.result.parts["fsdp"] > 0 and hybrid.fsdp is not None and hybrid.fsdp["all_reduce_gb"] > 0
    layer = sum(layer_shards(model, 1, 1))
    assert full.fsdp is not None
    assert full.fsdp["all_gather_gb"] == pytest.approx(32 * 2 * 2 * 2 * layer * 15 / 16 / GB)  # layers x mb x gathers
    assert full.fsdp["reduce_scatter_gb"] == pytest.approx(32 * 2 * 4 * layer * 15 / 16 / GB)
    assert hybrid.fsdp["all_reduce_gb"] == pytest.approx(32 * 2 * 4 * 2 * (1 / 2) * layer / 8 / GB)


def test_one_rank_fsdp_rows_are_simulated_with_the_fsdp_model():
    from llamatron.planning.simulator.runs import measured_runs, simulate_run

    rows = [r for r in measured_runs() if r.get("fsdp")]
    assert len(rows) == 2
    for r in rows:  # one rank: nothing gathered or reduced, the step of the default row
        twin = {**r, "fsdp": False}
        assert simulate_run(r).step_seconds == pytest.approx(simulate_run(twin).step_seconds)


# ---- the search ------------------------------------------------------------------------------------------------


def test_search_proposes_fsdp_where_no_replica_fits():
    """llama-1b cut to 7 layers on 8 GPUs, one a node (so tp 1; pp 2 or 4, uneven, leaves a stage more than
    --fsdp's shards), with a memory between the smallest --fsdp layout and the smallest other one: every layout
    listed shards with --fsdp, and the command it suggests says so."""
    shape = {"num_layers": 7}
    model = C.planned_model("llama-1b", shape)
    totals: dict[bool, float] = {True: 1e30, False: 1e30}
    for lay in C.candidate_layouts("llama-1b", 8, 2048, 1, 16, shape):
        totals[lay.fsdp] = min(totals[lay.fsdp], P.layout_memory(model, lay, 2048).total)
    assert totals[True] < totals[False]
    memory = (totals[True] + totals[False]) / 2
    result = S.plan("llama-1b", 8, memory, 2048, 16, 1, shape, explain=False)
    assert result.fits and all(p.layout.fsdp for p in result.fits)
    assert "--fsdp" in result.fits[0].layout.train_flags(2048)
    roomy = S.plan("llama-1b", 8, 2 * totals[False], 2048, 16, 1, shape, explain=False)
    assert any(not p.layout.fsdp for p in roomy.fits)  # where a replica fits, the others are weighed too


def test_search_never_proposes_what_the_trainer_refuses():
    """Hybrid sharding is searched (one node's replicas), but not with expert parallelism (fsdp.fsdp_problems
    refuses it); --fsdp never goes with --distributed-optimizer."""
    layouts = list(C.candidate_layouts("mixtral-test", 4, 64, 2, 16))
    assert any(lay.fsdp_shard_group == 2 and lay.ep == 1 for lay in layouts)
    assert any(lay.fsdp and lay.ep == 2 for lay in layouts)
    assert not any(lay.fsdp_shard_group and lay.ep > 1 for lay in layouts)
    assert not any(lay.fsdp and lay.distributed_optimizer for lay in layouts)
    for lay in layouts[:50]:
        assert C.planned_run_config("mixtral-test", None, lay, 64).lora.lora_rank == 0  # the planner plans no LoRA


def test_default_sequence_is_the_context_at_most_8192():
    assert S.default_seq_length(get_preset("llama4-maverick-17b-128e")) == 8192
    assert S.default_seq_length(get_preset("llama2-7b")) == 4096


# ---- the targets ---------------------------------------------------------------------------------------------


def test_scout_on_16_80gb_gpus_cannot_fit_and_the_bound_says_why():
    """107.8B parameters x 18 bytes / 16 = 121 GB per GPU sharded perfectly (fsdp reaches it: ep 2 x 8 holders)."""
    model = get_preset("llama4-scout-17b-16e")
    lay = planned(1, 1, 1, 16, False, False, "full", 1, 16, ep=2, fsdp=True)
    assert P.static_memory(model, lay) == pytest.approx(18 * num_params(model) / 16, rel=1e-6)
    assert P.static_memory(model, lay) > 80 * GB


def test_llama3_8b_on_8_gpus_fits_without_recompute_only_with_fsdp():
    """Why `plan --model llama3.1-8b --gpus 8` proposes --fsdp over all 8: at seq 8192 and micro-batch 1 without
    recompute, fsdp fits 80 GB where the distributed optimizer (6 + 12/8 bytes a parameter) does not, and it has
    no pipeline bubble to pay, unlike the pp 4 layout that fits without recompute."""
    model = get_preset("llama3.1-8b")
    fsdp = planned(1, 1, 1, 8, False, False, "none", 1, 512, fsdp=True)
    zero1 = dataclasses.replace(fsdp, fsdp=False, distributed_optimizer=True)
    piped = planned(1, 4, 2, 2, False, True, "none", 1, 512)
    assert P.layout_memory(model, fsdp, 8192).total <= 80 * GB < P.layout_memory(model, zero1, 8192).total
    assert P.layout_memory(model, piped, 8192).total <= 80 * GB
    speed = [P.estimate_speed(model, lay, 8192, 8, 8).tokens_per_sec_per_gpu for lay in (fsdp, piped)]
    assert speed[0] > speed[1]


def test_qwen3_30b_on_8_gpus_fits_and_fsdp_with_ep_is_perfectly_sharded():
    """`plan --model qwen3-30b-a3b --gpus 8` (seq 8192): tp 4 x pp 2 with partial recompute fits 80 GB; fsdp with
    ep 8 stores 18 bytes x 30.5B / 8 = 68.7 GB of state, over 80 GB with the loss's 5 GB of logits at seq 8192."""
    model = get_preset("qwen3-30b-a3b")
    proposed = planned(4, 2, 1, 1, True, False, "full", 1, 512, recompute_layers=20)
    assert P.layout_memory(model, proposed, 8192).total <= 80 * GB
    ep8 = planned(1, 1, 1, 8, False, False, "full", 1, 512, ep=8, fsdp=True)
    assert P.static_memory(model, ep8) == pytest.approx(18 * num_params(model) / 8, rel=1e-6)
    assert P.layout_memory(model, ep8, 4096).total <= 80 * GB < P.layout_memory(model, ep8, 8192).total


def test_scout_on_16_h200s_fits_with_fsdp_and_ep():
    """`plan --model llama4-scout-17b-16e --gpus 16 --gpu h200`: fsdp x ep 8 x pp 2 with partial recompute fits in
    an H200's 139.8 GiB (150.1 GB); on 80 GB GPUs even perfect sharding needs 121 GB (the explanation's bound)."""
    model = get_preset("llama4-scout-17b-16e")
    h200 = resolve_hardware("h200").gpu.memory
    lay = planned(1, 2, 1, 8, False, False, "full", 1, 512, recompute_layers=22, ep=8, fsdp=True)
    assert P.layout_memory(model, lay, 8192).total <= h200
    assert 18 * num_params(model) / 16 > 80 * GB


def test_plan_of_a_fixed_fsdp_layout_explains_its_traffic(capsys):
    from llamatron.cli import main

    with pytest.raises(SystemExit) as done:
        main(["plan", "--model", "llama-1b", "--gpus", "8", "--fsdp", "--micro-batch-size", "1", "--explain"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "--fsdp traffic per rank and step:" in out and " fsdp " in out


def test_plan_llama3_8b_on_8_gpus_proposes_fsdp_and_explains_its_traffic(capsys):
    """The issue's target: `plan --model llama3.1-8b --gpus 8 --explain` at the default seq 8192 (stated) proposes
    --fsdp layouts; the closed-form ranking model (--no-simulate) ranks one first, suggests it as train flags and
    --explain prints its simulated traffic (the step simulator, plan's default ranking, puts a pipeline first:
    test_plan_ranking.py)."""
    from llamatron.cli import main

    with pytest.raises(SystemExit) as done:
        main(["plan", "--model", "llama3.1-8b", "--gpus", "8", "--explain", "--top", "3", "--no-simulate"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "seq 8192: the default" in out
    flags = out.split("#1 as `llamatron train` flags: ")[1].splitlines()[0]
    assert "--fsdp" in flags.split() and "--distributed-optimizer" not in flags
    assert "--fsdp traffic per rank and step:" in out
