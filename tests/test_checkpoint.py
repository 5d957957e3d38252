"""Checkpoints that ignore layout (issue 6, parts 1-2): pieces, exact resume, resume across layouts, atomic and
async saves, export from a sharded checkpoint."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from layout import assert_matches, run_train

from llamatron.checkpoint.pieces import contiguous_blocks, local_pieces
from llamatron.checkpoint.reader import CheckpointReader, load_full_tensors
from llamatron.models import build_model, get_preset
from llamatron.parallel.layout import ParallelLayout
from llamatron.parallel.mesh import Mesh
from llamatron.parallel.param_spec import ParamSpec, param_specs
from llamatron.parallel.tensor import apply_tensor_parallel

SAVE_2_AND_4 = ["--train-steps", "4", "--save-interval", "2"]


def _slices(box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def _records(workdir: Path) -> list[dict]:
    """The step records of the one run in `workdir` (also when it failed)."""
    (path,) = workdir.glob("metrics-*.jsonl")
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") is None]


def _losses(records: list[dict], steps) -> list[float]:
    return [r["loss"] for r in records if r["step"] in steps]


def assert_same_state(a: Path, b: Path, rtol: float = 1e-4) -> None:
    """Weights, AdamW moments and step counts of two checkpoints agree (relative to each tensor's scale)."""
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    for kind in ("model", "exp_avg", "exp_avg_sq", "step"):
        assert ra.names(kind) == rb.names(kind) != set(), kind
        for name in ra.names(kind):
            x, y = ra.read(kind, name).float(), rb.read(kind, name).float()
            assert (x - y).abs().max() <= rtol * x.abs().max(), (kind, name)


# ---- pieces: where each rank's part lies in the full tensor (no processes) -----------------------------------


@pytest.mark.parametrize("start, end", [(0, 60), (7, 8), (3, 47), (20, 40), (19, 41), (0, 5), (59, 60), (5, 25)])
def test_contiguous_blocks_are_the_flat_range_in_order(start, end):
    shape = (3, 4, 5)
    flat = torch.arange(60)
    blocks = contiguous_blocks(shape, start, end)
    pos = start
    for flat_start, offsets, sizes in blocks:
        assert flat_start == pos
        n = math.prod(sizes)
        assert torch.equal(
            flat.view(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1), flat[pos : pos + n]
        )
        pos += n
    assert pos == end and len(blocks) <= 2 * (len(shape) - 1) + 1


def _sharded_specs(preset: str, tp: int) -> list[dict[str, ParamSpec]]:
    out = []
    for rank in range(tp):
        model = build_model(get_preset(preset), device="meta")
        out.append(
            apply_tensor_parallel(model, Mesh(ParallelLayout(tp=tp), tp_rank=rank)) if tp > 1 else param_specs(model)
        )
    return out


# tp=4 with 2 KV heads (llama-test) and tp=2/4 with 1 (falcon-test) replicate KV rows; tp=4 pads 256 ids to 512.
@pytest.mark.parametrize(
    "preset, tp", [("llama-test", 1), ("llama-test", 2), ("llama-test", 4), ("falcon-test", 4), ("falcon40b-test", 8)]
)
def test_pieces_of_every_rank_and_segment_cover_the_full_tensor_once(preset, tp):
    """Written pieces (any flat segments of any tp shard) tile the unpadded tensor exactly; reading refills shards."""
    ranks = _sharded_specs(preset, tp)
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    for name, spec0 in ranks[0].items():
        full = torch.randn(spec0.full_shape, generator=gen)
        written, count = torch.zeros_like(full), torch.zeros_like(full)
        for rank, specs in enumerate(ranks):
            spec = specs[name]
            local = spec.shard(full).reshape(-1)
            cuts = sorted(rng.sample(range(1, local.numel()), 3))  # segments of a distributed optimizer, say
            for a, b in zip([0, *cuts], [*cuts, local.numel()]):
                if spec.tensor_parallel or rank == 0:  # replicated tensors: tp rank 0 writes
                    for piece in local_pieces(spec, a, b, owned_only=True):
                        assert all(o + s <= n for o, s, n in zip(piece.box.offsets, piece.box.sizes, full.shape))
                        written[_slices(piece.box)] += piece.view(local[a:b])
                        count[_slices(piece.box)] += 1
                back = torch.zeros(b - a)
                for piece in local_pieces(spec, a, b, owned_only=False):
                    piece.view(back).copy_(full[_slices(piece.box)])
                assert torch.equal(back, local[a:b]), (name, rank, a, b)  # padding rows come back as zeros
        assert bool((count == 1).all()), f"{name}: elements written {int(count.min())}..{int(count.max())} times"
        assert torch.equal(written, full), name


# ---- in one process: async snapshots, master weights --------------------------------------------------------


def _engine(**values):
    from llamatron.config.settings import config_from_values
    from llamatron.parallel.mesh import build_mesh
    from llamatron.training.engine import build_engine
    from llamatron.training.validate import validate

    cfg = config_from_values(
        {
            "model": "llama-test",
            "mock_data": True,
            "device": "cpu",
            "seq_length": 16,
            "micro_batch_size": 2,
            "global_batch_size": 2,
            **values,
        }
    )
    return build_engine(cfg, validate(cfg), build_mesh())


def _train_steps(engine, steps: range) -> None:
    from llamatron.data.batches import micro_batches_for_step
    from llamatron.data.mock import MockDataset
    from llamatron.training.engine import train_step

    data = MockDataset(engine.model_cfg.vocab_size, 16, 0)
    for step in steps:
        train_step(engine, micro_batches_for_step(data, 2 * step, 2, 2, 1, 0), step)


def test_async_save_writes_a_snapshot_and_publishes_at_finish(tmp_path):
    from llamatron.training.checkpointing import Checkpointing

    engine = _engine(precision="fp32", async_save=True, save=str(tmp_path))
    saves = Checkpointing(engine.cfg.train)
    _train_steps(engine, range(2))
    before = {n: p.detach().clone() for n, p in engine.chunks[0].named_parameters()}
    path = saves.save(engine, 2, 4, 0)
    _train_steps(engine, range(2, 3))  # training goes on while the files are written
    assert not (tmp_path / "step-2").exists() and not (tmp_path / "latest").exists()
    assert saves.finish(engine) == path
    assert (tmp_path / "latest").read_text().strip() == "step-2"
    saved = load_full_tensors(path)
    assert all(torch.equal(saved[n], before[n]) for n in before)  # the values at the save, not after
    assert not torch.equal(saved["layers.0.attn.qkv.weight"], engine.chunks[0].layers["0"].attn.qkv.weight)


def test_engine_takes_no_attributes_after_build_and_async_saves_resume(tmp_path):
    """The Engine has declared fields only: the run's save in flight and the metadata a loaded checkpoint passes
    on live with the checkpointing, so a run that saves in the background and resumes works without them."""
    engine = _engine(precision="fp32")
    with pytest.raises(AttributeError):
        engine.pending_save = None
    run_train(["--train-steps", "2", "--save", "ck", "--save-interval", "1", "--async-save"], 1, tmp_path)
    resumed = run_train(["--train-steps", "3", "--load", "ck", "--save", "ck", "--async-save"], 1, tmp_path)
    assert [r["step"] for r in resumed] == [3]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-3"


def test_bf16_master_weights_round_trip_and_seed_an_fp32_run(tmp_path):
    from llamatron.training.checkpointing import load_checkpoint, save_checkpoint

    bf16 = _engine(precision="bf16")
    _train_steps(bf16, range(2))
    save_checkpoint(bf16, str(tmp_path), 2, 4)
    assert CheckpointReader(tmp_path).has("master")
    for precision in ("bf16", "fp32"):
        engine = _engine(precision=precision)
        assert load_checkpoint(engine, str(tmp_path))["step"] == 2
        for i in range(len(engine.optimizer.segments)):
            assert torch.equal(engine.optimizer.master[i], bf16.optimizer.master[i])  # fp32 run: weights = master
            assert torch.equal(engine.optimizer.exp_avg_sq[i], bf16.optimizer.exp_avg_sq[i])
            assert torch.equal(engine.optimizer.steps[i], bf16.optimizer.steps[i])
    tuned = _engine(precision="bf16")  # --finetune: the stored master weights, a fresh optimizer
    load_checkpoint(tuned, str(tmp_path), weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(tuned.optimizer.master, bf16.optimizer.master))
    assert all(float(s) == 0 for s in tuned.optimizer.steps) and not any(m.any() for m in tuned.optimizer.exp_avg)


def test_fp16_loss_scale_is_restored(tmp_path):
    from llamatron.training.checkpointing import load_checkpoint, save_checkpoint

    fp16 = _engine(precision="fp16", initial_loss_scale=2.0**60)  # every step overflows: the scale halves
    _train_steps(fp16, range(2))
    save_checkpoint(fp16, str(tmp_path), 2, 4)
    resumed = _engine(precision="fp16", initial_loss_scale=2.0**60)
    load_checkpoint(resumed, str(tmp_path))
    assert resumed.loss_scaler.state_dict() == fp16.loss_scaler.state_dict() == {"scale": 2.0**58, "good_steps": 0}


# ---- through `llamatron train` ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoint")


@pytest.fixture(scope="module")
def tp2_failed_save(workdir) -> dict:
    """tp=2, saving at steps 2 and 4; rank 1's write of step 4 fails half-way (a full disk)."""
    run_dir = workdir / "tp2-fail"
    run_dir.mkdir()
    with pytest.raises(AssertionError) as failure:
        run_train(["--tp", "2", "--save", "../ck-tp2", *SAVE_2_AND_4], 2, run_dir, faults=["--fail-save", "4:1"])
    root = workdir / "ck-tp2"
    return {
        "error": str(failure.value),
        "records": _records(run_dir),
        "latest": (root / "latest").read_text(),
        "entries": sorted(p.name for p in root.iterdir() if p.name != ".lock"),  # the run's lock file stays
    }


def test_failed_save_leaves_the_previous_checkpoint_and_latest(tp2_failed_save):
    assert "No space left on device (injected" in tp2_failed_save["error"]
    assert "latest still names the previous checkpoint" in tp2_failed_save["error"]
    assert tp2_failed_save["error"].count("checkpoint error:") == 1  # the same outcome on both ranks, said once
    assert tp2_failed_save["latest"].strip() == "step-2"
    assert tp2_failed_save["entries"] == ["latest", "step-2"]  # no step-4, no temporary directory left
    assert [r["step"] for r in tp2_failed_save["records"]] == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def tp2_resumed(workdir, tp2_failed_save) -> list[dict]:
    """Resume the failed run from `latest` (step 2) at tp=2; it saves step 4 into the same directory."""
    return run_train(["--tp", "2", "--load", "ck-tp2", "--save", "ck-tp2", "--train-steps", "4"], 2, workdir)


def test_resume_at_tp2_is_exact(tp2_failed_save, tp2_resumed):
    assert [r["step"] for r in tp2_resumed] == [3, 4]
    assert _losses(tp2_resumed, (3, 4)) == _losses(tp2_failed_save["records"], (3, 4))
    for key in ("grad_norm", "lr", "consumed_samples"):  # the schedule and the data position came back too
        assert [r[key] for r in tp2_resumed] == [r[key] for r in tp2_failed_save["records"][2:]], key


def test_tp2_checkpoint_stores_unpadded_tensors_in_pieces_of_both_ranks(workdir, tp2_resumed):
    reader = CheckpointReader(workdir / "ck-tp2")
    assert reader.step_dir.name == "step-4"
    cfg = get_preset("llama-test")
    embed = reader.stored("model", "embed.weight")
    assert embed.shape == (cfg.vocab_size, cfg.hidden_size)  # padded to 256 per tp rank: padding not stored
    assert {p.file for p in reader.stored("exp_avg", "layers.0.attn.qkv.weight").pieces} == {
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    }
    assert len(reader.stored("model", "norm.weight").pieces) == 1  # replicated over tp: written once


def test_export_hf_of_a_tp2_checkpoint_loads_in_transformers(workdir, tp2_resumed, tmp_path):
    transformers = pytest.importorskip("transformers")
    from llamatron.inference.generate import load_for_generation
    from llamatron.interop.hf_io import export_hf

    export_hf(workdir / "ck-tp2", tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, meta = load_for_generation(str(workdir / "ck-tp2"))
    assert meta["step"] == 4 and meta["layout"]["tp"] == 2
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max() <= 1e-4


@pytest.fixture(scope="module")
def dp2_distopt(workdir) -> dict[str, list[dict]]:
    """dp=2 with the distributed optimizer, saved synchronously and with --async-save."""
    args = ["--distributed-optimizer", "--bucket-size", "6000", *SAVE_2_AND_4]
    return {
        "sync": run_train([*args, "--save", "ck-sync"], 2, workdir),
        "async": run_train([*args, "--save", "ck-async", "--async-save"], 2, workdir),
    }


def test_async_save_writes_the_same_checkpoint_as_sync(workdir, dp2_distopt):
    assert [r["loss"] for r in dp2_distopt["async"]] == [r["loss"] for r in dp2_distopt["sync"]]
    for step in ("step-2", "step-4"):
        sync, done = workdir / "ck-sync" / step, workdir / "ck-async" / step
        files = sorted(p.relative_to(sync).as_posix() for p in sync.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(done).as_posix() for p in done.rglob("*") if p.is_file())
        assert "rank-00001.safetensors" in files  # each dp rank wrote its optimizer shard
        for name in files:
            if name.endswith(".safetensors") or name == "index.json":
                assert (sync / name).read_bytes() == (done / name).read_bytes(), name
        metas = [json.loads((d / "meta.json").read_text()) for d in (sync, done)]
        assert metas[1]["config"]["train"].pop("async_save") and not metas[0]["config"]["train"].pop("async_save")
        for m in metas:  # the runs differ only in where they save and log
            m["config"]["train"].pop("save"), m["config"]["train"].pop("metrics_file")
        assert metas[0] == metas[1]
        for r in range(2):
            a, b = (json.loads((d / f"rng/rank-{r:05d}.json").read_text()) for d in (sync, done))
            assert a["torch"] == b["torch"] and len(a["torch"]) > 1000


def test_resume_with_distributed_optimizer_is_exact(workdir, dp2_distopt):
    resumed = run_train(
        ["--distributed-optimizer", "--bucket-size", "6000", "--train-steps", "4", "--load", "ck-async/step-2"],
        2,
        workdir,
    )
    assert _losses(resumed, (3, 4)) == _losses(dp2_distopt["sync"], (3, 4))
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in dp2_distopt["sync"][2:]]


def test_distributed_optimizer_on_to_off(workdir, dp2_distopt):
    resumed = run_train(["--train-steps", "4", "--load", "ck-sync/step-2", "--save", "ck-off"], 2, workdir)
    assert_matches(dp2_distopt["sync"][2:], resumed)
    assert_same_state(workdir / "ck-sync/step-4", workdir / "ck-off/step-4")


def test_pipeline_resume_with_tied_embeddings_is_exact(workdir):
    """falcon-test ties its embedding: the last stage's copy is not saved, and is restored from the first's."""
    full = run_train(["--pp", "2", "--save", "ck-pp2", *SAVE_2_AND_4], 2, workdir, model="falcon-test")
    assert CheckpointReader(workdir / "ck-pp2").names("model") == {
        n for n, _ in build_model(get_preset("falcon-test"), device="meta").named_parameters()
    }
    resumed = run_train(["--pp", "2", "--train-steps", "4", "--load", "ck-pp2/step-2"], 2, workdir, model="falcon-test")
    assert _losses(resumed, (3, 4)) == _losses(full, (3, 4))
    # a pipeline's checkpoint generates in one process: every weight of the single-device model is the saved one
    from llamatron.inference.generate import load_for_generation, sample

    model, meta = load_for_generation(str(workdir / "ck-pp2"))
    assert meta["layout"]["pp"] == 2
    saved = load_full_tensors(workdir / "ck-pp2")
    assert all(torch.equal(p, saved[name]) for name, p in model.named_parameters()) and len(saved) == len(
        list(model.parameters())
    )
    assert len(sample(model, [1, 2, 3], max_new_tokens=4)) == 4


def test_resume_across_layouts_tp2_pp2_vpp2_to_dp4_and_back(workdir):
    """tp2 x pp2 x vpp2 -> tp1 x dp4 with the distributed optimizer (on) -> tp2 x pp2 (off again).

    Two steps after each resume: the second one shows whether the optimizer state came across.
    """
    model, steps = "llama-test4", ["--train-steps", "5"]
    first = run_train(
        ["--tp", "2", "--pp", "2", "--vpp", "2", "--save", "ck-x", "--save-interval", "1", *steps],
        4,
        workdir,
        model=model,
    )
    dp4 = run_train(
        [
            "--distributed-optimizer",
            "--micro-batch-size",
            "1",
            "--load",
            "ck-x/step-2",
            "--save",
            "ck-dp4",
            "--save-interval",
            "3",
            *steps,
        ],
        4,
        workdir,
        model=model,
    )
    assert_matches(first[2:], dp4)
    back = run_train(
        ["--tp", "2", "--pp", "2", "--load", "ck-dp4/step-3", "--save", "ck-back", *steps], 4, workdir, model=model
    )
    assert_matches(first[3:], back)
    for a, b in (("ck-x/step-3", "ck-dp4/step-3"), ("ck-x/step-5", "ck-dp4/step-5"), ("ck-x/step-5", "ck-back/step-5")):
        assert_same_state(workdir / a, workdir / b)


@pytest.mark.parametrize("keep", ["half", "header"])
def test_damaged_checkpoint_file_is_named_with_exit_2(tmp_path, capsys, keep):
    """A truncated rank file (data cut, or the header itself cut) gives a checkpoint error naming the file."""
    from llamatron.cli import main

    base = [
        "train",
        "--model",
        "llama-test",
        "--mock-data",
        "--device",
        "cpu",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--no-progress",
    ]
    with pytest.raises(SystemExit) as saved:
        main(base + ["--train-steps", "1", "--save", str(tmp_path / "ck")])
    assert saved.value.code in (0, None)
    (victim,) = (tmp_path / "ck").glob("step-*/rank-*.safetensors")
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2] if keep == "half" else data[:10])
    capsys.readouterr()
    with pytest.raises(SystemExit) as failed:
        main(base + ["--train-steps", "2", "--load", str(tmp_path / "ck")])
    assert failed.value.code == 2
    err = capsys.readouterr().err
    assert "checkpoint error" in err and str(victim) in err and "truncated or corrupt" in err
