"""Routing and balancing options of a mixture of experts (models/moe_balance.py), each against a formula written
out or transformers, and under a parallel layout against the single process (fp32, gloo): global-batch balancing,
DeepSeek-V3's balancing bias (with exact resumes), a capacity with token dropping; router statistics reduced on
logged steps only; the settings that cannot work refused in one line."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist_utils import spawn
from layout import assert_matches, run_train

from llamatron.errors import ConfigError
from llamatron.models import get_preset
from llamatron.models.families import family_of
from llamatron.models.moe import Experts, MoE, MoEBalance, MoEStats, router_losses
from llamatron.models.moe_balance import capacity_keep, expert_capacity, updated_expert_bias


def _moe(preset: str = "mixtral-test", seed: int = 0, **changes) -> MoE:
    """The MoE of the preset's family's first MoE layer (Llama 4's weights its experts' inputs)."""
    cfg = get_preset(preset).with_changes(changes)
    torch.manual_seed(seed)
    index = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    with torch.device("meta"):
        kind = type(family_of(cfg).block(cfg, index).mlp)
    moe = kind(cfg)
    for name, p in moe.named_parameters():
        if name != "expert_bias":
            torch.nn.init.normal_(p, std=0.1)
    return moe


# --- global-batch balancing -------------------------------------------------------------------------------------


def test_global_batch_loss_is_transformers_qwen3_moe_loss_over_the_concatenated_batch():
    """The micro-batches' per-sequence terms, with the global batch's expert loads, average to transformers'
    load_balancing_loss_func over all the batch's router logits at once (one layer); per sequence they do not."""
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    E, k, seq = 8, 2, 16
    gen = torch.Generator().manual_seed(3)
    # 6 sequences in 3 micro-batches; sequences routed unevenly, so per-sequence and global balance differ
    logits = torch.randn(6 * seq, E, generator=gen) + torch.linspace(0, 2, E) * torch.randn(6, 1, 1).repeat_interleave(
        seq, 0
    ).view(-1, 1)
    probs = torch.softmax(logits, -1)
    chosen = probs.topk(k, -1).indices
    load = torch.bincount(chosen.reshape(-1), minlength=E).float()  # the routing pass's counts
    parts = [
        router_losses(logits[i : i + 2 * seq], probs[i : i + 2 * seq], chosen[i : i + 2 * seq], 2, E, load)[0]
        for i in range(0, 6 * seq, 2 * seq)
    ]
    ours = torch.cat(parts).sum() / 6
    theirs = qwen3_moe.load_balancing_loss_func((logits,), E, k)
    assert torch.allclose(ours, theirs, rtol=1e-6), (ours, theirs)
    per_sequence = router_losses(logits, probs, chosen, 6, E)[0].mean()
    assert abs(per_sequence - theirs) > 1e-3  # the option is what makes it agree


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("balancing")
    (path / "global.yaml").write_text(
        "model_overrides:\n  router_aux_loss_scope: global_batch\n  router_aux_loss_coef: 0.5\n"
    )
    (path / "bias.yaml").write_text("model_overrides:\n  router_expert_bias: true\n  router_bias_update_rate: 0.05\n")
    (path / "capacity.yaml").write_text("model_overrides:\n  moe_capacity_factor: 0.5\n")
    return path


def test_global_batch_balancing_is_the_whole_batchs_at_any_layout(workdir):
    """One micro-batch of the whole global batch (f counted at once) = dp 2 x ep 2 with 2 accumulated micro-batches
    on each rank: every logged field (loss, gradient norm, the router statistics, ...)."""
    whole = run_train(["--config", "global.yaml", "--micro-batch-size", "8"], 1, workdir, model="qwen3-moe-test")
    split = run_train(["--config", "global.yaml", "--ep", "2"], 2, workdir, model="qwen3-moe-test")
    assert_matches(whole, split)


# --- DeepSeek-V3's balancing bias -------------------------------------------------------------------------------


