"""`llamatron plan`'s search: known minimum GPU counts and their explanations, the ranking by expected speed, bad
inputs and the command (the memory model it searches with: test_plan.py)."""

import contextlib
import dataclasses
import json
import re
import signal

import pytest
from test_plan_cli import main_code

from llamatron.cli import main
from llamatron.commands.plan import parse_memory
from llamatron.config.settings import ConfigError
from llamatron.models import get_preset
from llamatron.models.inventory import num_params
from llamatron.planning import plan as P
from llamatron.planning import search as S
from llamatron.planning.plan import GB

# ---- known minimums and explanations ------------------------------------------------------------------------


def _fits(model, gpus, memory_gb, seq, **kw):
    return S.plan(model, gpus, memory_gb * GB, seq, **kw)


def test_llama2_7b_minimum_is_two_80gb_gpus_with_tp2():
    two = _fits("llama2-7b", 2, 80, 4096)
    assert any(p.layout.tp == 2 and p.layout.pp == 1 for p in two.fits)
    one = _fits("llama2-7b", 1, 80, 4096)
    assert not one.fits
    static = 18 * num_params(get_preset("llama2-7b")) / GB
    assert f"weights+grads+optimizer alone need {static:.1f} GB" in one.explanation
    assert "at least 2 GPUs" in one.explanation


def test_llama2_7b_on_one_141gb_gpu_needs_full_recompute():
    result = _fits("llama2-7b", 1, 141, 4096)
    assert result.fits and {p.layout.recompute for p in result.fits} == {"full"}


def test_partial_recompute_recomputes_the_fewest_layers_that_fit():
    """7B on one 141 GB GPU: no recompute does not fit; the plan's best recomputes only the first N layers,
    the fewest that fit (N - 1 does not), and beats recomputing all 32."""
    result = _fits("llama2-7b", 1, 141, 4096, global_batch_size=8)
    best = result.fits[0]
    n = best.layout.recompute_layers
    assert best.layout.recompute == "full" and n is not None and 0 < n < 32
    assert best.layout.recompute_label == f"full:{n}"
    model = get_preset("llama2-7b")
    fewer = P.layout_memory(model, dataclasses.replace(best.layout, recompute_layers=n - 1), 4096)
    assert best.memory.total <= 141 * GB < fewer.total
    everything = P.estimate_speed(model, dataclasses.replace(best.layout, recompute_layers=None), 4096, 1, 8)
    assert best.speed.tokens_per_sec_per_gpu > everything.tokens_per_sec_per_gpu


def test_llama2_70b_minimum_is_24_gpus_with_fsdp_and_32_with_tp8_pp4():
    result = _fits("llama2-70b", 32, 80, 4096)
    assert any((p.layout.tp, p.layout.pp) == (8, 4) for p in result.fits)
    assert all(p.memory.total <= 80 * GB for p in result.fits)
    assert not _fits("llama2-70b", 16, 80, 4096, explain=False).fits
    eight = _fits("llama2-70b", 8, 80, 4096)
    assert not eight.fits and "at least 24 GPUs" in eight.explanation  # --fsdp shards what tp x pp cannot
    needed = float(re.search(r"alone need ([0-9.]+) GB per GPU", eight.explanation).group(1))
    assert needed == pytest.approx(18 * num_params(get_preset("llama2-70b")) / 8 / GB, rel=0.02)
    assert "even sharded perfectly over all 8 GPUs" in eight.explanation  # 18 bytes a parameter / 8, as --fsdp


def test_falcon_40b_minimum_is_16_gpus():
    assert _fits("falcon-40b", 16, 80, 2048).fits
    eight = _fits("falcon-40b", 8, 80, 2048)
    assert not eight.fits and "at least 16 GPUs" in eight.explanation


def _linear_minimum(model, memory_gb, seq, gpus_per_node=8, limit=512):
    counts = [2**i for i in range(32) if 2**i < gpus_per_node] + list(range(gpus_per_node, limit + 1, gpus_per_node))
    return next(
        (g for g in counts if _fits(model, g, memory_gb, seq, gpus_per_node=gpus_per_node, explain=False).fits), None
    )


