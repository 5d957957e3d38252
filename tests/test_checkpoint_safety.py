"""Nothing lost, nothing executed, nothing read from outside (issue 24, items 1-5 and the checkpoint parts of 7-8):
the save-directory lock, a killed re-save, checksums, non-finite weights, RNG files without pickle, paths that
leave the checkpoint, malformed index and meta files."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from layout import BASE_ARGS, assert_matches, run_train

from llamatron.checkpoint.reader import CheckpointReader
from llamatron.errors import CheckpointError, TrainingAborted
from llamatron.training.checkpointing import save_checkpoint

REPO = str(Path(__file__).resolve().parents[1])


def _train_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "llamatron", "train", "--model", "llama-test", *BASE_ARGS, *args]


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.run(_train_command(*args), capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run of 3 steps saving every step: DIR/step-1..3, latest -> step-3."""
    root = tmp_path_factory.mktemp("saved")
    run_train(["--train-steps", "3", "--save", "ck", "--save-interval", "1"], 1, root)
    return root / "ck"


def _copy(saved: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ck"
    shutil.copytree(saved, out)
    return out


# ---- 1. two runs on one --save directory ---------------------------------------------------------------------


@pytest.mark.parametrize("trial", range(3))
def test_two_runs_started_together_on_one_save_dir_one_is_refused(tmp_path, trial):
    """Started at the same moment, each saving every step: exactly one trains, the other ends with exit 2 and one
    line, and what is published is the first run's alone (it resumes exactly)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    args = ["--train-steps", "6", "--save", "ck", "--save-interval", "1", "--metrics-file"]
    procs = [
        subprocess.Popen(
            _train_command(*args, f"m{i}.jsonl"),
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "Traceback" not in refused
    assert "is in use by another run" in refused or "already holds another run's checkpoints" in refused
    winner = next(i for i, (code, _) in enumerate(results) if code == 0)
    whole = [json.loads(line) for line in (tmp_path / f"m{winner}.jsonl").read_text().splitlines()]
    whole = [r for r in whole if r.get("split") is None]
    resumed = run_train(["--train-steps", "6", "--load", "ck/step-3"], 1, tmp_path)
    assert_matches(whole[3:], resumed)


def test_a_lock_left_by_a_dead_run_does_not_block(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".lock").write_text(json.dumps({"host": "gone", "pid": 999999, "started": 0}))
    done = _run(tmp_path, "--train-steps", "1", "--save", "ck")
    assert done.returncode == 0, done.stderr[-2000:]


# ---- 2. a kill while re-saving the step `latest` names ------------------------------------------------------


@pytest.mark.parametrize("left", [".old-step-3", ".tmp-step-3"])
def test_latest_naming_a_step_replaced_half_way_loads_its_intact_copy(saved, tmp_path, left):
    """Killed between moving step-3 aside and renaming the new copy into place: `latest` names a missing step-3.
    The load finds the intact copy, says so, and the next save does not delete it before it is replaced."""
    ck = _copy(saved, tmp_path)
    os.replace(ck / "step-3", ck / left)
    reference = run_train(["--train-steps", "5", "--load", str(saved / "step-3")], 1, tmp_path)
    args = ["--train-steps", "5", "--load", "ck", "--save", "ck", "--save-interval", "1"]
    done = _run(tmp_path, *args, "--metrics-file", "resumed.jsonl")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count(f"loading its intact copy ck/{left}") == 1
    assert (ck / "latest").read_text().strip() == "step-5" and (ck / "step-4").is_dir()
    records = [json.loads(line) for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert_matches(reference, [r for r in records if r.get("split") is None])


# ---- 3. silent corruption, non-finite weights ----------------------------------------------------------------


def test_flipped_bytes_inside_a_rank_file_are_refused(saved, tmp_path):
    """4096 bytes flipped in the tensor data (the header intact: safetensors alone would load it)."""
    ck = _copy(saved, tmp_path)
    victim = ck / "step-3" / "rank-00000.safetensors"
    data = bytearray(victim.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(b ^ 0xFF for b in data[middle : middle + 4096])
    victim.write_bytes(bytes(data))
    done = _run(tmp_path, "--train-steps", "4", "--load", "ck")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "ck/step-3/rank-00000.safetensors is truncated or corrupt" in done.stderr and "sha256" in done.stderr


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    from test_checkpoint import _engine

    engine = _engine()
    save_checkpoint(engine, str(tmp_path), 1, 2)
    next(iter(engine.chunks[0].parameters())).data[0, 0] = float("nan")
    with pytest.raises(TrainingAborted, match="NaN or infinite values: not saved"):
        save_checkpoint(engine, str(tmp_path), 2, 4)
    assert (tmp_path / "latest").read_text().strip() == "step-1" and not (tmp_path / "step-2").exists()


def test_step_renamed_but_latest_not_written_says_so(tmp_path, monkeypatch):
    from test_checkpoint import _engine

    import llamatron.checkpoint.writer as writer

    engine = _engine()
    save_checkpoint(engine, str(tmp_path), 1, 2)

    def full_disk(root, name):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_latest", full_disk)
    with pytest.raises(CheckpointError, match=r"failed after it was written .*latest could not be updated"):
        save_checkpoint(engine, str(tmp_path), 2, 4)


# ---- 4. RNG states without pickle ----------------------------------------------------------------------------


class _Exploit:
    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return os.mkdir, (self.target,)


def test_rng_files_are_json_and_a_pickled_one_is_never_opened(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    rng = ck / "step-3" / "rng" / "rank-00000.json"
    assert isinstance(json.loads(rng.read_text())["torch"], str)  # plain JSON, no pickle
    rng.unlink()
    proof = tmp_path / "code-ran"
    with open(ck / "step-3" / "rng" / "rank-00000.pt", "wb") as f:
        pickle.dump({"torch": _Exploit(str(proof))}, f)
    done = _run(tmp_path, "--train-steps", "4", "--load", "ck")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not proof.exists() and "pickled in an older format, which is never loaded" in done.stderr


@pytest.mark.parametrize("content", ["not json", '{"python": 5}'])
def test_a_damaged_rng_file_is_one_line(saved, tmp_path, content):
    ck = _copy(saved, tmp_path)
    (ck / "step-3" / "rng" / "rank-00000.json").write_text(content)
    done = _run(tmp_path, "--train-steps", "4", "--load", "ck")
    assert (
        done.returncode == 2
        and "Traceback" not in done.stderr
        and "rank-00000.json is truncated or corrupt" in done.stderr
    )


def test_a_missing_rng_file_warns(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    (ck / "step-3" / "rng" / "rank-00000.json").unlink()
    done = _run(tmp_path, "--train-steps", "4", "--load", "ck")
    assert done.returncode == 0 and "rank-00000.json is missing" in done.stderr


# ---- 5. paths from checkpoint files --------------------------------------------------------------------------


def test_latest_cannot_lead_outside_its_directory(saved, tmp_path):
    other = _copy(saved, tmp_path / "other")
    ck = tmp_path / "victim"
    ck.mkdir()
    (ck / "latest").write_text(f"../{other.parent.name}/ck/step-3\n")
    done = _run(tmp_path, "--train-steps", "4", "--load", "victim")
    assert done.returncode == 2 and "Traceback" not in done.stderr and "not a step-N directory" in done.stderr


@pytest.mark.parametrize("how", ["dotdot", "symlink"])
def test_index_files_cannot_name_files_outside_the_step(saved, tmp_path, how):
    ck = _copy(saved, tmp_path)
    step = ck / "step-3"
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(step / "rank-00000.safetensors", outside)
    index = json.loads((step / "index.json").read_text())
    if how == "dotdot":
        index["files"] = ["../../elsewhere.safetensors"]
        index.pop("checksums")
        (step / "index.json").write_text(json.dumps(index))
    else:
        (step / "rank-00000.safetensors").unlink()
        (step / "rank-00000.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside"):
        CheckpointReader(step).read("model", "embed.weight")


# ---- 7. malformed index and meta -----------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["no files", "bad file id", "no model_config"])
def test_malformed_index_or_meta_is_one_line(saved, tmp_path, damage):
    ck = _copy(saved, tmp_path)
    step = ck / "step-3"
    if damage == "no model_config":
        meta = json.loads((step / "meta.json").read_text())
        meta.pop("model_config")
        (step / "meta.json").write_text(json.dumps(meta))
    else:
        index = json.loads((step / "index.json").read_text())
        if damage == "no files":
            index.pop("files")
        else:
            first = next(iter(index["tensors"]["model"].values()))
            first["pieces"][0][0] = 7
        (step / "index.json").write_text(json.dumps(index))
    done = _run(tmp_path, "--train-steps", "4", "--load", "ck")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "truncated or corrupt" in done.stderr


def test_checksums_are_recorded_for_every_rank_file(saved):
    index = json.loads((saved / "step-3" / "index.json").read_text())
    assert set(index["checksums"]) == set(index["files"]) and all(len(h) == 64 for h in index["checksums"].values())


# ---- 5 and 8: export-hf --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["secret.txt", "tokenizer.json"])
def test_export_ships_no_file_a_meta_json_names_unless_it_is_a_tokenizer(saved, tmp_path, name):
    """meta.json's "tokenizer" pointing at any file (named like a tokenizer or not) is not copied out."""
    from llamatron.interop.hf_io import export_hf

    ck = _copy(saved, tmp_path)
    secret = tmp_path / name
    secret.write_text("password=hunter2")
    meta = json.loads((ck / "step-3" / "meta.json").read_text())
    meta["tokenizer"] = str(secret)
    (ck / "step-3" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="is not a tokenizer"):
        export_hf(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failed_export_leaves_nothing_behind(saved, tmp_path):
    from llamatron.interop.hf_io import export_hf

    ck = _copy(saved, tmp_path)
    victim = ck / "step-3" / "rank-00000.safetensors"
    index = json.loads((ck / "step-3" / "index.json").read_text())
    index.pop("checksums")  # so that the truncation is found while the shards are written
    (ck / "step-3" / "index.json").write_text(json.dumps(index))
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        export_hf(ck, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no out/, no temporary directory


def test_hf_index_weight_map_cannot_leave_the_directory(tmp_path):
    from llamatron.interop.hf_io import open_hf_dir

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside .*; refusing to read it"):
        open_hf_dir(hf)