def test_bias_picks_the_experts_and_the_unbiased_scores_weigh_them():
    """Softmax routing (Mixtral) and sigmoid (Llama 4): top-k of score + bias, gate weights from the scores alone."""
    for preset in ("mixtral-test", "llama4-test"):
        moe = _moe(preset, router_expert_bias=True)
        sigmoid = moe.sigmoid_scores
        x = torch.randn(10, moe.router.in_features)
        logits = moe.router(x)
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, -1)
        with torch.no_grad():
            moe.expert_bias.copy_(torch.tensor([5.0, -5.0] + [0.0] * (moe.num_experts - 2)))
        top, chosen = moe._choose(logits, torch.softmax(logits, -1))
        assert (chosen == 0).any(-1).all() and not (chosen == 1).any()  # the bias decided
        assert torch.equal(top, scores.gather(-1, chosen))  # ... and did not enter the weights


def test_bias_update_rule_written_out():
    """bias_e += rate · sign(mean load − load_e): up for the under-loaded, down for the over-loaded, still at the
    mean; the loads the trainer gives it are each layer's, summed over the step's micro-batches."""
    bias = torch.tensor([0.1, 0.0, -0.2, 0.0])
    load = torch.tensor([10.0, 2.0, 4.0, 4.0])  # mean 5
    expected = torch.tensor([0.1 - 1e-3, 0.0 + 1e-3, -0.2 + 1e-3, 0.0 + 1e-3])
    assert torch.equal(updated_expert_bias(bias, load, 1e-3), expected)
    assert torch.equal(updated_expert_bias(bias, torch.full((4,), 3.0), 1e-3), bias)


def _bias_rows(ckpt) -> dict[str, torch.Tensor]:
    from llamatron.checkpoint.reader import load_full_tensors

    return {k: v for k, v in load_full_tensors(ckpt).items() if k.endswith("expert_bias")}


def test_bias_balancing_under_ep_and_resume_is_exact(workdir):
    """dp 2 x ep 2 trains as the single process (the bias moves the same on every rank: loads reduced over the
    ranks); a resume from step 3 is bitwise the uninterrupted run (the bias is in the checkpoint), and one from the
    ep 2 run's step 3 in one process equals it too. (At this rate the bias oscillates: it is 0 again after step 2.)"""
    bias = ["--config", "bias.yaml", "--save-interval", "3"]
    whole = run_train([*bias, "--save", "whole"], 1, workdir, model="mixtral-test")
    split = run_train([*bias, "--ep", "2", "--save", "split"], 2, workdir, model="mixtral-test")
    assert_matches(whole, split)
    moved = _bias_rows(workdir / "whole" / "step-5")
    assert len(moved) == 2 and all(v.abs().max() > 0 for v in moved.values())
    for v in moved.values():  # each entry is the rate times a sum of five signs
        assert torch.allclose(v / 0.05, (v / 0.05).round(), atol=1e-4)
    for name, v in _bias_rows(workdir / "split" / "step-5").items():
        assert torch.equal(v, moved[name])
    assert any(v.abs().max() > 0 for v in _bias_rows(workdir / "whole" / "step-3").values())  # resumes need it
    resumed = run_train(["--config", "bias.yaml", "--load", "whole/step-3"], 1, workdir, model="mixtral-test")
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in whole[3:]]
    resharded = run_train(["--config", "bias.yaml", "--load", "split/step-3"], 1, workdir, model="mixtral-test")
    assert_matches(whole[3:], resharded)


# --- capacity -----------------------------------------------------------------------------------------------------


