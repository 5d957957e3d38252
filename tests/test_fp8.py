"""--fp8 (torchao.float8): the rules, which layers run FP8 under each layout, FP8's numerics against bf16 (in
torchao's emulation, on CPU), layouts against the single process, and checkpoints across FP8 on and off."""

import copy
import dataclasses

import pytest
import torch
from layout import assert_matches, run_train
from plan_layouts import planned
from torch import nn

from llamatron.config.settings import config_from_values
from llamatron.errors import ConfigError
from llamatron.models import build_model, get_preset
from llamatron.parallel.layout import ParallelLayout
from llamatron.parallel.mesh import Mesh
from llamatron.parallel.pipeline import build_stage_chunks
from llamatron.parallel.tensor import apply_tensor_parallel
from llamatron.training import fp8
from llamatron.training.fp8 import FP8Matmul, apply_fp8, fp8_layers, fp8_problems
from llamatron.training.validate import validate

MODEL = get_preset("llama-test")
LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
FP8_ARGS = ["--precision", "bf16", "--fp8-emulate", "--lr", "3e-3", "--train-steps", "4"]


def _problems(**kw):
    args = dict(recipe="tensorwise", emulate=False, device="cuda", dtype_name="bf16", model=MODEL, tp=1)
    args.update(tokens_per_matmul=64, capability=(9, 0))
    args.update(kw)
    return fp8_problems(**args)


def test_fp8_runs_where_it_can_and_says_why_not_elsewhere():
    assert _problems() == [] and _problems(recipe="rowwise", capability=(8, 9)) == []
    assert _problems(recipe="none") == [] and _problems(recipe="none", device="cpu", dtype_name="fp32") == []
    assert _problems(device="cpu", emulate=True) == []
    (cpu,) = _problems(device="cpu")
    assert "FP8 tensor cores" in cpu and "this run is on cpu" in cpu
    (a100,) = _problems(capability=(8, 0))
    assert "this GPU is 8.0" in a100 and "--fp8 none" in a100
    (fp16,) = _problems(dtype_name="fp16")
    assert "--precision bf16" in fp16
    (emulate_alone,) = _problems(recipe="none", emulate=True)
    assert "--fp8-emulate needs --fp8" in emulate_alone
    assert "--fp8-emulate and --fp8-head need" in _problems(recipe="none", emulate=True, head=True)[0]
    (vocab,) = _problems(model=dataclasses.replace(MODEL, vocab_size=250), head=True)
    assert "vocabulary per rank = 250" in vocab
    assert _problems(model=dataclasses.replace(MODEL, vocab_size=250), head=True, tp=2) == []  # padded to 256
    assert _problems(model=dataclasses.replace(MODEL, vocab_size=250)) == []  # the head stays bf16 by default


def test_shapes_fp8_matmuls_cannot_take_are_named():
    (odd,) = _problems(model=dataclasses.replace(MODEL, ffn_hidden_size=168))
    assert "ffn_hidden_size per rank = 168" in odd and "multiple of 16" in odd
    (split,) = _problems(model=get_preset("llama-tiny"), tp=2)  # ffn 688 / 2 = 344
    assert "ffn_hidden_size per rank = 344" in split and "hidden_size =" not in split
    (tokens,) = _problems(tokens_per_matmul=40)
    assert "tokens per micro-batch and rank" in tokens and "= 40" in tokens
    assert _problems(model=get_preset("llama-tiny")) == []


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setattr(fp8, "torchao_missing", lambda: True)
    (missing,) = _problems()
    assert "pip install -e '.[fp8]'" in missing


def test_the_run_is_refused_before_anything_is_built():
    cfg = config_from_values({"model": "llama-test", "fp8": "tensorwise", "mock_data": True})
    with pytest.raises(ConfigError, match="FP8 tensor cores.*this run is on cpu"):
        validate(cfg, cuda_available=False)
    cfg = config_from_values({"model": "llama-test", "fp8": "rowwise", "fp8_emulate": True, "precision": "bf16"})
    assert validate(cfg, cuda_available=False).dtype_name == "bf16"


def _expected(layers) -> list[str]:
    return [f"layers.{i}.{linear}" for i in layers for linear in LINEARS]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_every_decoder_linear_runs_fp8_and_nothing_else_does(recipe):
    model = build_model(MODEL)
    params = dict(model.named_parameters())
    converted = apply_fp8(model, recipe, emulate=True)
    assert converted == fp8_layers(model) == _expected(range(MODEL.num_layers))
    assert type(model.lm_head) is nn.Linear  # the head, embedding and norms stay bf16
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params.items()}  # kept
    assert apply_fp8(build_model(MODEL), "none") == []


