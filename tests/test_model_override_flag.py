"""`--model-override FIELD=VALUE` (config/model_overrides.py): a model field on the command line of train, bench and
plan, as a --config file's model_overrides gives it and over the file's, field by field; each mistake one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_plan_cli import main_code

from llamatron.config.model_overrides import parse_model_overrides
from llamatron.models import get_preset
from llamatron.models.inventory import flops_per_token

TRAIN = ["train", "--model", "mixtral-test", "--mock-data", "--device", "cpu", "--no-progress", "--seq-length", "32"]
TRAIN += ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-steps", "1", "--eval-iters", "1"]
PLAN = ["plan", "--gpus", "8", "--json", "--no-simulate", "--top", "3"]


def _config(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _train(tmp_path: Path, name: str, *flags: str) -> tuple[dict, dict]:
    """A one-step CPU run's metrics record and the model config its checkpoint saved."""
    run = tmp_path / name
    argv = [*TRAIN, "--metrics-file", str(run / "m.jsonl"), "--save", str(run / "ck"), *flags]
    assert main_code(argv) == 0
    record = json.loads((run / "m.jsonl").read_text().splitlines()[0])
    return record, json.loads((run / "ck/step-1/meta.json").read_text())["model_config"]


def test_train_takes_the_flags_over_the_config_files_model_overrides(tmp_path, capsys):
    """The file sets a capacity factor of 2 and one layer; the flag's 0.25 replaces the factor only. The run is the
    one the file would make with 0.25 in it, and drops what a capacity of ceil(0.25 * seq * k / experts) per
    sequence must: every expert gets more than that at this factor (4 experts, top-2: ~16 assignments each)."""
    file = _config(tmp_path / "file.yaml", "model_overrides: {moe_capacity_factor: 2.0, num_layers: 1}\n")
    flagged, model = _train(tmp_path, "flag", "--config", file, "--model-override", "moe_capacity_factor=0.25")
    same = _config(tmp_path / "same.yaml", "model_overrides: {moe_capacity_factor: 0.25, num_layers: 1}\n")
    by_file, by_file_model = _train(tmp_path, "file", "--config", same)
    assert (model["moe_capacity_factor"], model["num_layers"]) == (0.25, 1) and model == by_file_model
    assert flagged["loss"] == by_file["loss"]
    seq, k, experts = 32, model["experts_per_token"], model["num_experts"]
    kept = experts * math.ceil(0.25 * seq * k / experts)
    assert flagged["moe_dropped_fraction"] == pytest.approx(1 - kept / (seq * k)) == by_file["moe_dropped_fraction"]


def test_plan_takes_the_flags_over_the_config_files_model_overrides(tmp_path, capsys):
    def planned(*argv: str) -> dict:
        assert main_code([*PLAN, *argv]) == 0
        return json.loads(capsys.readouterr().out)

    head = "model: llama2-7b\nmodel_overrides: {ffn_hidden_size: 8192, "
    file = _config(tmp_path / "file.yaml", head + "num_layers: 16}\n")
    same = _config(tmp_path / "same.yaml", head + "num_layers: 8}\n")
    flagged = planned("--config", file, "--model-override", "num_layers=8")
    assert flagged == planned("--config", same) != planned("--config", file)
    plain = _config(tmp_path / "plain.yaml", "model: llama2-7b\nmodel_overrides: {num_layers: 8}\n")
    assert flagged != planned("--config", plain)  # the file's ffn_hidden_size stayed