def test_capacity_rule_written_out_with_ties_and_an_empty_expert():
    """One sequence of 6 tokens, k 1, 3 experts, factor 1: capacity ceil(1 · 6 · 1 / 3) = 2. Expert 0 gets 4
    assignments, expert 1 two, expert 2 none. By weight: expert 0 keeps its two heaviest, the tie between tokens
    2 and 4 (both 0.7) going to the earlier; by position: its first two."""
    assert expert_capacity(1.0, 6, 1, 3) == 2 and expert_capacity(1.25, 4096, 8, 128) == 320
    chosen = torch.tensor([[0], [1], [0], [0], [0], [1]])
    weights = torch.tensor([[0.5], [0.9], [0.7], [0.9], [0.7], [0.2]])
    by_weight = capacity_keep(chosen, weights, 1, 2, "probs", 3).view(-1).tolist()
    assert by_weight == [False, True, True, True, False, True]
    by_position = capacity_keep(chosen, weights, 1, 2, "position", 3).view(-1).tolist()
    assert by_position == [True, True, True, False, False, True]
    # per sequence: two sequences are two groups, each with its own capacity
    two = capacity_keep(chosen.repeat(2, 1), weights.repeat(2, 1), 2, 2, "probs", 3).view(-1).tolist()
    assert two == by_weight * 2


def _reference_with_drops(moe: MoE, x: torch.Tensor, capacity: int) -> torch.Tensor:
    """Mixtral's block token by token, an assignment counted only while its expert has room in the sequence,
    taken in order of routing weight (ties: earlier token first)."""
    probs = torch.softmax(moe.router(x), -1)
    top, chosen = probs.topk(moe.top_k, -1)
    top = top / top.sum(-1, keepdim=True)
    assignments = sorted(
        ((-top[t, j].item(), t, j) for t in range(x.shape[0]) for j in range(moe.top_k)), key=lambda a: (a[0], a[1])
    )
    taken = [0] * moe.num_experts
    out = torch.zeros_like(x)
    e = moe.experts
    for _, t, j in assignments:
        i = int(chosen[t, j])
        if taken[i] == capacity:
            continue
        taken[i] += 1
        gate, up = F.linear(x[t], e.gate_up[i]).chunk(2)
        out[t] += top[t, j] * F.linear(F.silu(gate) * up, e.down[i])
    return out


def test_capacity_drops_assignments_as_the_rule_says():
    moe = _moe(moe_capacity_factor=0.5)
    moe.stats, moe.router_loss_weight = MoEStats.zeros(moe.num_experts, torch.device("cpu")), torch.tensor(1.0)
    x = torch.randn(2, 24, 64)
    cap = expert_capacity(0.5, 24, moe.top_k, moe.num_experts)
    out = moe(x)
    for b in range(2):
        assert torch.allclose(out[b], _reference_with_drops(moe, x[b], cap), atol=1e-5)
    dropless = _moe()
    assert not torch.allclose(dropless(x), out, atol=1e-3)  # something was dropped
    # what is logged as moe_dropped_fraction (times the choices): each expert's assignments past its capacity
    _, chosen = torch.softmax(moe.router(x), -1).topk(moe.top_k, -1)
    over = sum(max(0, int((chosen[b] == e).sum()) - cap) for b in range(2) for e in range(moe.num_experts))
    assert over > 0 and moe.stats.dropped.item() == over and moe.stats.choices.sum().item() == 2 * 24 * moe.top_k


def test_capacity_under_expert_parallelism_matches_single_process(workdir):
    cap = ["--config", "capacity.yaml"]
    whole = run_train(cap, 1, workdir, model="mixtral-test")
    split = run_train([*cap, "--ep", "2"], 2, workdir, model="mixtral-test")
    assert_matches(whole, split)
    assert all(0 < r["moe_dropped_fraction"] < 1 for r in whole)
    assert [r["moe_dropped_fraction"] for r in split] == pytest.approx([r["moe_dropped_fraction"] for r in whole])