def test_the_head_runs_fp8_only_when_asked():
    torch.manual_seed(0)
    plain = build_model(MODEL, device="cpu").to(torch.bfloat16)
    models = {head: copy.deepcopy(plain) for head in (False, True)}
    for head, model in models.items():
        names = apply_fp8(model, "tensorwise", emulate=True, head=head)
        assert names == _expected(range(MODEL.num_layers)) + (["head"] if head else [])
    hidden = torch.randn(2, 16, MODEL.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        bf16_head, fp8_head = (models[h].logits(hidden).float() for h in (False, True))
    assert 1e-3 < float((fp8_head - bf16_head).norm() / bf16_head.norm()) < 0.08
    first_stage = Mesh(ParallelLayout(pp=2), pp_rank=0)
    chunks, _ = build_stage_chunks(get_preset("llama-test4"), first_stage)  # no head on this stage
    assert "head" not in apply_fp8(chunks[0], "tensorwise", emulate=True, head=True)


def test_tensor_parallel_layers_run_fp8_on_their_shards():
    model = build_model(MODEL)
    apply_tensor_parallel(model, Mesh(ParallelLayout(tp=2), tp_rank=1), sequence_parallel=True)
    assert apply_fp8(model, "tensorwise", emulate=True) == _expected(range(MODEL.num_layers))
    assert all(isinstance(model.get_submodule(n).linear, FP8Matmul) for n in _expected([0, 1]))
    assert not isinstance(model.lm_head.linear, FP8Matmul)  # the vocabulary-parallel head stays bf16


def test_a_pipeline_chunk_converts_only_its_own_layers():
    model = get_preset("llama-test4")
    chunks, _ = build_stage_chunks(model, Mesh(ParallelLayout(pp=2), pp_rank=1), vpp=2)  # global chunks 1 and 3
    assert [apply_fp8(c, "rowwise", emulate=True) for c in chunks] == [_expected([1]), _expected([3])]


def test_fp8_matmul_is_torchaos_float8_linear():
    """FP8Matmul (tensor-parallel layers) computes exactly what torchao's Float8Linear does, both ways."""
    torch.manual_seed(0)
    for recipe in ("tensorwise", "rowwise"):
        plain = nn.Linear(64, 96, bias=True).to(torch.bfloat16)
        model = nn.ModuleDict({"layers": nn.ModuleDict({"0": plain})})
        apply_fp8(model, recipe, emulate=True)
        assert type(model["layers"]["0"]).__name__ == "Float8Linear"
        weight = plain.weight.detach().clone().requires_grad_()
        x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        ours = FP8Matmul(recipe, emulate=True)(x2, weight, plain.bias)
        theirs = model["layers"]["0"](x)
        assert torch.equal(ours, theirs)
        theirs.float().square().sum().backward()
        ours.float().square().sum().backward()
        assert torch.equal(x.grad, x2.grad) and torch.equal(model["layers"]["0"].weight.grad, weight.grad)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_fp8_matmul_is_within_fp8s_error_of_bf16(recipe):
    torch.manual_seed(0)
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(128, 256) / 16).to(torch.bfloat16).requires_grad_()
    exact = x.float() @ w.float().t()
    out = FP8Matmul(recipe, emulate=True)(x, w)
    rel = (out.float() - exact).norm() / exact.norm()
    assert 1e-3 < rel < 0.08, rel  # e4m3 keeps 3 mantissa bits: a few percent, but never exact
    out.float().sum().backward()
    grad_x_exact = torch.ones(64, 128) @ w.float()
    assert (x.grad.float() - grad_x_exact).norm() / grad_x_exact.norm() < 0.08


SAVE_AT_2 = ["--save-interval", "2"]


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory) -> dict:
    """One process's bf16 and FP8 (tensorwise) runs, saved at steps 2 and 4: the references of the layouts and
    the checkpoints of the resumes (saving leaves a run's steps as they are)."""
    workdir = tmp_path_factory.mktemp("fp8")
    bf16 = run_train(
        ["--precision", "bf16", "--lr", "3e-3", "--train-steps", "4", *SAVE_AT_2, "--save", "bf16"], 1, workdir
    )
    tensorwise = run_train([*FP8_ARGS, "--fp8", "tensorwise", *SAVE_AT_2, "--save", "fp8"], 1, workdir)
    return {"workdir": workdir, "bf16": bf16, "tensorwise": tensorwise}


