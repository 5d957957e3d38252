import argparse
import dataclasses
import sys

import pytest
import torch
import yaml

from llamatron.config.settings import add_config_arguments, config_from_values, load_config
from llamatron.errors import ConfigError
from llamatron.kernels import flash4_op
from llamatron.kernels.choices import KernelChoices
from llamatron.training.kernel_settings import kernel_choices
from llamatron.training.validate import validate


def parse(argv):
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return load_config(p.parse_args(argv))


def test_flags_override_yaml_and_defaults(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"micro_batch_size": 2, "lr": 0.5, "tp": 2, "sequence_parallel": True}))
    cfg = parse(["--config", str(f), "--lr", "0.25"])
    assert cfg.train.micro_batch_size == 2
    assert cfg.optim.lr == 0.25
    assert cfg.parallel.tp == 2 and cfg.parallel.sequence_parallel is True
    assert cfg.train.global_batch_size == 16  # default untouched


def test_unknown_yaml_key_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("micro_batch: 3\n")
    with pytest.raises(ConfigError, match="micro_batch"):
        parse(["--config", str(f)])


@pytest.mark.parametrize(
    "line, message",
    [
        ("swiglu_backend: fast", r"swiglu_backend \(--swiglu-backend\): 'fast' is not one of auto, triton, torch"),
        ("adamw_kernel: foo", r"'foo' is not one of auto, torch, triton"),
        ("device: tpu", r"device \(--device\): 'tpu' is not one of auto, cpu, cuda"),
        ("precision: fp8", r"'fp8' is not one of"),
        ("train_steps: many", r"train_steps \(--train-steps\): 'many' is not an integer"),
        ("train_steps: 2.5", r"2.5 is not an integer"),
        ("lr: fast", r"'fast' is not a number"),
        ("distributed_optimizer: 1", r"1 is not true or false"),
        ("micro_batch_size:", r"micro_batch_size \(--micro-batch-size\) is empty"),
    ],
)
def test_yaml_values_get_the_checks_flags_get(tmp_path, line, message):
    """A YAML value of the wrong type or outside the choices is named, as the flag's argparse check would."""
    f = tmp_path / "c.yaml"
    f.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        parse(["--config", str(f)])


def test_yaml_numbers_and_lists_are_taken_as_flags_would_be(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lr: 3e-4\nmin_lr: 0\ntrain_steps: '7'\neval_metrics: loss accuracy\nsave: null\n")
    cfg = parse(["--config", str(f)])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.min_lr, float) and cfg.train.train_steps == 7
    assert cfg.train.eval_metrics == ["loss", "accuracy"] and cfg.train.save is None


def test_model_overrides():
    cfg = config_from_values({"model": "llama-test", "model_overrides": {"num_layers": 3}})
    assert cfg.model_config().num_layers == 3
    with pytest.raises(ConfigError, match="nonsense"):
        config_from_values({"model_overrides": {"nonsense": 1}}).model_config()