@pytest.fixture(scope="module")
def every_option(workdir):
    """Llama 4 with every balancing option, one micro-batch of the whole batch: (its records, the config's flags)."""
    (workdir / "all.yaml").write_text(
        "model_overrides:\n  router_aux_loss_scope: global_batch\n  router_expert_bias: true\n"
        "  router_bias_update_rate: 0.05\n  moe_capacity_factor: 0.75\n  moe_token_drop_policy: position\n"
    )
    flags = ["--config", "all.yaml"]
    return run_train([*flags, "--micro-batch-size", "8"], 1, workdir, model="llama4-test"), flags


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (4, ["--ep", "2", "--tp", "2", "--sequence-parallel"]),
        # whole experts, each tp rank routing its sequence shard: the shares, mean probabilities, global counts,
        # bias loads and the capacity's choice are the whole sequences' (summed or gathered over tp)
        (2, ["--tp", "2", "--sequence-parallel", "--etp", "1"]),
    ],
)
def test_every_option_together_on_llama4_at_tp_2_with_sequence_parallelism(workdir, every_option, nproc, layout):
    """Llama 4 (sigmoid scores weighting each expert's input, a shared expert) with global-batch balancing, the bias
    and a capacity dropping by position, one micro-batch of the whole batch against tp 2 + sp layouts with 2
    accumulated micro-batches (the capacity's groups are sequences: the same drops)."""
    whole, flags = every_option
    split = run_train([*flags, *layout], nproc, workdir, model="llama4-test")
    assert_matches(whole, split)
    drops = [r["moe_dropped_fraction"] for r in whole]
    assert all(0 < d < 1 for d in drops) and [r["moe_dropped_fraction"] for r in split] == pytest.approx(drops)


def test_capacity_with_weighted_inputs_llama4():
    """Llama 4 routes (token, choice) rows: a dropped row contributes nothing, kept ones as without capacity."""
    moe = _moe("llama4-test", moe_capacity_factor=0.5)
    x = torch.randn(1, 16, moe.router.in_features)
    with_cap = moe(x)[0]
    moe.capacity_factor = None
    dropless = moe(x)[0] - moe.shared(x[0])
    logits = moe.router(x[0])
    top, chosen = logits.topk(moe.top_k, -1)
    weights = torch.sigmoid(top)
    capacity = expert_capacity(0.5, 16, moe.top_k, moe.num_experts)
    keep = capacity_keep(chosen, weights, 1, capacity, "probs", moe.num_experts)
    assert not keep.all()
    kept_only = dropless * keep.any(-1, keepdim=True)  # top-1: a token is kept or dropped whole
    assert torch.allclose(with_cap - moe.shared(x[0]), kept_only, atol=1e-5)


# --- router statistics only on logged steps ----------------------------------------------------------------------


def _count_collectives(rank: int, world: int, out) -> None:
    from llamatron.config.settings import config_from_values
    from llamatron.data.batches import micro_batches_for_rank
    from llamatron.data.mock import MockDataset
    from llamatron.parallel.mesh import build_mesh
    from llamatron.training.engine import build_engine, train_step
    from llamatron.training.metrics import objective_fields
    from llamatron.training.validate import validate

    values = {"model": "mixtral-test", "device": "cpu", "precision": "fp32", "seq_length": 16}
    cfg = config_from_values({**values, "micro_batch_size": 1, "global_batch_size": 4})
    mesh = build_mesh()
    engine = build_engine(cfg, validate(cfg, world), mesh)
    data = MockDataset(engine.model_cfg.vocab_size, 16, 0)
    calls = []
    real = torch.distributed.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    torch.distributed.all_reduce = counting
    router, counts = engine.objective.router, []
    for step, attached in enumerate((router, None, router)):
        engine.objective.router = attached  # None: no router statistics at all
        calls.clear()
        step_out = train_step(engine, micro_batches_for_rank(data, 4 * step, 4, 1, mesh), step)
        counts.append(len(calls))
    fields = objective_fields(engine, step_out)  # the last step's, as if logged: one reduction
    if rank == 0:
        out.put((counts, len(calls) - counts[2], fields["expert_token_share"]))


def test_router_statistics_are_reduced_only_on_logged_steps():
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    spawn(_count_collectives, 2, queue)
    (with_router, without, again), logged_extra, share = queue.get()
    assert with_router == without == again  # a step that is not logged issues no collective for the statistics
    assert logged_extra == 1  # logging the step reduces them once
    assert math.isclose(sum(share), 1.0, rel_tol=1e-6)


