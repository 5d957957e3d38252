"""Pipeline parallelism: stage split, schedules, activation bound, and layouts matching the single-process run."""

from __future__ import annotations

import json
import os
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from layout import assert_matches, free_port, run_train

from llamatron.config.settings import ConfigError, config_from_values
from llamatron.models import build_model, get_preset
from llamatron.parallel.layout import LayoutChoice, ParallelLayout
from llamatron.parallel.mesh import Mesh
from llamatron.parallel.pipeline import build_stage_chunks, split_layers
from llamatron.parallel.schedules import build_program, check_micro_batches, max_alive, output_message, rank_order
from llamatron.training.validate import validate

# ---- stage split -----------------------------------------------------------------------------------


def test_split_layers_balanced_explicit_and_errors():
    assert split_layers(8, 2) == [4, 4]
    assert split_layers(8, 2, vpp=2) == [2, 2, 2, 2]
    assert split_layers(7, 2, pp_layers="3,4") == [3, 4]
    with pytest.raises(ConfigError, match="not divisible by pp\\*vpp"):
        split_layers(6, 4)
    with pytest.raises(ConfigError, match="4 positive counts"):
        split_layers(8, 2, vpp=2, pp_layers="4,4")
    with pytest.raises(ConfigError, match="summing to 8"):
        split_layers(8, 2, pp_layers="4,5")
    with pytest.raises(ConfigError, match="--vpp needs --pp"):
        split_layers(8, 1, vpp=2)


def _config(**values):
    base = dict(model="llama-test4", mock_data=True, device="cpu", micro_batch_size=1, global_batch_size=8)
    return config_from_values({**base, **values})


def test_config_rejects_pipeline_layouts_that_cannot_run():
    with pytest.raises(ConfigError, match="--vpp needs --pp"):
        validate(_config(vpp=2), world_size=1)
    with pytest.raises(ConfigError, match="not divisible by pp\\*vpp"):
        validate(_config(pp=3), world_size=3)
    with pytest.raises(ConfigError, match="multiple of pp=2"):  # 1 micro-batch per step, groups of 2 needed
        validate(_config(pp=2, vpp=2, global_batch_size=1), world_size=2)
    with pytest.raises(ConfigError, match="groups of pp=2"):
        check_micro_batches(3, pp=2, vpp=2)
    with pytest.raises(ConfigError, match="at least one micro-batch"):
        check_micro_batches(0, pp=2, vpp=1)


@pytest.mark.parametrize("model_name", ["llama-test4", "falcon-test4"])
@pytest.mark.parametrize("pp,vpp,pp_layers", [(2, 1, None), (4, 1, None), (2, 2, None), (2, 1, "1,3")])
def test_stage_chunks_hold_every_parameter_once_under_its_global_name(model_name, pp, vpp, pp_layers):
    full = build_model(get_preset(model_name))
    expected = {name: tuple(p.shape) for name, p in full.named_parameters()}
    split = split_layers(len(full.layers), pp, vpp, pp_layers)
    seen: Counter = Counter()
    for rank in range(pp):
        chunks, specs = build_stage_chunks(
            get_preset(model_name), Mesh(ParallelLayout(pp=pp), pp_rank=rank), vpp=vpp, pp_layers=pp_layers
        )
        assert len(chunks) == vpp
        for v, (chunk, chunk_specs) in enumerate(zip(chunks, specs)):
            c = v * pp + rank
            assert len(chunk.layers) == split[c]
            assert chunk.is_first_stage == (c == 0) and chunk.is_last_stage == (c == pp * vpp - 1)
            for local, p in chunk.named_parameters():
                name = chunk_specs[local].global_name
                assert expected[name] == tuple(p.shape), (local, name)
                if not chunk_specs[local].shared_replica:
                    assert local == name  # layers keep their global index: a stage's names are the global names
                    seen[name] += 1
            if c == pp * vpp - 1 and chunk.lm_head is not None and full.lm_head is None:
                assert chunk_specs["lm_head.weight"].global_name == "embed.weight"  # the tied head is the embedding
                assert chunk.head_weight() is chunk.lm_head.weight
    assert seen == Counter(expected.keys())


# ---- schedules --------------------------------------------------------------------------------------


SCHEDULE_CASES = [
    (pp, vpp, m) for pp in (2, 3, 4) for vpp in (1, 2, 3) for m in (1, 2, 3, 4, 6, 8, 12) if vpp == 1 or m % pp == 0
]


@pytest.mark.parametrize("pp,vpp,num_mb", SCHEDULE_CASES)
def test_schedule_runs_every_pass_once_within_the_activation_bound(pp, vpp, num_mb):
    for rank in range(pp):
        order = rank_order(pp, vpp, rank, num_mb)
        expected = {(f, v * pp + rank, m) for f in (True, False) for v in range(vpp) for m in range(num_mb)}
        assert sorted((a.forward, a.chunk, a.micro_batch) for a in order) == sorted(expected)
        alive, peak = set(), 0
        for a in order:
            key = (a.chunk, a.micro_batch)
            if a.forward:
                alive.add(key)
            else:
                assert key in alive, f"backward of {key} before its forward"
                alive.remove(key)
            peak = max(peak, len(alive))
        # 1F1B: pp - rank micro-batches; interleaved: pp*vpp chunk activations (= pp stages' worth of memory)
        assert peak == max_alive(pp, vpp, rank, num_mb) <= min(pp * vpp, num_mb * vpp)