@pytest.mark.parametrize(
    "values, world, message",
    [
        ({"model": "llama-test", "tp": 3}, 3, r"not divisible by tp=3; use tp in \[1, 2, 4\]"),
        (
            {"model": "llama-test", "global_batch_size": 6, "micro_batch_size": 2},
            2,
            "not a multiple of micro-batch-size x data-parallel size",
        ),
        ({"model": "llama-test", "tp": 2}, 3, "world size 3 is not divisible by tp\\*pp"),
        ({"model": "llama-test", "vpp": 2}, 1, "--vpp needs --pp > 1"),
        (
            {"model": "llama-test", "pp": 2, "pp_layers": "1,2"},
            2,
            "--pp-layers must give 2 positive counts summing to 2",
        ),
        ({"model": "llama-7b", "pp": 3}, 3, "32 layers are not divisible by pp\\*vpp = 3"),
        ({"model": "llama-test", "sequence_parallel": True}, 1, "--sequence-parallel needs --tp > 1"),
        ({"model": "llama-test", "device": "cuda"}, 1, "no CUDA GPU"),
        ({"model": "no-such-model"}, 1, "unknown model preset 'no-such-model'; choose one of"),
        ({"model": "llama-tinyy"}, 1, r"unknown model preset 'llama-tinyy' \(did you mean 'llama-tiny'\?\); choose"),
        ({"model": "llama-test", "min_lr": 1.0, "lr": 0.1}, 1, "--min-lr 1.0 is above --lr"),
        ({"model": "llama-test", "finetune": True}, 1, "--finetune needs --load"),
        ({"model": "llama-test", "dp_comm_max_ctas": 0}, 1, "--dp-comm-max-ctas 0 must be >= 1"),
        ({"model": "llama-test", "attention_backend": "flash"}, 1, "--attention-backend flash picks a CUDA kernel"),
        ({"model": "llama-test", "swiglu_backend": "triton"}, 1, "--swiglu-backend triton runs on CUDA only"),
        ({"model": "llama-test", "rmsnorm_backend": "triton"}, 1, "--rmsnorm-backend triton runs on CUDA only"),
        ({"model": "falcon-test", "rmsnorm_backend": "triton"}, 1, "Falcon models use LayerNorm, not RMSNorm"),
        ({"model": "falcon-test", "swiglu_backend": "triton"}, 1, "Falcon models use a GELU MLP, not SwiGLU"),
        ({"model": "llama-test", "adamw_kernel": "triton"}, 1, "--adamw-kernel triton runs on CUDA only"),
        ({"model": "llama-test", "rope_backend": "triton"}, 1, "--rope-backend triton runs on CUDA only"),
        (
            {"model": "llama-test", "cross_entropy_backend": "triton"},
            1,
            "--cross-entropy-backend triton runs on CUDA only",
        ),
        (
            {"model": "llama-test", "cross_entropy_backend": "triton", "tp": 2},
            2,
            "the loss is the vocabulary-parallel one",
        ),
        (
            {"model": "llama-test", "rope_backend": "triton", "model_overrides": {"hidden_size": 96}},
            1,
            "--rope-backend triton needs a power-of-two head dim; this model's is 24",
        ),
        ({"model": "llama-test", "dp_comm_max_ctas": 4}, 1, "--dp-comm-max-ctas 4 tunes NCCL; on cpu"),
        # model shapes that trained silently wrong (no attention) or crashed deep inside the model
        ({"model": "llama-test", "model_overrides": {"num_kv_heads": 0}}, 1, "num_kv_heads 0 must be >= 1"),
        ({"model": "llama-test", "model_overrides": {"sliding_window": 0}}, 1, "sliding_window 0 must be >= 1"),
        ({"model": "llama-test", "model_overrides": {"sliding_window": -4}}, 1, "sliding_window -4 must be >= 1"),
        (
            {"model": "llama-test", "model_overrides": {"rope_scaling": {"kind": "linear", "factor": 0}}},
            1,
            "rope_scaling factor 0 must be a positive number",
        ),
        (
            {"model": "llama-test", "model_overrides": {"rope_scaling": {"kind": "longrope", "factor": 4.0}}},
            1,
            "rope_scaling kind 'longrope' must be linear, dynamic, llama3 or yarn",
        ),
        (
            {"model": "llama-test", "model_overrides": {"num_heads": 3, "num_kv_heads": 3}},
            1,
            "hidden_size 64 is not divisible by num_heads 3",
        ),
        (
            {"model": "llama-test", "model_overrides": {"hidden_size": 60}},
            1,
            r"head dim 15 \(hidden_size / num_heads\) must be even",
        ),
        (
            {"model": "llama-test", "model_overrides": {"num_kv_heads": 3}},
            2,
            "num_heads 4 is not divisible by num_kv_heads 3",
        ),
        # settings that were ignored or meaningless
        (
            {"model": "llama-test4", "pp": 2, "vpp": 4},
            2,
            r"pp\*vpp = 8 model chunks but only 4 layers.*lower --vpp or --pp",
        ),
        ({"model": "llama-test", "recompute_layers": 1}, 1, "--recompute-layers 1 needs --recompute full or selective"),
        (
            {"model": "llama-test", "recompute": "full", "recompute_layers": 5},
            1,
            r"--recompute-layers 5: a model chunk holds at most 2 layers \(pp\*vpp = 1\); give 0..2",
        ),
        ({"model": "llama-test", "recompute": "full", "recompute_layers": -1}, 1, "--recompute-layers -1"),
        ({"model": "llama-test", "bucket_size": 0}, 1, "--bucket-size 0 must be >= 1"),
        ({"model": "llama-test", "clip_grad": -1.0}, 1, "--clip-grad -1.0 must be >= 0"),
    ],
)
def test_bad_configs_name_the_fix(values, world, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        validate(config_from_values(values), world_size=world, cuda_available=False)


def test_derived_sizes():
    cfg = config_from_values({"model": "llama-test", "tp": 2, "global_batch_size": 16, "micro_batch_size": 2})
    d = validate(cfg, world_size=8)
    assert (d.dp, d.grad_accum_steps, d.device, d.dtype_name) == (4, 2, "cpu", "fp32")


def test_fp16_with_bf16_gradient_reduction_is_refused():
    cfg = config_from_values({"model": "llama-test", "precision": "fp16", "grad_reduce_dtype": "bf16"})
    with pytest.raises(ConfigError, match="mixes two half types"):
        validate(cfg, world_size=1)


def test_unknown_flag_is_reported_by_the_command_with_a_suggestion(capsys):
    from llamatron.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--micro-batch-sise", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "llamatron train: error: unrecognized arguments: --micro-batch-sise 2" in err
    assert "did you mean --micro-batch-size" in err


@pytest.mark.parametrize("flag", ["--sliding-window", "--rope-theta"])
def test_a_flag_naming_a_model_field_points_to_model_overrides(flag, capsys):
    from llamatron.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "llama-test", flag, "16"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    field = flag[2:].replace("-", "_")
    assert f"{flag}: {field} is a field of the model" in err and f"model_overrides: {{{field}: VALUE}}" in err, err
    assert "did you mean" not in err


def test_a_bad_value_is_reported_in_two_lines_not_after_the_whole_usage(capsys):
    from llamatron.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--tp", "two"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "llamatron bench: error: argument --tp: invalid int value: 'two'",
        "(see `llamatron bench --help` for the options)",
    ]