# --- bad settings ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, message",
    [
        ({"model_overrides": {"experts_per_token": 5}}, "experts_per_token 5 must be in 1..num_experts"),
        ({"model_overrides": {"moe_capacity_factor": 0}}, "moe_capacity_factor 0 must be > 0"),
        ({"model_overrides": {"moe_capacity_factor": -1.5}}, "moe_capacity_factor -1.5 must be > 0"),
        # an overflow in the first forward's capacity (ceil of inf), refused before: at most num_experts
        ({"model_overrides": {"moe_capacity_factor": 1e308}}, r"moe_capacity_factor 1e\+308 must be at most num_exp"),
        ({"model_overrides": {"moe_capacity_factor": 4.5}}, r"moe_capacity_factor 4.5 must be at most num_experts \(4"),
        ({"model_overrides": {"moe_token_drop_policy": "random"}}, "moe_token_drop_policy 'random' must be one of"),
        ({"model_overrides": {"moe_token_drop_policy": "position"}}, "needs a capacity"),
        ({"model_overrides": {"router_aux_loss_scope": "batch"}}, "router_aux_loss_scope 'batch' must be one of"),
        ({"model_overrides": {"router_bias_update_rate": 0.01}}, "router_bias_update_rate needs router_expert_bias"),
        (
            {"model_overrides": {"router_expert_bias": True, "router_bias_update_rate": 0}},
            "router_bias_update_rate 0 must be > 0",
        ),
        ({"ep": 3}, "num_experts 4 is not divisible by --ep 3"),
        ({"model": "qwen3-moe-test", "model_overrides": {"router_score": "sigmoid"}}, "qwen family's layers have no"),
        ({"model_overrides": {"router_expert_bias": True}, "lora_rank": 8}, "LoRA"),
        ({"model_overrides": {"router_expert_bias": True}, "fsdp": True}, "--fsdp"),
        ({"model": "llama-test", "model_overrides": {"moe_capacity_factor": 1.0}}, "this model is dense"),
    ],
)
def test_bad_balancing_settings_are_one_line_errors(values, message):
    from llamatron.config.settings import config_from_values
    from llamatron.training.validate import validate

    base = {"model": "mixtral-test", "mock_data": True, "device": "cpu", "global_batch_size": 48}
    cfg = config_from_values({**base, **values})
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg, world_size=12)
    assert "\n" not in str(err.value)


def test_balance_buffers_are_one_row_a_layer():
    """RouterTraining gives each MoE layer of the rank its row of the step's loads."""
    from llamatron.models import build_model, materialize
    from llamatron.objectives.language_model import RouterTraining

    cfg = get_preset("mixtral-test").with_changes({"router_expert_bias": True})
    model = materialize(build_model(cfg), cfg, 0, "cpu", torch.float32)
    run = RouterTraining.attach([model], cfg, torch.device("cpu"))
    assert isinstance(run.balance, MoEBalance) and run.balance.loads.shape == (cfg.num_moe_layers, cfg.num_experts)
    assert model.layers["0"].mlp.expert_bias.dtype == torch.float32