@pytest.mark.parametrize(
    "model,memory_gb,seq,gpus_per_node",
    [
        ("llama2-70b", 24, 4096, 8),
        ("llama2-70b", 40, 16384, 8),
        ("llama2-70b", 24, 4096, 6),
        ("llama2-7b", 16, 4096, 8),
    ],
)
def test_minimum_gpus_search_finds_what_trying_every_count_finds(model, memory_gb, seq, gpus_per_node):
    expected = _linear_minimum(model, memory_gb, seq, gpus_per_node)
    assert expected is not None and expected > 8  # the searches below pass doubling counts that fail
    assert S.minimum_gpus(model, memory_gb * GB, seq, gpus_per_node, limit=512) == expected


def test_a_gpu_smaller_than_the_cuda_runtime_is_answered_at_once(monkeypatch):
    """A 1 GB GPU fits no layout of any size (the CUDA runtime alone is 1 GiB): the search for a GPU count must
    not plan every whole-node count up to its limit (it took minutes)."""
    calls = []  # GPU counts planned, or searched for a layout that fits
    real_plan, real_fits = S.plan, S.layout_fits
    monkeypatch.setattr(S, "plan", lambda *a, **kw: calls.append(a[1]) or real_plan(*a, **kw))
    monkeypatch.setattr(S, "layout_fits", lambda *a, **kw: calls.append(a[1]) or real_fits(*a, **kw))
    result = S.plan("llama-tiny", 1, 1 * GB, 256)
    assert not result.fits and "does not fit on 1 x 1 GB" in result.explanation
    assert "it needs at least" not in result.explanation
    assert len(calls) <= 1  # the runtime bound rules out every count without planning it
    calls.clear()
    assert S.minimum_gpus("llama2-7b", 2 * GB, 4096, limit=16384) is None  # weights fit from ~100 GPUs, nothing else
    assert len(calls) <= 12  # doubling counts only


# ---- ranking ------------------------------------------------------------------------------------------------


def test_tensor_parallelism_stays_inside_a_node():
    result = _fits("llama2-70b", 32, 80, 4096, gpus_per_node=4)
    assert result.fits and max(p.layout.tp for p in result.fits) == 4


def test_ranking_is_by_expected_speed_and_prefers_no_recompute_when_memory_allows():
    result = _fits("llama2-7b", 8, 141, 4096)
    speeds = [p.speed.tokens_per_sec_per_gpu for p in result.fits]
    assert speeds == sorted(speeds, reverse=True)
    best = result.fits[0].layout
    assert best.recompute == "none" and best.tp == 1  # 7B fits in 141 GB without paying for tp or recompute


def test_speed_model_penalties():
    cfg = get_preset("llama2-7b")

    def speed(gpus=8, per_node=8, **kw):
        base = dict(
            tp=1,
            pp=2,
            vpp=1,
            dp=4,
            sequence_parallel=False,
            distributed_optimizer=True,
            recompute="none",
            micro_batch_size=1,
            global_batch_size=16,
        )
        return P.estimate_speed(cfg, P.Layout(**{**base, **kw}), 4096, gpus, per_node)

    assert (
        speed().tokens_per_sec_per_gpu
        > speed(recompute="selective").tokens_per_sec_per_gpu
        > speed(recompute="full").tokens_per_sec_per_gpu
    )
    assert speed(vpp=2).bubble == pytest.approx(speed().bubble / 2)  # (pp-1)/(m*vpp)
    assert speed(micro_batch_size=2, global_batch_size=32).tokens_per_sec_per_gpu > speed().tokens_per_sec_per_gpu
    # data parallelism across nodes exposes more of the gradient reduction than inside one
    assert speed(per_node=2).parts["dp_exposed"] > speed().parts["dp_exposed"]
    tp_layout = dict(tp=2, pp=1, dp=4, sequence_parallel=True)
    assert speed(**tp_layout).parts["tp_comm"] > 0 and speed().parts["tp_comm"] == 0


# ---- errors and the command ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model_name="llama-9000b"), "unknown model preset"),
        (dict(gpus=0), "must be >= 1"),
        (dict(gpus=12), "not a multiple of --gpus-per-node 8"),
        (dict(seq_length=10**7), "out of range"),
        (dict(gpu_memory=0), "must be positive"),
    ],
)
def test_impossible_inputs_raise(kwargs, message):
    args = dict(model_name="llama2-7b", gpus=8, gpu_memory=80 * GB, seq_length=4096)
    with pytest.raises(ConfigError, match=message):
        S.plan(**{**args, **kwargs})