@pytest.mark.parametrize("pp,vpp,num_mb", [(2, 1, 4), (4, 1, 8), (4, 1, 2), (2, 2, 4), (4, 2, 8), (3, 3, 6)])
@pytest.mark.parametrize("forward_only", [False, True])
def test_programs_pair_every_message_in_matching_batches_in_one_order(pp, vpp, num_mb, forward_only):
    """Both ends of a message sit in batches holding the same messages between that pair; ticks only increase."""
    programs = {r: build_program(pp, vpp, num_mb, r, forward_only) for r in range(pp)}
    rounds = {r: [rd for step in programs[r] for rd in step.rounds] for r in range(pp)}
    for r in range(pp):
        ticks = [rd.tick for rd in rounds[r]]
        assert ticks == sorted(set(ticks))
        for p in range(pp):
            mine = [(rd.tick, [m for m in rd.messages if p in (m.src, m.dst) and m.src != m.dst]) for rd in rounds[r]]
            theirs = [(rd.tick, [m for m in rd.messages if r in (m.src, m.dst)]) for rd in rounds[p]]
            assert [x for x in mine if x[1]] == [x for x in theirs if x[1]], (r, p)
    expected = sum(output_message(a, pp, pp * vpp) is not None for a in rank_order(pp, vpp, 0, num_mb, forward_only))
    for r in range(pp):
        produced, sent = set(), 0
        for step in programs[r]:
            for m in (m for rd in step.rounds for m in rd.messages if m.src == r):
                assert m in produced, f"rank {r} sends {m} before computing it"
                sent += 1
            if step.action is not None:
                out = output_message(step.action, pp, pp * vpp)
                if out is not None:
                    produced.add(out)
        assert sent == len(produced)
    assert expected > 0


# ---- activations alive during a real step (4 gloo processes) ------------------------------------------


ALIVE_LAYOUTS = [("llama-test4", 4, 1), ("llama-test4", 2, 2), ("falcon-test4", 2, 2)]  # (model, pp, vpp), world 4


