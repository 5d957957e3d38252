"""Tensor and sequence parallelism: parallel layers against their nn.Module counterparts, layout-independent
init, the 70B preset on meta, config validation, and layout tests against the single-process run.

The layer and init tests spawn 4 gloo processes once each and check tp=2 (ranks {0,1} and {2,3}) and
tp=4 (all ranks) side by side.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from layout import assert_matches, free_port, run_train
from torch import nn

from llamatron.config.settings import ConfigError, config_from_values
from llamatron.models import IGNORE_INDEX, build_model, get_preset, materialize
from llamatron.models.init import init_full_tensor
from llamatron.models.inventory import num_params
from llamatron.models.transformer import VocabShard
from llamatron.parallel.layout import ParallelLayout
from llamatron.parallel.mesh import Mesh
from llamatron.parallel.tensor import (
    apply_tensor_parallel,
    gate_up_layout,
    padded_vocab_size,
    qkv_layout,
    sync_tensor_parallel_grads,
    tensor_parallel_specs,
    vocab_layout,
)
from llamatron.parallel.tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardLayout,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    contiguous_layout,
    vocab_argmax,
)
from llamatron.training.validate import validate

ATOL = 1e-5

# ---- spawning gloo groups --------------------------------------------------------------------------


def _entry(rank: int, world: int, port: int, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
        fn(rank, groups, *args)
    finally:
        dist.destroy_process_group()


def _spawn(fn, *args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_entry, args=(4, free_port(), fn, args), nprocs=4, join=True)


def _grads_and_specs(module: nn.Module, specs: dict) -> list:
    return [(p.grad, specs[name]) for name, p in module.named_parameters()]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= ATOL, f"{what}: max abs difference {err}"


def _seq_shard(x: torch.Tensor, group) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim=1)[r]


def _holders(layouts: list[ShardLayout]) -> torch.Tensor:
    """How many ranks hold each full index."""
    counts = torch.zeros(layouts[0].full_size)
    for lay in layouts:
        counts.index_add_(0, lay.real_full_index, torch.ones(len(lay.real_full_index)))
    return counts


# ---- per-layer checks (run in every spawned rank) --------------------------------------------------


def _check_column(layouts: list[ShardLayout], in_features: int, group, sp: bool, what: str) -> None:
    layout = layouts[dist.get_rank(group)]
    torch.manual_seed(1)
    ref = nn.Linear(in_features, layout.full_size)
    x = torch.randn(2, 8, in_features, requires_grad=True)
    upstream = torch.randn(2, 8, layout.full_size)
    y_ref = ref(x)
    # Rows held by several ranks (replicated KV heads) feed each holder's consumers: split their gradient.
    (y_ref * upstream).sum().backward()
    col = ColumnParallelLinear(in_features, layout, True, group, sp)
    specs = tensor_parallel_specs(col, sp)
    with torch.no_grad():
        col.weight.copy_(specs["weight"].shard(ref.weight))
        col.bias.copy_(specs["bias"].shard(ref.bias))
    x_local = (_seq_shard(x, group) if sp else x).detach().clone().requires_grad_()
    y = col(x_local)
    real, full_idx = layout.real_positions, layout.real_full_index
    _close(y.index_select(-1, real), y_ref.detach().index_select(-1, full_idx), f"{what} forward")
    local_upstream = torch.zeros(2, 8, layout.local_size)
    local_upstream[..., real] = (upstream / _holders(layouts)).index_select(-1, full_idx)
    (y * local_upstream).sum().backward()
    _close(x_local.grad, _seq_shard(x.grad, group) if sp else x.grad, f"{what} input grad")
    sync_tensor_parallel_grads(_grads_and_specs(col, specs), group)
    for name, p, ref_p in (("weight", col.weight, ref.weight), ("bias", col.bias, ref.bias)):
        _close(p.grad.index_select(0, real), ref_p.grad.index_select(0, full_idx), f"{what} local weight grad")
        _close(specs[name].gather(p.grad), ref_p.grad, f"{what} gathered weight grad")


def _check_row(in_features: int, out_features: int, group, sp: bool) -> None:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    layout = contiguous_layout(1, in_features, n, r, group)
    torch.manual_seed(2)
    ref = nn.Linear(in_features, out_features)
    x = torch.randn(2, 8, in_features, requires_grad=True)
    upstream = torch.randn(2, 8, out_features)
    y_ref = ref(x)
    (y_ref * upstream).sum().backward()
    row = RowParallelLinear(out_features, layout, True, group, sp)
    specs = tensor_parallel_specs(row, sp)
    with torch.no_grad():
        row.weight.copy_(specs["weight"].shard(ref.weight))
        row.bias.copy_(ref.bias)
    cols = layout.real_full_index
    x_local = x.detach().index_select(-1, cols).requires_grad_()
    y = row(x_local)
    _close(y, _seq_shard(y_ref.detach(), group) if sp else y_ref.detach(), f"row sp={sp} forward")
    (y * (_seq_shard(upstream, group) if sp else upstream)).sum().backward()
    # Sequence parallel: the bias saw only this rank's shard.
    sync_tensor_parallel_grads(_grads_and_specs(row, specs), group)
    _close(x_local.grad, x.grad.index_select(-1, cols), f"row sp={sp} input grad")
    _close(specs["weight"].gather(row.weight.grad), ref.weight.grad, f"row sp={sp} weight grad")
    _close(row.bias.grad, ref.bias.grad, f"row sp={sp} bias grad")


def _check_embedding(vocab: int, hidden: int, group, sp: bool) -> None:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    layout = vocab_layout(vocab, n, r, group)
    torch.manual_seed(3)
    ref = nn.Embedding(vocab, hidden)
    ids = torch.randint(0, vocab, (2, 8))
    ids[0, :4] = vocab - 1  # the last real id sits next to the padding
    upstream = torch.randn(2, 8, hidden)
    y_ref = ref(ids)
    (y_ref * upstream).sum().backward()
    emb = VocabParallelEmbedding(layout, hidden, group, sp)
    spec = tensor_parallel_specs(emb, sp)["weight"]
    with torch.no_grad():
        emb.weight.copy_(spec.shard(ref.weight))
    y = emb(ids)
    _close(y, _seq_shard(y_ref.detach(), group) if sp else y_ref.detach(), f"embedding sp={sp} forward")
    (y * (_seq_shard(upstream, group) if sp else upstream)).sum().backward()
    _close(spec.gather(emb.weight.grad), ref.weight.grad, f"embedding sp={sp} weight grad")
    padding = (layout.local_index < 0).nonzero().flatten()
    assert emb.weight.grad.index_select(0, padding).abs().sum() == 0, "padding rows got a gradient"


def _local_logits(full: torch.Tensor, layout: ShardLayout, padding_value: float) -> torch.Tensor:
    local = torch.full((*full.shape[:-1], layout.local_size), padding_value)
    local[..., layout.real_positions] = full.index_select(-1, layout.real_full_index)
    return local


def _check_cross_entropy_and_argmax(vocab: int, group) -> None:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    layout = vocab_layout(vocab, n, r, group)
    start, num_real = r * layout.local_size, len(layout.real_positions)
    torch.manual_seed(4)
    logits = (3 * torch.randn(2, 8, vocab)).requires_grad_()
    labels = torch.randint(0, vocab, (2, 8))
    labels[0, 0], labels[1, 3], labels[1, 7] = IGNORE_INDEX, vocab - 1, 0
    weights = torch.rand(2, 8)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    (ref * weights.flatten()).sum().backward()
    # Padding logits made large: a loss that did not exclude them would differ.
    local = _local_logits(logits.detach(), layout, 50.0).requires_grad_()
    shard = VocabShard(start, num_real, vocab, group)
    loss = VocabParallelCrossEntropy(shard)(local, labels)
    _close(loss.flatten(), ref.detach(), "vocab-parallel cross-entropy")
    (loss * weights).sum().backward()
    _close(
        local.grad[..., layout.real_positions],
        logits.grad.index_select(-1, layout.real_full_index),
        "vocab-parallel cross-entropy logits grad",
    )
    assert local.grad[..., num_real:].abs().sum() == 0, "padding logits got a gradient"
    scores = torch.randn(2, 8, vocab)
    scores[0, :, 0] = scores[0, :, vocab - 1] = 10.0  # a tie across ranks: the lowest id wins, like argmax
    predicted = vocab_argmax(_local_logits(scores, layout, 1e4), shard)
    assert torch.equal(predicted, scores.argmax(-1)), "vocab-parallel argmax"


def _layers_worker(rank: int, groups: dict) -> None:
    for n, group in groups.items():
        for sp in (False, True):
            _check_column([contiguous_layout(0, 48, n, i, group) for i in range(n)], 32, group, sp, f"column sp={sp}")
            _check_row(48, 32, group, sp)
            _check_embedding(200, 16, group, sp)
        # Fused QKV: kv >= tp (split), kv < tp (replicated, tp=4 with 2 and with 1 KV heads).
        for preset in ("falcon40b-test", "llama-test", "falcon-test"):
            cfg = get_preset(preset)
            layouts = [qkv_layout(cfg, n, i, group) for i in range(n)]
            _check_column(layouts, cfg.hidden_size, group, sp=False, what=f"qkv {preset} tp={n}")
        layouts = [gate_up_layout(40, n, i, group) for i in range(n)]
        _check_column(layouts, 32, group, sp=True, what=f"gate_up tp={n}")
        _check_column([vocab_layout(200, n, i, group) for i in range(n)], 16, group, sp=False, what="lm head")
        _check_cross_entropy_and_argmax(200, group)


def test_parallel_layers_match_nn_modules():
    _spawn(_layers_worker)


# ---- layout-independent init -----------------------------------------------------------------------


def _init_worker(rank: int, groups: dict, presets: tuple[str, ...]) -> None:
    for preset in presets:
        cfg = get_preset(preset)
        plain = materialize(build_model(cfg), cfg, seed=7, device="cpu", dtype=torch.float32)
        reference = dict(plain.named_parameters())
        for n, group in groups.items():
            mesh = Mesh(ParallelLayout(tp=n, dp=4 // n), rank=rank, tp_rank=dist.get_rank(group), tp_group=group)
            model = build_model(cfg)
            specs = apply_tensor_parallel(model, mesh, sequence_parallel=True)
            assert all(p.is_meta for p in model.parameters())
            materialize(model, cfg, seed=7, device="cpu", dtype=torch.float32, specs=specs)
            names = dict(model.named_parameters())
            assert names.keys() == reference.keys()
            for name, p in names.items():
                full = specs[name].gather(p.detach())
                assert torch.equal(full, reference[name]), f"{preset} tp={n}: {name} differs from the tp=1 init"
                if specs[name].tensor_parallel:  # checkpoint load: the full tensor back to this shard
                    assert torch.equal(specs[name].shard(full), p.detach()), f"{preset} tp={n}: shard of {name}"
            assert names["embed.weight"].shape[0] == padded_vocab_size(cfg.vocab_size, n) // n


def test_tp_init_gathers_to_the_single_device_weights():
    _spawn(_init_worker, ("llama-test", "falcon40b-test", "falcon-test"))


def test_llama2_70b_under_tp8_stays_on_meta_and_one_shard_materializes():
    cfg = get_preset("llama2-70b")
    full_params = dict(build_model(cfg).named_parameters())
    mesh = Mesh(ParallelLayout(tp=8), tp_rank=5)
    model = build_model(cfg)
    specs = apply_tensor_parallel(model, mesh, sequence_parallel=True)
    params = dict(model.named_parameters())
    assert all(p.is_meta for p in params.values())
    d = cfg.head_dim
    assert params["layers.0.attn.qkv.weight"].shape == ((64 // 8 + 2) * d, 8192)  # 8 query heads + 1 KV head
    assert params["layers.0.attn.o.weight"].shape == (8192, 8 * d)
    assert params["layers.0.mlp.gate_up.weight"].shape == (2 * 28672 // 8, 8192)
    assert params["layers.0.mlp.down.weight"].shape == (8192, 28672 // 8)
    assert params["embed.weight"].shape == (32768 // 8, 8192)  # vocab 32000 padded to 32768
    for name in params:
        assert specs[name].full_shape == full_params[name].shape
    local = sum(p.numel() for p in params.values())
    assert local < 1.01 * num_params(cfg) / 8 + sum(p.numel() for n, p in params.items() if "norm" in n)
    # One shard materializes from the full tensor's slice; the rest of the model stays on meta.
    o = model.layers["0"].attn.o
    materialize(o, cfg, seed=3, device="cpu", dtype=torch.float32, specs={"weight": specs["layers.0.attn.o.weight"]})
    full = init_full_tensor("layers.0.attn.o.weight", torch.Size((8192, 8192)), cfg, 3, torch.device("cpu"))
    assert torch.equal(o.weight, full[:, 5 * 8 * d : 6 * 8 * d])
    assert model.layers["0"].attn.qkv.weight.is_meta


# ---- configurations that cannot work -----------------------------------------------------------------


@pytest.mark.parametrize(
    "values, world, message",
    [
        ({"model": "llama-test", "tp": 3}, 3, "num_attention_heads=4 is not divisible by tp=3"),
        ({"model": "llama-test", "tp": 4, "model_overrides": {"ffn_hidden_size": 162}}, 4, "ffn_hidden_size=162"),
        (
            {
                "model": "llama-test",
                "tp": 4,
                "model_overrides": {"num_heads": 12, "num_kv_heads": 3, "hidden_size": 96},
            },
            4,
            "num_kv_heads=3 and tp=4",
        ),
        ({"model": "falcon-7b", "tp": 2}, 2, "num_attention_heads=71"),
        ({"model": "llama-test", "sequence_parallel": True}, 1, "--sequence-parallel needs --tp > 1"),
        ({"model": "llama-test", "tp": 4, "sequence_parallel": True, "seq_length": 30}, 4, "--seq-length 30"),
        ({"model": "llama-test", "tp": 4}, 6, "not divisible by tp*pp"),
    ],
)
def test_config_validation_rejects_tp_that_cannot_work(values, world, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace("+", r"\+")):
        validate(config_from_values(values), world_size=world)


def test_apply_tensor_parallel_rejects_unsplittable_model():
    cfg = get_preset("llama-test")
    cfg.num_kv_heads = 3
    with pytest.raises(ConfigError, match="num_kv_heads=3 and tp=2"):
        apply_tensor_parallel(build_model(cfg), Mesh(ParallelLayout(tp=2), tp_rank=0))


def test_padded_vocab_size():
    assert padded_vocab_size(32000, 1) == 32000
    assert padded_vocab_size(32000, 8) == 32768
    assert padded_vocab_size(65024, 4) == 65024
    assert padded_vocab_size(256, 4) == 512


# ---- layout tests: the public command under tp/sp against one process ----------------------------------

_REFERENCES: dict[tuple, list[dict]] = {}


def _reference(model: str, workdir: Path, args: tuple[str, ...] = ()) -> list[dict]:
    key = (model, args)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_train(list(args), 1, workdir, model=model)
    return _REFERENCES[key]


TP2, TP2_SP = (["--tp", "2"], 2), (["--tp", "2", "--sequence-parallel"], 2)
TP4, TP4_SP = (["--tp", "4"], 4), (["--tp", "4", "--sequence-parallel"], 4)
# Every family under tp 2 and tp 4 + sequence parallelism (the replicated KV rows of tp > KV heads among them);
# the other two layouts on one family each: every family, tp size and sequence split is run, not every pairing
# (the full 5 x 4 matrix was the suite's largest cost: ~10 of its CI minutes).
CASES = [
    (m, layout)
    for m in ("llama-test", "mistral-test", "llama3-test", "falcon-test", "falcon40b-test")
    for layout in (TP2, TP4_SP)
]
CASES += [("llama-test", TP2_SP), ("falcon40b-test", TP4)]


@pytest.mark.parametrize("model, layout", CASES, ids=[f"{' '.join(a)}-{m}" for m, (a, _) in CASES])
def test_tensor_parallel_layout_matches_single_process(model, layout, tmp_path_factory):
    args, nproc = layout
    workdir = tmp_path_factory.mktemp("tp")
    reference = _reference(model, tmp_path_factory.mktemp("ref"))
    assert_matches(reference, run_train(args, nproc, workdir, model=model))


@pytest.mark.parametrize("sp", [[], ["--sequence-parallel"]], ids=["tp2", "tp2-sp"])
def test_tp_without_backward_comm_overlap_matches_single_process(sp, tmp_path_factory):
    # The plain column-parallel path (gather/copy + F.linear), kept for A/B measurement.
    reference = _reference("llama-test", tmp_path_factory.mktemp("ref"))
    got = run_train(["--tp", "2", *sp, "--no-tp-comm-overlap"], 2, tmp_path_factory.mktemp("tp"), model="llama-test")
    assert_matches(reference, got)


@pytest.mark.parametrize(
    "extra",
    [[], ["--sequence-parallel", "--distributed-optimizer", "--recompute", "full"]],
    ids=["plain", "sp-distopt-recompute"],
)
def test_tp2_with_dp2_matches_single_process(extra, tmp_path_factory):
    # llama3-test has one KV head: replicated KV gradients meet data-parallel reduction (and sharded optimizer).
    reference = _reference("llama3-test", tmp_path_factory.mktemp("ref"))
    got = run_train(["--tp", "2", *extra], 4, tmp_path_factory.mktemp("tpdp"), model="llama3-test")
    assert_matches(reference, got)


def _valid_record(workdir: Path) -> dict:
    (metrics,) = workdir.glob("metrics-*.jsonl")
    return next(json.loads(line) for line in metrics.read_text().splitlines() if '"valid"' in line)


def test_public_command_llama_tiny_tp4_sequence_parallel(tmp_path):
    """torchrun --nproc-per-node 4 -m llamatron train --model llama-tiny ... --tp 4 --sequence-parallel."""
    (tmp_path / "one").mkdir()
    (tmp_path / "four").mkdir()
    args = ["--train-steps", "5", "--seq-length", "32"]
    reference = run_train(args, 1, tmp_path / "one", model="llama-tiny")
    got = run_train([*args, "--tp", "4", "--sequence-parallel"], 4, tmp_path / "four", model="llama-tiny")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert_matches(reference, got)
    # Evaluation (vocabulary-parallel loss and argmax accuracy) agrees too.
    ref_valid, valid = _valid_record(tmp_path / "one"), _valid_record(tmp_path / "four")
    assert abs(ref_valid["loss"] - valid["loss"]) <= 1e-4 * ref_valid["loss"]
    assert abs(ref_valid["accuracy"] - valid["accuracy"]) <= 1e-6


def test_biases_under_tp4_sequence_parallel_match_single_process(tmp_path):
    """Linear biases: column-parallel ones sharded (and replicated with the single KV head), row-parallel ones summed
    over the tp group under sequence parallelism."""
    config = tmp_path / "bias.yaml"
    config.write_text("model_overrides:\n  bias: true\n")
    reference = run_train(["--config", str(config)], 1, tmp_path, model="falcon-test")
    got = run_train(["--config", str(config), "--tp", "4", "--sequence-parallel"], 4, tmp_path, model="falcon-test")
    assert_matches(reference, got)