def test_math_attention_backend_is_accepted_on_cpu():
    """SDPA's math kernel is what runs off CUDA, so forcing it there is allowed (the other kernels are refused)."""
    cfg = config_from_values({"model": "llama-test", "attention_backend": "math"})
    assert validate(cfg, 1).device == "cpu"


def test_fa4_attention_is_refused_for_head_dims_and_dtypes_it_has_no_kernels_for():
    """Checked before any CUDA call (so it runs here): FA4's backward was measured wrong for head dim 16, and
    its kernels assert bf16/fp16/fp8 inputs."""
    cfg = config_from_values({"model": "llama-test", "attention_backend": "fa4"})
    with pytest.raises(ConfigError, match="supports head dims 64, 96, 128 .*; this model's is 16"):
        validate(cfg, world_size=1, cuda_available=True)
    cfg = config_from_values({"model": "llama-1b", "attention_backend": "fa4", "precision": "fp32"})
    with pytest.raises(ConfigError, match="runs in bf16 or fp16, not fp32: use --precision bf16"):
        validate(cfg, world_size=1, cuda_available=True)


def test_fa4_that_fails_to_import_is_reported_with_its_error(tmp_path, monkeypatch, request):
    """An installed but broken flash_attn says why, not only "pip install" (the check runs before CUDA calls)."""
    package = tmp_path / "flash_attn"
    (package / "cute").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('libcute_dsl.so: cannot open shared object file')\n")
    (package / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    flash4_op.unavailable_reason.cache_clear()  # found once per process: ask again with the broken package
    request.addfinalizer(flash4_op.unavailable_reason.cache_clear)
    cfg = config_from_values({"model": "llama-1b", "attention_backend": "fa4"})
    with pytest.raises(
        ConfigError,
        match=r"FlashAttention 4 \(importing flash_attn failed: ImportError: "
        r"libcute_dsl.so: cannot open",
    ):
        validate(cfg, world_size=1, cuda_available=True)


def _kernel_choices(cfg, device: str) -> dict[str, str]:
    """kernel_choices of a RunConfig on `device`, --precision auto resolved as validate does."""
    dtype = cfg.train.precision if cfg.train.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
    flags = KernelChoices.of(cfg.train, cfg.optim)
    return dataclasses.asdict(kernel_choices(flags, cfg.parallel.tp, device, dtype, cfg.model_config()))


def test_kernel_choices_resolve_auto_as_the_code_does(monkeypatch):
    """What `bench --json` records as "kernels" and the planner and engine use: auto resolved."""
    import llamatron.training.kernel_settings as kernel_settings

    def run(values, device="cuda", has_triton=True):
        monkeypatch.setattr(kernel_settings, "HAS_TRITON", has_triton)
        return _kernel_choices(config_from_values(values), device)

    assert run({"model": "llama-test"}) == {
        "attention": "auto",
        "swiglu": "triton",
        "rmsnorm": "triton",
        "rope": "triton",
        "cross_entropy": "triton",
        "adamw": "triton",
    }
    assert run({"model": "llama-test", "cross_entropy_backend": "torch"})["cross_entropy"] == "torch"
    assert run({"model": "llama-test", "tp": 2})["cross_entropy"] == "-"  # the vocabulary-parallel loss
    assert run({"model": "llama-test", "rope_backend": "torch", "rmsnorm_backend": "torch"})["rope"] == "torch"
    assert run({"model": "llama-test", "model_overrides": {"hidden_size": 96}})["rope"] == "torch"  # head dim 24
    assert run({"model": "llama-test"}, has_triton=False)["swiglu"] == "torch"
    assert run({"model": "falcon-test"}) | {"adamw": "-"} == {
        "attention": "auto",
        "swiglu": "-",
        "rmsnorm": "-",
        "rope": "triton",
        "cross_entropy": "triton",
        "adamw": "-",
    }
    assert set(run({"model": "llama-test"}, device="cpu").values()) == {"auto", "torch"}


def test_auto_attention_takes_fa4_exactly_where_it_can_run(monkeypatch):
    """--attention-backend auto resolves to fa4 with FlashAttention 4 installed on Hopper in bf16 at a head dim it
    tunes; any one of those missing keeps SDPA's pick (auto)."""
    import llamatron.training.kernel_settings as kernel_settings

    monkeypatch.setattr(kernel_settings, "unavailable_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))

    def attention(values, device="cuda"):
        return _kernel_choices(config_from_values({"model": "llama-1b", **values}), device)["attention"]

    assert attention({}) == "fa4"
    assert attention({"attention_backend": "cudnn"}) == "cudnn"
    assert attention({"precision": "fp32"}) == "auto"
    assert attention({}, device="cpu") == "auto"
    assert attention({"model": "llama-test"}) == "auto"  # head dim 16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert attention({}) == "auto"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(kernel_settings, "unavailable_reason", lambda: "flash_attn.cute is not installed")
    assert attention({}) == "auto"