@pytest.mark.parametrize("changes", [{}, {"router_expert_bias": True, "router_aux_loss_scope": "global_batch"}])
def test_moe_layers_share_one_compiled_graph(changes, monkeypatch):
    """Every layer's compiled forward runs the graph traced for the first (one more for the global-batch routing
    pass): nothing per layer that torch.compile guards on (a per-layer int row index recompiled each layer, and past
    the 8th layer those ran eagerly: an 8% slower step on the GPU)."""
    import torch._dynamo

    from llamatron.models import build_model, materialize
    from llamatron.objectives.language_model import RouterTraining
    from llamatron.parallel.mesh import build_mesh

    cfg = get_preset("mixtral-test4").with_changes(changes)
    model = materialize(build_model(cfg), cfg, 0, "cpu", torch.float32)
    run = RouterTraining.attach([model], cfg, torch.device("cpu"))
    assert run is not None
    run.begin_step(sequences=2, loss_scale=None)
    # the experts' CPU reference loop reads the counts on the host: eager here (the GPU's grouped GEMMs trace whole)
    monkeypatch.setattr(Experts, "project", torch.compiler.disable(Experts.project))
    torch._dynamo.reset()
    for layer in model.layers.values():
        layer.forward = torch.compile(layer.forward, backend="eager", dynamic=False)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    mesh = build_mesh()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):  # the first layer's graph serves them all
            model(tokens).float().sum().backward()
        if run.global_batch:
            run.route_global_batch(lambda: model(tokens), mesh)  # no gradient: one more graph (allowed to trace)
            with torch._dynamo.config.patch(error_on_recompile=True):  # ... and again, for every layer, none
                run.route_global_batch(lambda: model(tokens), mesh)
                model(tokens).float().sum().backward()
    finally:
        torch._dynamo.reset()
    per_layer = 2 * 16 * cfg.experts_per_token
    assert run.balance.loads.sum(1).tolist() == [(2 if run.global_batch else 1) * per_layer] * cfg.num_moe_layers
    if run.global_batch:
        assert run.balance.global_loads is not None
        assert run.balance.global_loads.sum(1).tolist() == [2 * per_layer] * cfg.num_moe_layers


def _compiled_layer_variants(cfg, monkeypatch) -> int:
    """How many frames torch.compile compiles for a training step of `cfg` whose decoder layers are compiled (each
    layer's forward, and the frames it resumes in after a graph break, once per variant)."""
    from torch._dynamo.utils import counters

    from llamatron.models import build_model, materialize
    from llamatron.objectives.language_model import RouterTraining

    monkeypatch.setattr(Experts, "project", torch.compiler.disable(Experts.project))  # the CPU loop: eager
    model = materialize(build_model(cfg), cfg, 0, "cpu", torch.float32)
    run = RouterTraining.attach([model], cfg, torch.device("cpu"))
    if run is not None:
        run.begin_step(sequences=2, loss_scale=None)
    torch._dynamo.reset()
    counters.clear()
    for layer in model.layers.values():
        layer.forward = torch.compile(layer.forward, backend="eager", dynamic=False)
    try:
        model(torch.randint(0, cfg.vocab_size, (2, 16))).float().sum().backward()
        return counters["frames"]["ok"]
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("preset", ["mixtral-test4", "qwen3-moe-test", "qwen2-moe-test", "llama4-test", "llama-test4"])
def test_compiled_layers_do_not_recompile_per_layer(preset, monkeypatch):
    """Twice the layers, no more compiled frames: what differs between layers is their kind (dense or MoE, NoPE,
    chunked), never their index (past torch.compile's limit of 8 recompilations, layers run eagerly)."""
    cfg = get_preset(preset)
    variants = _compiled_layer_variants(cfg, monkeypatch)
    assert variants == _compiled_layer_variants(cfg.with_changes({"num_layers": 2 * cfg.num_layers}), monkeypatch)
    assert variants > 0


def test_export_of_a_model_with_the_balancing_bias_is_refused():
    from llamatron.errors import HFConversionError
    from llamatron.interop.hf import config_to_hf

    for preset in ("mixtral-test", "qwen3-moe-test", "llama4-test"):
        config_to_hf(get_preset(preset))  # without the bias: exported
        with pytest.raises(HFConversionError, match="no tensor for the balancing bias"):
            config_to_hf(get_preset(preset).with_changes({"router_expert_bias": True}))


def test_megatron_bias_update_rate_flag_sets_the_option():
    import argparse

    from llamatron.config.settings import add_config_arguments, load_config

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg = load_config(parser.parse_args(["--model", "mixtral-test", "--moe-router-bias-update-rate", "0.01"]))
    assert cfg.model_config().router_bias_update_rate == 0.01