def test_no_valid_layout_is_explained():
    # Falcon 7B has 71 heads (tp 1 only): on 64 GPUs dp >= 2, so a global batch of 1 sample cannot be split
    # (cp would take the place of dp, but 2046 tokens do not cut into 2*cp chunks).
    result = S.plan("falcon-7b", 64, 80 * GB, 2046, global_batch_size=1)
    assert not result.fits and "no layout of 64 GPUs is valid" in result.explanation


@pytest.mark.parametrize("text, expected", [("80GB", 80e9), ("80 GiB", 80 * 2**30), ("141", 141e9), ("1.5TB", 1.5e12)])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


def test_parse_memory_rejects_nonsense():
    with pytest.raises(ConfigError, match="give a size"):
        parse_memory("eighty")


def test_command_json_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "plan",
                "--model",
                "llama2-7b",
                "--gpus",
                "2",
                "--gpu-memory",
                "80GB",
                "--seq-length",
                "4096",
                "--top",
                "3",
                "--json",
            ]
        )
    assert exit_info.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] >= len(out["layouts"]) == 3
    first = out["layouts"][0]
    parts = first["memory_gb"]
    assert parts["total"] == pytest.approx(
        sum(parts[k] for k in ("weights", "gradients", "optimizer", "activations", "buffers"))
    )
    assert first["tp"] * first["pp"] * first["dp"] == 2

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama2-70b", "--gpus", "8", "--gpu-memory", "80GB", "--seq-length", "4096"])
    assert exit_info.value.code == 1
    assert "weights+grads+optimizer alone need" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama2-7b", "--gpus", "2", "--gpu-memory", "lots", "--seq-length", "4096"])
    assert exit_info.value.code == 2
    assert "configuration error" in capsys.readouterr().err


def test_recompute_that_saves_no_memory_is_not_listed():
    """A selective layout whose no-recompute twin fits in (almost) the same memory is only slower: dropped."""
    result = _fits("llama2-70b", 32, 80, 4096)

    def twin_key(p: P.Plan) -> tuple:  # the layout but its recompute
        lay = p.layout
        return (lay.tp, lay.pp, lay.vpp, lay.dp, lay.sharding, lay.fsdp_keep_params, lay.micro_batch_size)

    plain = {twin_key(p): p.memory.total for p in result.fits if p.layout.recompute == "none"}
    recomputing = [p for p in result.fits if p.layout.recompute != "none"]
    assert recomputing  # full recompute still opens layouts that do not fit otherwise
    for p in recomputing:
        twin = plain.get(twin_key(p))
        assert twin is None or twin > 1.01 * p.memory.total


@contextlib.contextmanager
def time_limit(seconds: int):
    """TimeoutError in the block once `seconds` have passed (SIGALRM: the main thread, as pytest runs tests)."""

    def out_of_time(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_divisors_are_those_of_the_definition_and_found_fast():
    from llamatron.parallel.layout import divisors

    for n in [*range(1, 200), 720720, 2**20, 999_983]:  # 999_983 is prime
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    with time_limit(10):  # up to sqrt(n): 10^6 candidates, where trying 1..n never ended
        assert len(divisors(10**12)) == 13**2


def test_a_huge_gpu_count_is_answered_at_once_or_refused(capsys):
    """`plan --gpus N` took time growing with N (divisors tried 1..N, once per searched layout: 10^6 GPUs took
    minutes, 10^9 never answered). The largest count allowed plans a mixture of experts (whose expert-parallel sizes
    were the slow part) at once; a larger one is one argparse error, at once too."""
    from llamatron.commands.plan import GPUS

    argv = ["plan", "--model", "mixtral-test", "--no-simulate", "--top", "1", "--json", "--gpus"]
    with time_limit(30):  # ~0.4 s; 17 s with divisors tried 1..N
        assert main_code([*argv, str(GPUS.high)]) == 0
        assert json.loads(capsys.readouterr().out)["layouts"]
        assert main_code([*argv, "1000000000"]) == 2
    assert "--gpus: 1000000000 must be in 1..1048576" in capsys.readouterr().err