def test_bench_runs_and_lists_the_flags_model(capsys):
    """The row's FLOPs per token (TFLOP/s over tokens/s) are the overridden model's, not the preset's."""
    argv = ["bench", "--model", "llama-test", "--device", "cpu", "--seq-length", "16", "--micro-batch-size", "1"]
    argv += ["--global-batch-size", "1", "--steps", "1", "--warmup", "0", "--json"]
    changes = {"num_layers": 1, "ffn_hidden_size": 48}
    assert main_code([*argv, "--model-override", "num_layers=1", "--model-override", "ffn_hidden_size=48"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["model_overrides"] == changes
    preset = get_preset("llama-test")
    measured = row["tflops_per_gpu"] * 1e12 / row["tokens_per_sec"]
    assert measured == pytest.approx(flops_per_token(preset.with_changes(changes), 16))
    assert measured != pytest.approx(flops_per_token(preset, 16))


@pytest.mark.parametrize(
    "item, value",
    [
        ("moe_capacity_factor=1.25", 1.25),
        ("moe_capacity_factor=1e-3", 0.001),  # YAML 1.1 reads it as text; the field is a number
        ("moe_capacity_factor=null", None),
        ("num_layers=4", 4),
        ("router_expert_bias=true", True),
        ("router_aux_loss_scope=global_batch", "global_batch"),
        ("rope_theta=500000", 500000),  # a float field takes an integer, as in YAML
        ("num_kv_heads=null", None),  # derived from num_heads
        ("router-score=sigmoid", "sigmoid"),  # the flag spelling of a field
    ],
)
def test_values_are_read_as_yaml_scalars_of_the_fields_type(item, value):
    field = item.split("=")[0].replace("-", "_")
    got = parse_model_overrides([item])
    assert got.values == {field: value} and type(got.values[field]) is type(value)
    assert got.flags == {field: f"--model-override {item}"}


def test_a_later_flag_for_a_field_wins():
    assert parse_model_overrides(["num_layers=2", "num_layers=3"]).values == {"num_layers": 3}


@pytest.mark.parametrize(
    "item, message",
    [
        ("num_layers", "--model-override 'num_layers': give FIELD=VALUE, e.g. --model-override num_layers=4"),
        ("=4", "give FIELD=VALUE, e.g. --model-override num_layers=4"),
        ("num_layerz=4", "unknown model field 'num_layerz' (did you mean 'num_layers'?)"),
        ("is_moe=true", "unknown model field 'is_moe' (the fields are llamatron/models/config.py's ModelConfig)"),
        ("num_layers=four", "--model-override num_layers=four: num_layers 'four' must be an integer"),
        ("num_layers=2.5", "num_layers 2.5 must be an integer"),
        ("moe_capacity_factor=fast", "moe_capacity_factor 'fast' must be a finite number"),
        ("num_layers=[1", "'[1' is not a YAML value (expected ',' or ']'"),
        ("router_score=no", """quote the word, --model-override "router_score='no'\""""),
        ("num_layers=!!python/object/apply:os.getcwd []", "is not a YAML value"),  # safe_load constructs nothing
        ("rope_scaling={factor: 2}", "rope_scaling {'factor': 2}: missing kind"),
    ],
)
@pytest.mark.parametrize(
    "command",
    [TRAIN, ["bench", "--model", "mixtral-test"], ["plan", "--model", "mixtral-test", "--gpus", "8"]],
    ids=["train", "bench", "plan"],
)
def test_a_bad_flag_is_one_line_naming_the_fix(item, message, command, capsys):
    assert main_code([*command, "--model-override", "num_layers=1", "--model-override", item]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("command", [TRAIN, ["plan", "--model", "mixtral-test", "--gpus", "8"]], ids=["train", "plan"])
def test_a_shape_error_names_the_flag_that_gave_the_value(command, tmp_path, capsys):
    file = _config(tmp_path / "c.yaml", "model_overrides: {num_layers: 1}\n")
    argv = [*command, "--config", file, "--model-override", "experts_per_token=9"]
    assert main_code(argv) == 2
    err = capsys.readouterr().err
    assert "(fix --model-override experts_per_token=9 or the YAML model_overrides)" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_field_given_by_a_megatron_flag_and_the_override_is_refused(capsys):
    assert main_code([*TRAIN, "--num-layers", "2", "--model-override", "num_layers=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--num-layers 2 and --model-override num_layers=3 both set num_layers: give one of them")


def test_an_unknown_flag_naming_a_model_field_points_to_the_override(capsys):
    assert main_code([*TRAIN, "--moe-capacity-factor", "1.5"]) == 2
    assert "set it with --model-override moe_capacity_factor=VALUE or in a YAML file" in capsys.readouterr().err


DENSE_TRAIN = [*TRAIN[:2], "llama-test", *TRAIN[3:]]
DENSE_PLAN = ["plan", "--model", "llama2-7b", "--gpus", "8"]


@pytest.mark.parametrize(
    "command, field, flag",
    [
        (DENSE_TRAIN, "experts_per_token", "--moe-router-topk 2"),  # Megatron-LM's flag, at the field's default
        (DENSE_TRAIN, "experts_per_token", "--model-override experts_per_token=2"),
        (DENSE_TRAIN, "router_score", "--model-override router_score=softmax"),
        (DENSE_TRAIN, "experts_per_token", "--model-override experts_per_token=3"),  # not the default
        (DENSE_PLAN, "experts_per_token", "--model-override experts_per_token=2"),
        (DENSE_PLAN, "moe_renormalize", "--model-override moe_renormalize=true"),
    ],
)
def test_a_moe_setting_given_for_a_dense_model_is_refused_whatever_its_value(command, field, flag, capsys):
    """A mixture-of-experts setting the user gave does nothing on a dense model, at its default too (2, softmax and
    true are the defaults: they passed, where 3 was refused)."""
    assert main_code([*command, *flag.split()]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{field} " in err and "this model is dense" in err and f"(fix {flag})" in err, err
    assert len(err.splitlines()) == 1, err


def test_moe_settings_of_a_model_with_experts_may_be_given_at_their_defaults(capsys):
    plan = ["plan", "--model", "mixtral-test", "--gpus", "8", "--no-simulate", "--top", "1"]
    given = ["--model-override", "experts_per_token=2", "--model-override", "router_score=softmax"]
    assert main_code([*plan, *given]) == 0
