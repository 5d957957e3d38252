"""Model FLOPs per token, written out by hand from a preset's dimensions, and every figure that uses them."""

import dataclasses
import json

import pytest
from plan_layouts import planned

from llamatron import cli
from llamatron.models import get_preset
from llamatron.models.inventory import flops_per_token, num_params
from llamatron.planning import plan as P
from llamatron.training import bench, metrics

SEQ = 32


def by_hand(cfg, seq: int) -> float:
    """6·(parameters of the matmuls, norms included) + 12·L·h·S for a Llama block, from the dimensions alone: the
    input-embedding table (a lookup) is left out, the output head (the same table when tied) is counted."""
    h, layers, ffn, vocab = cfg.hidden_size, cfg.num_layers, cfg.ffn_hidden_size, cfg.vocab_size
    kv = cfg.num_kv_heads * (h // cfg.num_heads)
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn + 2 * h  # QKV, output projection, gate/up/down, 2 RMSNorms
    head = vocab * h
    return 6.0 * (layers * per_layer + h + head) + 12.0 * layers * h * seq


def test_untied_input_embedding_is_not_counted():
    cfg = get_preset("llama-test")
    assert not cfg.tie_embeddings
    table = cfg.vocab_size * cfg.hidden_size
    attention = 12.0 * cfg.num_layers * cfg.hidden_size * SEQ
    assert flops_per_token(cfg, SEQ) == by_hand(cfg, SEQ)
    # N itself still holds both tables; only the FLOPs leave the lookup out.
    assert flops_per_token(cfg, SEQ) == 6.0 * (num_params(cfg) - table) + attention


def test_tied_embedding_is_counted_once_as_the_head():
    cfg = dataclasses.replace(get_preset("llama-test"), tie_embeddings=True)
    assert flops_per_token(cfg, SEQ) == by_hand(cfg, SEQ)  # the head's matmul, not left out with the lookup
    assert flops_per_token(cfg, SEQ) == 6.0 * num_params(cfg) + 12.0 * cfg.num_layers * cfg.hidden_size * SEQ


def _observed(row: dict) -> float:
    """FLOPs per token a row's TFLOP/s implies, after checking its MFU is that over the (patched) peak."""
    assert row["mfu"] == pytest.approx(row["tflops_per_gpu"] / PEAK, rel=1e-12)
    return row["tflops_per_gpu"] * 1e12 / row["tokens_per_sec"]


PEAK = 100.0
ARGS = ["--model", "llama-test", "--mock-data", "--device", "cpu", "--precision", "fp32", "--seq-length", str(SEQ)]
ARGS += ["--micro-batch-size", "1", "--global-batch-size", "2"]


def test_metrics_bench_and_plan_count_the_same_flops(tmp_path, monkeypatch, capsys):
    """The trainer's records, bench's row and the planner's MFU all use the hand-written count."""
    monkeypatch.setattr(metrics, "peak_tflops", lambda device: PEAK)  # a known peak, so MFU is not null
    monkeypatch.setattr(bench, "peak_tflops", lambda device: PEAK)
    monkeypatch.chdir(tmp_path)
    want = by_hand(get_preset("llama-test"), SEQ)

    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", *ARGS, "--train-steps", "2", "--log-interval", "1", "--no-progress", "--metrics-file", "m"])
    assert exit_.value.code == 0
    records = [json.loads(line) for line in (tmp_path / "m").read_text().splitlines()]
    steps = [r for r in records if r.get("split") is None]
    assert steps and all(_observed(r) == pytest.approx(want, rel=1e-9) for r in steps)

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", *ARGS, "--steps", "1", "--warmup", "0", "--json"])
    assert exit_.value.code == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert _observed(row) == pytest.approx(want, rel=1e-9)

    layout = planned(1, 1, 1, 1, False, False, "none", 1, 2)
    speed = P.estimate_speed(get_preset("llama-test"), layout, SEQ, 1, 8)
    hw = P.SpeedAssumptions()
    assert speed.mfu * hw.peak_flops / speed.tokens_per_sec_per_gpu == pytest.approx(want, rel=1e-9)


def test_results_conversion_factors_are_the_codes():
    """benchmarks/RESULTS.md converts its old MFU rows (6·N with the input table) by new/old FLOPs of each shape."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md").read_text()
    table = text.split("| model | overrides | seq | new / old |")[1].split("\n\n")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.strip().splitlines()[1:]]
    assert {(r[0], r[2]) for r in rows} >= {("llama-1b", "4096"), ("llama2-7b", "4096")}
    for model, overrides, seq, factor in rows:
        changes = {} if overrides == "—" else {k: int(v) for k, v in (o.split(": ") for o in overrides.split(", "))}
        cfg = dataclasses.replace(get_preset(model), **changes)
        keys = min(int(seq), cfg.sliding_window or int(seq))
        old = 6.0 * num_params(cfg) + 12.0 * cfg.num_layers * cfg.hidden_size * keys
        assert float(factor) == round(flops_per_token(cfg, int(seq)) / old, 4), (model, overrides, seq)


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("dense_ffn", [0, 40])
@pytest.mark.parametrize("experts, capacity", [(0, None), (4, None), (4, 0.5)], ids=["dense", "moe", "moe-capacity"])
def test_mean_mlp_width_is_the_mean_of_each_layers_width(step, dense_ffn, experts, capacity):
    """The closed form against the layers written out: layer_ffn(i), times the experts a token reaches in a MoE
    layer (experts_per_token, a capacity factor below 1 keeping that share of them) — a dense model's
    dense_ffn_hidden_size included (its step-1 shortcut once gave ffn_hidden_size)."""
    from llamatron.models.inventory import mean_mlp_width

    changes = {"num_layers": 7, "moe_layer_step": step, "dense_ffn_hidden_size": dense_ffn}
    cfg = get_preset("mixtral-test").with_changes({**changes, "num_experts": experts, "moe_capacity_factor": capacity})
    taken = cfg.experts_per_token * min(1.0, capacity or 1.0)
    widths = [cfg.layer_ffn(i) * (taken if experts and (i + 1) % step == 0 else 1) for i in range(7)]
    assert mean_mlp_width(cfg) == pytest.approx(sum(widths) / 7, rel=1e-12)


def test_the_attention_term_is_each_layers_own_width(monkeypatch):
    """12·Σ_layers w·S with w read off each layer's attention module (`flops_width`, a family's own attention may
    declare another): Llama 4's test model (head_dim given, chunked and NoPE layers) written out by hand, then the
    shared attention's width doubled moves exactly that term."""
    from llamatron.models import inventory
    from llamatron.models.layers import Attention

    cfg = get_preset("llama4-test")
    seq = 48  # longer than its chunks of 16
    spans = [min(seq, cfg.attention_chunk_size) if cfg.layer_has_rope(i) else seq for i in range(cfg.num_layers)]
    attention = 12.0 * cfg.num_heads * cfg.head_dim * sum(spans)
    matmuls = flops_per_token(cfg, seq) - attention
    assert matmuls == pytest.approx(6.0 * (inventory.active_params(cfg) - cfg.vocab_size * cfg.hidden_size))
    doubled = cfg.with_changes({"init_std": 0.03})  # another config: nothing cached for it
    monkeypatch.setattr(Attention, "flops_width", property(lambda self: 2 * self.num_heads * self.head_dim))
    assert flops_per_token(doubled, seq) == pytest.approx(matmuls + 2 * attention)