def test_fp8_trains_close_to_bf16_and_its_layouts_match_the_single_process(saved_runs):
    """Both recipes train within FP8's error of bf16 and are not bf16. Data and pipeline parallelism, and a full
    recompute, compute the same FP8 matmuls as one process (the same scales): equal up to summation order.
    Tensor parallelism scales each shard by its own amax: within FP8's error."""
    tmp_path, bf16, tensorwise = saved_runs["workdir"], saved_runs["bf16"], saved_runs["tensorwise"]
    rowwise = run_train(FP8_ARGS + ["--fp8", "rowwise"], 1, tmp_path)
    for run in (tensorwise, rowwise):
        assert_matches(bf16, run, rtol=2e-3, keys=("loss",))
        assert [r["loss"] for r in run] != [r["loss"] for r in bf16]
    assert [r["loss"] for r in tensorwise] != [r["loss"] for r in rowwise]
    args = FP8_ARGS + ["--fp8", "tensorwise"]
    for layout in (["--distributed-optimizer"], ["--pp", "2"]):
        assert_matches(tensorwise, run_train(args + layout, 2, tmp_path), rtol=1e-5)
    assert_matches(tensorwise, run_train(args + ["--recompute", "full"], 1, tmp_path), rtol=1e-5)  # FP8 again
    tp = run_train(args + ["--tp", "2", "--sequence-parallel"], 2, tmp_path)
    assert_matches(tensorwise, tp, rtol=1e-3, keys=("loss",))
    assert_matches(tensorwise, tp, rtol=1e-2, keys=("grad_norm",))


def test_checkpoints_switch_fp8_on_and_off_at_a_resume(saved_runs):
    """Weights stay bf16/fp32 under FP8: a resume with FP8 on continues the FP8 run exactly, and a resume may
    switch it off (or on) and go on from the same weights."""
    tmp_path, fp8_run, bf16_run = saved_runs["workdir"], saved_runs["tensorwise"], saved_runs["bf16"]
    resumed_on = run_train([*FP8_ARGS, "--fp8", "tensorwise", "--load", "fp8/step-2"], 1, tmp_path)
    assert_matches(fp8_run[2:], resumed_on, rtol=0)  # bitwise: the same FP8 run
    bf16_args = ["--precision", "bf16", "--lr", "3e-3", "--train-steps", "4"]
    switched_off = run_train([*bf16_args, "--load", "fp8/step-2"], 1, tmp_path)
    switched_on = run_train([*FP8_ARGS, "--fp8", "rowwise", "--load", "bf16/step-2"], 1, tmp_path)
    for reference, switched in ((fp8_run[2:], switched_off), (bf16_run[2:], switched_on)):
        assert_matches(reference, switched, rtol=2e-3, keys=("loss",))
        assert [r["loss"] for r in reference] != [r["loss"] for r in switched]


def test_the_planners_fp8_speed_up_matches_every_measured_pair():
    """plan's FP8 assumption against RESULTS.md run 9: each FP8 row's tokens/s over the bf16 row of the same
    call, predicted within 2.5% (the assumption was fitted to these rows; the test keeps the two together)."""
    import json
    from pathlib import Path

    from llamatron.planning.plan import estimate_speed

    rows = [
        json.loads(line) for line in (Path(__file__).parents[1] / "benchmarks/results-2026-12-01-run9-fp8.jsonl").open()
    ]
    plain = [r for r in rows if r["_tag"] in (f"--fp8 {r['fp8']}", f"fp8-{r['fp8']}")]  # default kernels
    bf16 = {(r["_call"], r["model"]): r for r in plain if r["fp8"] == "none"}
    checked = 0
    for r in plain:
        base = bf16.get((r["_call"], r["model"]))
        if r["fp8"] == "none" or base is None:
            continue
        lay = planned(1, 1, 1, 1, False, False, "none", r["mbs"], r["gbs"])
        model = get_preset(r["model"])
        speeds = [estimate_speed(model, lay, r["seq"], 1, 8, fp8=f).tokens_per_sec_per_gpu for f in ("none", r["fp8"])]
        measured = r["tokens_per_sec"] / base["tokens_per_sec"]
        assert abs(speeds[1] / speeds[0] / measured - 1) < 0.025, (r["_call"], r["model"], r["fp8"], measured)
        checked += 1
    assert checked == 7  # calls C, D, F, G
