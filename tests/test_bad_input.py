"""Bad input ends in one line naming the problem and exit 2, before anything is built (issue 24, items 6-8).

The sweep feeds every field of every config section (read from the dataclasses, so a new field is swept too) a
wrong type, a non-finite value and an out-of-range value, in process through the two ways settings arrive: YAML
values (`config_from_values` + `validate`) and flags (`llamatron.cli.main`, with the build steps replaced by a
failure, so that a value which got past validation fails the test). A handful run as real `llamatron train`
processes. Then the files: a non-UTF-8 --config, wrong model_overrides, a --metrics-file that is a directory, a
truncated index cache, a truncated config.json or tokenizer.json given to import-hf, and metrics records of
skipped steps (no bare NaN).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hf_fixtures import VOCAB, make_hf_model
from tokenizers import Tokenizer, models, pre_tokenizers

import llamatron.training.trainer
from llamatron.cli import main as llamatron_main
from llamatron.config.ranges import INT64_MAX, Range
from llamatron.config.settings import SECTIONS, config_from_values
from llamatron.data import samples
from llamatron.data.indexed import IndexedDatasetWriter
from llamatron.errors import ConfigError
from llamatron.training.metrics import MetricsSink
from llamatron.training.validate import validate

REPO = str(Path(__file__).resolve().parents[1])
BASE = {"model": "llama-test", "mock_data": True, "device": "cpu"}
BASE_FLAGS = ["train", "--model", "llama-test", "--mock-data", "--device", "cpu", "--no-progress"]
SIGNED: set[str] = set()  # numeric settings where a negative value is valid (none today)


def _kind(cls: type, name: str) -> Any:
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is not list else []
    return args[0] if args else hint


ALL_FIELDS = [(cls, f) for cls in SECTIONS.values() for f in fields(cls)]
NUMERIC = [(f.name, _kind(cls, f.name) is int, f.metadata.get("allowed")) for cls, f in ALL_FIELDS]
NUMERIC = [(name, integer, allowed) for name, integer, allowed in NUMERIC if allowed is not None]

WRONG_TYPES: dict[Any, list[Any]] = {
    bool: ["maybe", 1, 2.5, [True]],
    int: ["many", 2.5, True, [1], {"a": 1}],
    float: ["fast", True, [1.0], {"a": 1}],
    str: [5, 2.5, True, ["a"], {"a": 1}],
    list[str]: [5, [1], {"a": 1}],
    list[int]: [5, ["a"], [1.5], {"a": 1}, [True]],
    list[float]: [5, ["a"], {"a": 1}, [True]],
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _outside(allowed: Range, integer: bool) -> list[float]:
    """Values just outside the declared range, on each bounded side (and past int64 for integers)."""
    out: list[float] = [INT64_MAX + 1] if integer else [math.nan, math.inf, -math.inf]
    if allowed.low is not None:
        out.append(allowed.low if allowed.low_open else allowed.low - (1 if integer else 1e-3))
    if allowed.high is not None:
        out.append(allowed.high if allowed.high_open else allowed.high + 1)
    return [int(v) if integer and math.isfinite(v) else float(v) for v in out]


def _cases() -> list[tuple[str, Any]]:
    cases: list[tuple[str, Any]] = []
    for cls, f in ALL_FIELDS:
        kind = _kind(cls, f.name)
        cases += [(f.name, v) for v in WRONG_TYPES[kind]]
        if f.metadata.get("choices"):
            cases.append((f.name, "no-such-choice"))
    for name, integer, allowed in NUMERIC:
        cases += [(name, v) for v in _outside(allowed, integer)]
        if name not in SIGNED:
            cases.append((name, -1 if integer else -1.0))
        if integer:
            cases += [(name, math.nan), (name, math.inf)]  # not integers at all
    return cases


def _assert_one_line_naming(message: str, name: str) -> None:
    assert "\n" not in message, message
    assert _flag(name) in message, message


def test_every_numeric_setting_declares_its_range():
    """config.py refuses to import without them; this names the fields the sweep covers."""
    numeric = [f.name for cls, f in ALL_FIELDS if _kind(cls, f.name) in (int, float)]
    assert numeric == [name for name, _, _ in NUMERIC] and len(numeric) >= 29
    validate(config_from_values(BASE))  # the defaults themselves are in range


@pytest.mark.parametrize("name, value", _cases(), ids=lambda v: repr(v)[:30])
def test_every_setting_refuses_bad_values_from_yaml(name, value):
    with pytest.raises(ConfigError) as err:
        validate(config_from_values({**BASE, name: value}))
    _assert_one_line_naming(str(err.value), name)


@pytest.fixture
def no_building(monkeypatch):
    """A run that gets past validation fails the test instead of building anything."""

    def built(*args, **kwargs):
        raise AssertionError("bad input got past validation")

    monkeypatch.setattr(llamatron.training.trainer, "init_distributed", built)
    monkeypatch.setattr(llamatron.training.trainer, "build_engine", built)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        llamatron_main(argv)
    return int(exc.value.code or 0), capsys.readouterr().err


def _flag_cases() -> list[tuple[str, str]]:
    """Flag texts as a user types them: negative, not finite, beyond int64."""
    cases = []
    for name, integer, allowed in NUMERIC:
        texts = ["nan", "inf", str(INT64_MAX + 1)] if integer else ["nan", "inf", "-inf", "1e999"]
        if name not in SIGNED:
            texts.append("-1")
        if allowed.low is not None and allowed.low_open:
            texts.append(str(allowed.low))
        cases += [(name, t) for t in texts]
    return cases


@pytest.mark.parametrize("name, text", _flag_cases())
def test_every_numeric_flag_refuses_bad_values(name, text, no_building, capsys):
    code, err = _cli([*BASE_FLAGS, f"{_flag(name)}={text}"], capsys)
    assert code == 2 and "Traceback" not in err, err
    first = err.splitlines()[0]
    assert _flag(name) in first, err  # argparse (not an integer) or training.validate (out of range)
    if "configuration error" in first:
        assert len(err.splitlines()) == 1, err


def test_lr_below_zero_and_nan_name_the_flags_and_the_range():
    """The two cases of the issue: they trained (diverging, or NaN at every step) and exited 0."""
    with pytest.raises(ConfigError, match=r"^--lr -1.0 must be >= 0; --min-lr -2.0 must be >= 0$"):
        validate(config_from_values({**BASE, "lr": -1.0, "min_lr": -2.0}))
    with pytest.raises(ConfigError, match=r"^--lr nan must be a finite number >= 0$"):
        validate(config_from_values({**BASE, "lr": "nan"}))
    with pytest.raises(ConfigError, match=r"--seed -1 must be in 0..4294967295"):
        validate(config_from_values({**BASE, "seed": -1}))
    with pytest.raises(ConfigError, match=r"setting lr \(--lr\): 1{400} is too large"):
        config_from_values({"lr": int("1" * 400)})  # a YAML integer float() cannot hold


def _write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def _run_train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "llamatron", *BASE_FLAGS, "--train-steps", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=cwd, check=False)


@pytest.mark.parametrize(
    "case",
    ["negative lr", "nan lr", "not utf-8 config", "model_overrides type", "metrics file is a directory"],
)
def test_the_train_command_refuses_bad_input_in_one_line(case, tmp_path):
    args, expected = {
        "negative lr": (["--lr", "-1", "--min-lr", "-2"], "--lr -1.0 must be >= 0; --min-lr -2.0 must be >= 0"),
        "nan lr": (["--lr", "nan"], "--lr nan must be a finite number >= 0"),
        "not utf-8 config": (
            ["--config", str(_write(tmp_path / "c.yaml", b"lr: 0.1\n# caf\xe9\n"))],
            "is not UTF-8 text (byte 13",
        ),
        "model_overrides type": (
            ["--config", str(_write(tmp_path / "overrides.yaml", "model_overrides:\n  num_layers: four\n"))],
            "num_layers 'four' must be an integer",
        ),
        "metrics file is a directory": (["--metrics-file", str(tmp_path)], f"--metrics-file {tmp_path} is a directory"),
    }[case]
    proc = _run_train(args, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llamatron train: configuration error: "), proc.stderr
    assert expected in lines[0]
    assert proc.stdout == ""  # nothing was built or trained


# --- settings files and model_overrides ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("model_overrides:\n  num_layers: four\n", "num_layers 'four' must be an integer"),
        ("model_overrides: [1, 2]\n", r"model_overrides must be a mapping of model field: value"),
        ("model_overrides:\n  rope_scaling: {kind: linear}\n", r"rope_scaling \{'kind': 'linear'\}: missing factor"),
        ("model_overrides:\n  rope_scaling: 5\n", r"rope_scaling 5 must be a mapping of kind, factor"),
        ("model_overrides:\n  rope_scaling: {kind: linear, factor: x}\n", "rope_scaling factor 'x' must be a finite"),
        ("model_overrides:\n  rope_theta: .inf\n", "rope_theta inf must be a finite number"),
        ("model_overrides:\n  tie_embeddings: 1\n", "tie_embeddings 1 must be true or false"),
        ("model_overrides:\n  is_moe: true\n", "unknown model field 'is_moe'"),  # a property, not a field
        ("model_overrides:\n  1: 2\n", "unknown model field 1"),
        ("model_overrides:\n  hiden_size: 64\n", r"unknown model field 'hiden_size' \(did you mean 'hidden_size'\?\)"),
        ("micro_batchsize: 2\n", r"unknown setting\(s\) \['micro_batchsize'\] \(did you mean 'micro_batch_size'\?\)"),
        ("1: 2\n", "must hold a mapping of setting: value"),
        # issue 39: sizes past what anything can index, and a mixture's settings on a dense model
        ("model_overrides:\n  num_experts: 100000000000000000000\n", "num_experts 1000000000\\d+ is out of range"),
        ("model_overrides:\n  hidden_size: 4294967296\n", "hidden_size 4294967296 is out of range: at most 2147483647"),
        ("model_overrides:\n  router_aux_loss_coef: 0.5\n", "router_aux_loss_coef 0.5 is a mixture-of-experts setting"),
        ("model_overrides:\n  experts_per_token: 4\n", "experts_per_token 4 is a mixture-of-experts setting"),
    ],
)
def test_wrong_model_overrides_and_yaml_keys_are_named(yaml_text, message, tmp_path, no_building, capsys):
    config = _write(tmp_path / "c.yaml", yaml_text)
    code, err = _cli([*BASE_FLAGS, "--config", str(config)], capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("llamatron train: configuration error: ")
    assert re.search(message, err), err


def test_valid_model_overrides_still_apply():
    cfg = config_from_values({**BASE, "model_overrides": {"rope_scaling": {"kind": "linear", "factor": 2}}})
    model = cfg.model_config()
    assert model.rope_scaling is not None and model.rope_scaling.factor == 2
    validate(config_from_values({**BASE, "model_overrides": {"rope_theta": 500000, "num_kv_heads": None}}))


@pytest.mark.parametrize("command", [["train", "--device", "cpu", "--mock-data"], ["plan", "--gpus", "8"]])
def test_a_sequence_too_long_for_the_model_names_the_longest_allowed(command, no_building, capsys):
    code, err = _cli([*command, "--model", "llama-test", "--seq-length", "100000"], capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "--seq-length 100000 is out of range for llama-test: give 1 to 8192" in err, err


def test_a_config_file_that_is_not_utf8_is_named(tmp_path, no_building, capsys):
    config = _write(tmp_path / "c.yaml", b"lr: 0.1\n" + "# café\n".encode("latin-1"))
    code, err = _cli([*BASE_FLAGS, "--config", str(config)], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip() == (
        f"llamatron train: configuration error: config file {config} is not UTF-8 text (byte 13: invalid "
        "continuation byte); save it as UTF-8 YAML"
    )


def test_a_metrics_file_that_is_a_directory_is_refused_before_anything_is_built(tmp_path, no_building, capsys):
    code, err = _cli([*BASE_FLAGS, "--metrics-file", str(tmp_path)], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"--metrics-file {tmp_path} is a directory; give a file name" in err
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ConfigError, match=f"--metrics-file {file}/m.jsonl: {file} is a file, so the directory"):
        validate(config_from_values({**BASE, "metrics_file": str(file / "m.jsonl")}))
    with pytest.raises(ConfigError, match=f"--tensorboard-dir {file} is a file; give a directory"):
        validate(config_from_values({**BASE, "tensorboard_dir": str(file)}))
    with pytest.raises(ConfigError, match=f"--data-cache-path {file} is a file; give a directory for the index"):
        validate(config_from_values({**BASE, "data_cache_path": str(file)}))
    validate(config_from_values({**BASE, "metrics_file": str(tmp_path / "new" / "m.jsonl")}))  # created later
    validate(config_from_values({**BASE, "tensorboard_dir": str(tmp_path / "new" / "tb")}))


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([*BASE_FLAGS, "--metrics-file", "/proc/m.jsonl"], "--metrics-file /proc/m.jsonl: cannot create /proc/m.jsonl"),
        ([*BASE_FLAGS, "--tensorboard-dir", "/proc/a/tb"], "--tensorboard-dir /proc/a/tb: cannot create /proc/a/tb"),
        (
            ["preprocess", "--input", "absent.jsonl", "--output-prefix", "/proc/x", "--tokenizer", "absent"],
            "--output-prefix /proc/x: cannot create /proc/x_*",
        ),
    ],
)
def test_an_output_path_that_cannot_be_created_is_refused_before_the_work(argv, expected, no_building, capsys):
    """/proc takes no new files even for root, whom every os.access check passes: creating is tried."""
    code, err = _cli(argv, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert expected in err and err.rstrip().endswith("): choose a writable directory"), err


def test_a_run_of_no_steps_is_refused(no_building, capsys):
    """0 steps used to train nothing, save nothing and exit 0: a run that did nothing looked like a success."""
    code, err = _cli([*BASE_FLAGS, "--train-steps", "0"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--train-steps 0 must be >= 1" in err, err


def test_a_nul_character_in_a_yaml_string_is_refused():
    """No path can hold one (argv cannot), so a YAML string with one would fail deep inside os calls."""
    with pytest.raises(ConfigError, match=r"setting save \(--save\): 'ck\\x00' holds a NUL character"):
        config_from_values({**BASE, "save": "ck\x00"})


# --- index caches next to the data ---------------------------------------------------------------------------


def _corpus(directory: Path, name: str, seed: int) -> str:
    prefix = str(directory / name)
    lengths = np.random.default_rng(seed).integers(1, 40, size=60)
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for length in lengths:
            writer.add_document(np.arange(length) % 50)
    return prefix


def _build(data: str):
    return samples.build_datasets(data, "90,10,0", 16, 200, 40, seed=3, vocab_size=64)


@pytest.mark.parametrize("value", [1.5, float("nan")])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_index_whose_tokens_are_floats_is_refused(value, dtype, tmp_path, capsys):
    """issue 39: Megatron's format has float dtypes; tokens of 1.5 trained as token 1, NaN ended in a traceback."""
    prefix = str(tmp_path / "floats")
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for _ in range(40):
            writer.add_document(np.full(30, value))
    argv = ["train", "--model", "llama-test", "--data", prefix, "--device", "cpu", "--no-progress"]
    argv += ["--train-steps", "1", "--global-batch-size", "2", "--micro-batch-size", "2", "--seq-length", "16"]
    code, err = _cli(argv, capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"floats.idx: its tokens are {np.dtype(dtype)} values, not integer token ids" in err


@pytest.mark.parametrize("cache", ["sample_order", "doc_order", "sample_starts", "dataset_index", "token_range"])
def test_a_truncated_index_cache_is_rebuilt_with_a_warning(cache, tmp_path):
    data = f"1 {_corpus(tmp_path, 'a', 0)} 2 {_corpus(tmp_path, 'b', 1)}"
    train, valid = _build(data)
    expected = [train[i] for i in range(len(train))]
    bad = sorted(tmp_path.glob(f"*_{cache}.npy"))[0]
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.warns(UserWarning, match=rf"index cache {bad} cannot be read \(.*\); rebuilding it"):
        train, valid = _build(data)
    assert [np.array_equal(train[i], e) for i, e in enumerate(expected)] == [True] * len(expected)
    np.load(bad, mmap_mode="r")  # written again, whole


def test_training_on_data_with_a_truncated_sample_order_cache(tmp_path, capsys, monkeypatch):
    prefix = _corpus(tmp_path, "corpus", 0)
    argv = ["train", "--model", "llama-test", "--data", prefix, "--device", "cpu", "--no-progress"]
    argv += ["--train-steps", "1", "--global-batch-size", "2", "--micro-batch-size", "2", "--seq-length", "16"]
    assert _cli(argv, capsys)[0] == 0
    for cache in tmp_path.glob("*_sample_order.npy"):
        cache.write_bytes(cache.read_bytes()[:100])
    with pytest.warns(UserWarning, match="_sample_order.npy cannot be read"):
        assert _cli(argv, capsys)[0] == 0


# --- import-hf: its JSON files and tokenizer -----------------------------------------------------------------


def _hf_dir(directory: Path) -> Path:
    make_hf_model("llama").save_pretrained(directory)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return _hf_dir(tmp_path_factory.mktemp("hf") / "model")


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json"])
def test_import_hf_refuses_a_truncated_file_and_writes_nothing(name, hf_dir, tmp_path, capsys):
    src = _copy_dir(hf_dir, tmp_path / "hf")
    assert (src / name).is_file()
    text = (src / name).read_text()
    (src / name).write_text(text[: len(text) // 2])
    code, err = _cli(["import-hf", str(src), str(tmp_path / "out")], capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("llamatron import-hf: checkpoint error: ") and str(src / name) in err
    assert not (tmp_path / "out").exists()


def _without_layers(config: dict) -> dict:
    config.pop("num_hidden_layers")
    return config


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda config: [1, 2], "config.json must hold a JSON object, not list"),
        (_without_layers, "config.json has no 'num_hidden_layers', which the conversion needs"),
        (lambda config: {**config, "num_hidden_layers": "four"}, "num_layers 'four' must be an integer"),
        (lambda config: {**config, "hidden_size": "64"}, "config.json holds a value of the wrong type"),
    ],
)
def test_import_hf_refuses_a_config_json_it_cannot_convert(change, message, hf_dir, tmp_path, capsys):
    src = _copy_dir(hf_dir, tmp_path / "hf")
    (src / "config.json").write_text(json.dumps(change(json.loads((src / "config.json").read_text()))))
    code, err = _cli(["import-hf", str(src), str(tmp_path / "out")], capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert message in err and str(src / "config.json") in err, err
    assert not (tmp_path / "out").exists()


def test_import_hf_of_a_sound_directory_still_works(hf_dir, tmp_path, capsys):
    assert _cli(["import-hf", str(hf_dir), str(tmp_path / "out")], capsys)[0] == 0
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.parametrize("hf", ["missing", "empty"])
def test_verify_refuses_an_hf_directory_without_a_model_in_one_line(hf, hf_dir, tmp_path, capsys):
    assert _cli(["import-hf", str(hf_dir), str(tmp_path / "ckpt")], capsys)[0] == 0
    target = tmp_path / hf
    if hf == "empty":
        target.mkdir()
    code, err = _cli(["verify", str(tmp_path / "ckpt"), "--hf", str(target)], capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    want = "is not a directory" if hf == "missing" else "no config.json"
    assert err.startswith("llamatron verify: checkpoint error: ") and str(target) in err and want in err, err


def test_verify_of_a_missing_checkpoint_says_there_is_none(hf_dir, tmp_path, capsys):
    code, err = _cli(["verify", str(tmp_path / "nothing"), "--hf", str(hf_dir)], capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"no checkpoint at {tmp_path / 'nothing'}" in err and "meta.json is not" not in err, err


@pytest.mark.parametrize(
    "files, says",
    [
        (
            ["config.json"],
            "is a Hugging Face model directory, not a llamatron checkpoint: convert it first with "
            "`llamatron import-hf {d} OUT`",
        ),
        (["params.json", "consolidated.00.pth"], "is a Meta consolidated checkpoint"),
        (["latest_checkpointed_iteration.txt"], "`llamatron import-megatron --load {d} --save OUT`"),
    ],
    ids=["hf", "meta", "megatron"],
)
def test_loading_a_directory_of_another_format_names_the_import_command(files, says, hf_dir, tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for name in files:
        (foreign / name).write_text("{}")
    code, err = _cli(["verify", str(foreign), "--hf", str(hf_dir)], capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert says.format(d=foreign) in err, err


@pytest.mark.parametrize(
    "command, then",
    [
        (["generate", "--prompt", "x", "--load"], "then --load OUT"),  # generate has no --finetune
        (["eval", "--data-path", "x", "--load"], "then --load OUT"),
        ([*BASE_FLAGS, "--load"], "then --load OUT --finetune"),  # weights only: training starts from them
        (["export-hf", "--"], "then `llamatron export-hf OUT ...`"),  # the checkpoint is its first argument
    ],
    ids=["generate", "eval", "train", "export-hf"],
)
def test_the_import_hint_says_how_the_command_takes_the_converted_checkpoint(command, then, tmp_path, capsys):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")  # a Megatron-LM checkpoint
    out = ["out"] if command[0] == "export-hf" else []
    code, err = _cli([*command, str(tmp_path), *out], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.rstrip().endswith(f"`llamatron import-megatron --load {tmp_path} --save OUT`, {then}"), err


# --- metric records ------------------------------------------------------------------------------------------


def _strict_json(line: str) -> dict:
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def test_metric_records_hold_null_for_non_finite_values(tmp_path):
    sink = MetricsSink(str(tmp_path / "m.jsonl"))
    sink.write({"step": 3, "loss": math.nan, "grad_norm": math.inf, "skipped": True, "lr": 1e-3, "mfu": None})
    sink.write({"step": 3, "split": "valid", "loss": 2.5, "perplexity": math.inf})
    sink.close()
    step, evaluation = (_strict_json(line) for line in (tmp_path / "m.jsonl").read_text().splitlines())
    assert step == {"step": 3, "loss": None, "grad_norm": None, "skipped": True, "lr": 1e-3, "mfu": None}
    assert evaluation == {"step": 3, "split": "valid", "loss": 2.5, "perplexity": None}


def test_running_out_of_gpu_memory_ends_in_one_line_naming_the_fixes(monkeypatch, capsys):
    """An out-of-memory error mid-run (here raised where the engine is built; on a GPU, inside a step) ends in
    one line with torch's sizes and the flags that lower memory, exit 1, no traceback."""
    import torch

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.69 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
            "1.80 GiB is free. Including non-PyTorch memory, this process has 138.00 GiB memory in use. If "
            "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments"
        )

    monkeypatch.setattr(llamatron.training.trainer, "build_engine", out_of_memory)
    code, err = _cli([*BASE_FLAGS, "--seq-length", "64"], capsys)
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("llamatron train: out of GPU memory (CUDA out of memory. Tried to allocate 2.69 GiB"), err
    assert "--micro-batch-size" in err and "--recompute full" in err and "llamatron plan" in err, err
    assert "expandable_segments" not in err, err  # torch's allocator advice is not the user's fix
    code, err = _cli([*BASE_FLAGS, "--seq-length", "64", "--recompute", "full"], capsys)
    assert code == 1 and "--recompute" not in err and "--micro-batch-size" in err, err  # it is on already


def test_other_runtime_errors_still_raise(monkeypatch):
    """Only the out-of-memory error becomes a line: any other failure keeps its traceback for the bug report."""

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(llamatron.training.trainer, "build_engine", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        llamatron_main([*BASE_FLAGS, "--seq-length", "64"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--moe-aux-loss-coeff", "0.5"], "router_aux_loss_coef 0.5 is a mixture-of-experts setting"),
        (["--moe-router-topk", "4"], "experts_per_token 4 is a mixture-of-experts setting"),
    ],
)
def test_a_mixtures_flags_on_a_dense_model_are_refused(flags, message, no_building, capsys):
    """Megatron-LM's MoE flags (their names for our model fields) on llama-test, which has no experts (issue 39:
    they were accepted and did nothing)."""
    code, err = _cli([*BASE_FLAGS, *flags], capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert message in err, err


@pytest.mark.parametrize(
    "flags, yaml_text, fix",
    [
        (["--moe-router-topk", "4"], None, "(fix --moe-router-topk 4)"),
        (["--num-layers", "0", "--num-attention-heads", "4"], None, "(fix --num-layers 0)"),  # the one named
        (["--num-attention-heads", "3"], "model_overrides: {hidden_size: 96}\n", "(fix --num-attention-heads 3 or"),
        ([], "model_overrides: {hidden_size: 100}\n", "(fix the YAML model_overrides)"),
    ],
)
def test_a_model_shape_error_names_the_flag_that_gave_the_value(flags, yaml_text, fix, tmp_path, no_building, capsys):
    """Review item 9: a shape that Megatron-LM's model flags set was to be fixed in 'the YAML model_overrides'."""
    config = ["--config", str(_write(tmp_path / "c.yaml", yaml_text))] if yaml_text else []
    code, err = _cli([*BASE_FLAGS, *config, *flags], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and fix in err, err
    assert ("YAML" in err) == bool(yaml_text) and "checkpoint" not in err, err


@pytest.mark.parametrize(
    "text, where, fix",
    [
        ("model: llama-test\ntp: [1\nlr: 0.1\n", "line 3, column 3", "close the list's [ with ]"),
        ("model: llama-test\n  tp: 2\n", "line 2, column 5", "indent a setting as the line above"),
        ("model: llama-test\ntp:\t2\n", "line 2, column 4", "indent with spaces: YAML does not allow tabs"),
    ],
)
@pytest.mark.parametrize("command", [BASE_FLAGS, ["plan", "--gpus", "8"]])
def test_a_yaml_syntax_error_is_one_line_with_the_place_and_the_fix(text, where, fix, command, tmp_path, capsys):
    """Review item 10: PyYAML's message spans several lines (the context, the line quoted, a caret)."""
    config = _write(tmp_path / "bad.yaml", text)
    code, err = _cli([*command, "--config", str(config)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{config} is not valid YAML at {where}: " in err and fix in err, err