def _alive_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from llamatron.data.batches import micro_batches_for_step
    from llamatron.data.mock import MockDataset
    from llamatron.parallel.mesh import build_mesh
    from llamatron.training.engine import build_engine, train_step
    from llamatron.training.evaluation import evaluate

    results = []
    for model, pp, vpp in ALIVE_LAYOUTS:
        cfg = _config(model=model, pp=pp, vpp=vpp, seq_length=16, bucket_size=2000, precision="fp32")
        derived = validate(cfg, world)
        mesh = build_mesh(LayoutChoice(pp=pp))
        engine = build_engine(cfg, derived, mesh)
        alive, peak, kept_outputs = [0], [0], [0]

        def count(_module, _args, out):
            if not out.requires_grad:  # the evaluation below: no backward to wait for
                return
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
            sent = out.dim() > 0  # a stage output (the last stage returns the loss)
            ref = weakref.ref(out)

            def backward_begins(grad):
                alive[0] -= 1
                kept_outputs[0] += sent and ref() is not None  # the scheduler still held the sent output

            out.register_hook(backward_begins)

        for chunk in engine.chunks:
            chunk.register_forward_hook(count)
        data = MockDataset(engine.model_cfg.vocab_size, 16, 0)
        mbs = micro_batches_for_step(data, 0, 8, 1, mesh.layout.dp, mesh.dp_rank)
        out = train_step(engine, mbs, 0)
        results.append(
            {
                "pp_rank": mesh.pp_rank,
                "num_mb": len(mbs),
                "peak": peak[0],
                "alive_after": alive[0],
                "kept_outputs": kept_outputs[0],
                "loss": float(out["loss"]),
                "grad_norm": float(out["grad_norm"]),
                "reductions": [b.stats.grad_reductions for b in engine.buffers],
                "buckets": [len(b.buckets) for b in engine.buffers],
                "eval": evaluate(engine, data, 1, metrics=["accuracy"]),
            }
        )
    Path(out_dir, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_activations_alive_per_rank_stay_within_the_1f1b_bound(tmp_path):
    world = 4
    mp.spawn(_alive_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    results = [json.loads(Path(tmp_path, f"{r}.json").read_text()) for r in range(world)]
    for i, (model, pp, vpp) in enumerate(ALIVE_LAYOUTS):
        for rank in range(world):
            r = results[rank][i]
            # Counted from forward hooks and output-gradient hooks, independently of the scheduler's bookkeeping.
            assert r["alive_after"] == 0
            assert r["kept_outputs"] == 0  # sent outputs are freed, not held until their backward
            assert r["peak"] == max_alive(pp, vpp, r["pp_rank"], r["num_mb"]) <= pp * vpp, (model, pp, vpp, r)
            # Every gradient bucket is reduced exactly once per step (dp > 1), whatever the micro-batch count.
            if world // pp > 1:
                assert r["reductions"] == r["buckets"] and min(r["buckets"]) > 1, r
        losses = {results[rank][i]["loss"] for rank in range(world) if results[rank][i]["pp_rank"] == pp - 1}
        assert all(results[rank][i]["loss"] == 0 for rank in range(world) if results[rank][i]["pp_rank"] < pp - 1)
        assert len({results[rank][i]["grad_norm"] for rank in range(world)}) == 1, "grad norm differs across ranks"
        # evaluation runs on the last stage; every rank gets its result
        evals = [results[rank][i]["eval"] for rank in range(world)]
        assert all(e == evals[0] for e in evals) and evals[0]["loss"] > 0, evals
        assert all(loss > 0 for loss in losses)


# ---- layouts against the single-process run ------------------------------------------------------------


def _eval_records(workdir: Path) -> list[dict]:
    (path,) = workdir.glob("metrics-*.jsonl")
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") == "valid"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process runs, one per model, shared by the layout tests."""
    cache: dict[str, tuple[list[dict], list[dict]]] = {}

    def get(model: str) -> tuple[list[dict], list[dict]]:
        if model not in cache:
            workdir = tmp_path_factory.mktemp(f"ref-{model}")
            cache[model] = (run_train([], 1, workdir, model=model), _eval_records(workdir))
        return cache[model]

    return get


LAYOUTS = {
    "pp2": (["--pp", "2"], 2, "llama-test4"),
    "pp4": (["--pp", "4"], 4, "llama-test4"),
    "pp2-vpp2": (["--pp", "2", "--vpp", "2"], 2, "llama-test4"),
    "pp2-uneven": (["--pp", "2", "--pp-layers", "1,3"], 2, "llama-test4"),
    "pp2-dp2-distopt": (["--pp", "2", "--distributed-optimizer", "--bucket-size", "20000"], 4, "llama-test4"),
    "falcon-pp2": (["--pp", "2"], 2, "falcon-test4"),
    "falcon-pp2-vpp2-dp2-distopt": (
        ["--pp", "2", "--vpp", "2", "--micro-batch-size", "1", "--distributed-optimizer"],
        4,
        "falcon-test4",
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_layout_matches_single_process(name, reference, tmp_path):
    args, nproc, model = LAYOUTS[name]
    ref_steps, ref_eval = reference(model)
    assert_matches(ref_steps, run_train(args, nproc, tmp_path, model=model))
    assert_matches(ref_eval, _eval_records(tmp_path))


def test_custom_eval_metrics_under_pipeline_parallelism_match_single_process(tmp_path):
    """A metric registered by the user's module (MODULE:NAME) is computed on the last stage and reaches every
    rank: pp 2 x dp 2 gives the single process's values, the built-in ones too."""
    module = (
        "from llamatron.training.evaluation import register_eval_metric\n"
        "@register_eval_metric('label_is_even')\n"
        "def label_is_even(batch):\n    return batch.labels % 2 == 0\n"
        "@register_eval_metric('first_token_loss')\n"
        "def first_token_loss(batch):  # a (numerator, denominator) metric\n"
        "    return batch.loss[:, 0].sum(), batch.valid[:, 0].sum()\n"
    )
    args = ["--eval-metrics", "perplexity", "accuracy", "my_metrics:label_is_even", "my_metrics:first_token_loss"]
    records = []
    for layout, nproc in (([], 1), (["--pp", "2", "--distributed-optimizer"], 4)):
        workdir = tmp_path / f"n{nproc}"
        workdir.mkdir()
        (workdir / "my_metrics.py").write_text(module)
        run_train(args + layout, nproc, workdir, model="llama-test4")
        records.append(_eval_records(workdir))
    keys = ("loss", "perplexity", "accuracy", "label_is_even", "first_token_loss")
    assert all(set(keys) <= set(r) for r in records[1])
    assert 0 < records[1][-1]["label_is_even"] < 1
    assert_matches(records[0], records[1])


def test_tensor_x_pipeline_x_data_parallel_matches_single_process(reference, tmp_path):
    args = ["--tp", "2", "--pp", "2", "--sequence-parallel", "--distributed-optimizer"]  # dp = 8 / (2*2) = 2
    ref_steps, ref_eval = reference("llama-test4")
    assert_matches(ref_steps, run_train(args, 8, tmp_path, model="llama-test4", timeout=600))
    assert_matches(ref_eval, _eval_records(tmp_path))


def test_public_command_pp2_tp2_on_llama_tiny_matches_single_process(reference, tmp_path):
    ref_steps, _ = reference("llama-tiny")
    assert_matches(ref_steps, run_train(["--pp", "2", "--tp", "2"], 4, tmp_path, model="llama-tiny"))
