"""`llamatron plan` with context parallelism (--cp): activations per rank, the gathered K/V against autograd, the
cp traffic, the search proposing cp only where it is needed or faster, and cp in the table and the JSON."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from llamatron.cli import main
from llamatron.commands.plan import format_table
from llamatron.config.settings import config_from_values
from llamatron.kernels import triton_check
from llamatron.models import KernelChoices, apply_kernels, get_preset
from llamatron.models.families import family_of
from llamatron.models.layer_input import LayerInput
from llamatron.models.layers import rope_cos_sin
from llamatron.parallel import context
from llamatron.planning import activations as A
from llamatron.planning import plan as P
from llamatron.planning import search as S
from llamatron.training.engine import apply_recompute

GB = 1e9
LONG = 131072  # Llama 3.1's context
EAGER = P.Precision(compiled=False, fused_norms=False, fused_rope=False, fused_swiglu=False, fused_loss=False)


def _layout(**kw) -> P.Layout:
    base = dict(
        tp=1,
        pp=1,
        vpp=1,
        dp=1,
        sequence_parallel=False,
        distributed_optimizer=True,
        recompute="none",
        micro_batch_size=1,
        global_batch_size=32,
    )
    return P.Layout(**{**base, **kw})


# ---- activations --------------------------------------------------------------------------------------------


class _Replicate(torch.autograd.Function):
    """A stand-in for the cp all-gather in one process: cp copies of this rank's sequence part. Like the real
    gather (tensor_layers._GatherSequence) it saves nothing for backward."""

    @staticmethod
    def forward(ctx, x, cp):
        return torch.cat([x] * cp, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return None, None


@pytest.mark.parametrize("name", ["llama-test", "llama3-test", "falcon-test", "qwen3-test"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("fused", [False, True], ids=["torch-rope-swiglu", "fused-rope-swiglu"])
def test_context_parallel_layer_activations_match_autograd(name, cp, recompute, fused, monkeypatch):
    """What a decoder layer saves when its attention attends to K/V gathered over cp ranks: without recompute
    the gathered K/V in place of the local ones; with selective recompute the local q/k/v, as without cp."""
    monkeypatch.setattr(triton_check, "kernels_on", lambda backend, x: backend == "triton")
    monkeypatch.setattr(context, "gather_sequence", lambda x, group: _Replicate.apply(x, cp))
    cfg = get_preset(name)
    torch.manual_seed(0)
    block = family_of(cfg).block(cfg, 0).to(torch.bfloat16)
    pick = "triton" if fused else "torch"
    apply_kernels(block, KernelChoices(rope=pick, swiglu=pick))
    block.attn.core = context.ContextParallelCore(block.attn.core, None, cp)  # as apply_context_parallel does
    if recompute != "none":
        apply_recompute(SimpleNamespace(layers={"0": block}), recompute, None)  # after cp, as build_engine does
    batch, seq = 2, 64  # this rank's tokens
    x = torch.randn(batch, seq, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(cfg, torch.arange(seq).expand(batch, seq), torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, LayerInput(cos, sin))
    measured = sum(seen.values()) / (batch * seq)
    kernels = dataclasses.replace(EAGER, fused_rope=fused, fused_swiglu=fused).layer_kernels(cfg)
    predicted = A.layer_activation_bytes(cfg, 2, 1, False, recompute, kernels, cp) + 4 * cfg.head_dim  # + cos/sin
    assert measured == pytest.approx(predicted, rel=0.01)
    without_cp = A.layer_activation_bytes(cfg, 2, 1, False, recompute, kernels)
    if recompute == "none":  # the gathered K/V are what cp changes: ignoring them misses the measurement
        assert predicted - 4 * cfg.head_dim != pytest.approx(without_cp, rel=0.01)


def test_activation_memory_falls_with_cp():
    """Each cp rank holds seq/cp tokens: activations per GPU fall as 1/cp, plus (without recompute) the whole
    sequence's K/V that every layer keeps, 2 x seq x 8 KV heads x 128 x 2 bytes each for Llama 3.1 8B."""
    cfg = get_preset("llama3.1-8b")

    def activations(cp: int, recompute: str) -> float:
        return P.layout_memory(cfg, _layout(cp=cp, recompute=recompute), LONG).activations

    for cp in (2, 4, 8):
        assert activations(cp, "full") == pytest.approx(activations(1, "full") / cp)  # layer inputs only
        per_layer_kv = 2 * LONG * 8 * 128 * 2
        gathered = cfg.num_layers * per_layer_kv
        local_kv = gathered / cp  # which cp frees: the kernel holds the gathered copy instead
        assert activations(cp, "none") == pytest.approx(activations(1, "none") / cp + gathered - local_kv)
        assert activations(1, "none") / cp < activations(cp, "none") < 1.25 * activations(1, "none") / cp
    terms = A.layer_activation_terms(cfg, 2, cp=4)
    assert terms["gathered_kv"] == 2 * 4 * 2 * 8 * 128  # per local token: cp times a rank's own K and V


def test_replicas_shard_the_optimizer_and_reduce_the_gradients():
    """dp x cp ranks hold the same weights: the distributed optimizer shards over all of them, and the gradient
    reduction runs even at dp = 1."""
    cfg = get_preset("llama3.1-8b")
    one, cp8 = (P.layout_memory(cfg, _layout(cp=cp, recompute="full"), LONG) for cp in (1, 8))
    assert cp8.weights == one.weights and cp8.optimizer == pytest.approx(one.optimizer / 8)
    assert cp8.buffers["runtime"] == one.buffers["runtime"] + 2 * 2**29  # the cp and replica communicators
    speed = P.estimate_speed(cfg, _layout(cp=8, recompute="full"), LONG, 8, 8)
    assert speed.parts["dp_exposed"] > 0 == P.estimate_speed(cfg, _layout(), LONG, 1, 8).parts["dp_exposed"]


def test_predict_peak_memory_reads_cp():
    values = {"model": "llama-1b", "seq_length": 8192, "micro_batch_size": 1, "global_batch_size": 4, "device": "cuda"}
    plain = P.predict_peak_memory(config_from_values({**values, "distributed_optimizer": True}), 2)
    split = P.predict_peak_memory(config_from_values({**values, "cp": 2, "distributed_optimizer": True}), 2)
    assert split["optimizer"] == pytest.approx(plain["optimizer"])  # two replicas either way (dp 2 or cp 2)
    assert split["activations"] < 0.6 * plain["activations"]  # each rank holds half of every sequence


# ---- speed --------------------------------------------------------------------------------------------------


def test_cp_traffic_grows_with_the_sequence_and_leaves_the_node_when_tp_cp_does():
    cfg = get_preset("llama3.1-8b")
    lay = _layout(cp=4)
    short, long = (P.context_comm_seconds(cfg, lay, seq, 8) for seq in (32768, LONG))
    assert long == pytest.approx(4 * short) and short > 0  # the gathered K/V are the whole sequence's
    by_hand = 32 * 2 * 3 / 4 * (2 * LONG * 8 * 128 * 2) / P.SpeedAssumptions().nvlink_bw  # gather + its RS
    assert long == pytest.approx(by_hand)
    assert P.context_comm_seconds(cfg, dataclasses.replace(lay, recompute="full"), LONG, 8) == pytest.approx(
        1.5 * long
    )  # recompute gathers again
    assert P.context_comm_seconds(cfg, lay, LONG, 2) > 4 * long  # tp*cp = 4 > 2 GPUs per node: across nodes
    assert P.context_comm_seconds(cfg, _layout(), LONG, 8) == 0
    speed = P.estimate_speed(cfg, lay, LONG, 4, 8)
    assert speed.parts["cp_comm"] == pytest.approx(long * lay.micro_batches)  # exposed, every micro-batch
    # 1/cp of the attention work and of the GEMM tokens per rank: compute per GPU is that of cp = 1, at the
    # shape factor of a quarter of the tokens
    alone = P.estimate_speed(cfg, _layout(global_batch_size=8), LONG, 1, 8)
    half = P.SpeedAssumptions().gemm_tokens_half
    shape = (LONG / (LONG + half)) / (LONG / 4 / (LONG / 4 + half))
    assert speed.parts["compute"] == pytest.approx(alone.parts["compute"] * shape, rel=1e-3)


# ---- the search ---------------------------------------------------------------------------------------------


def test_long_sequence_on_8_gpus_picks_cp():
    """Llama 3.1 8B at 131072 tokens on 8 x 80 GB: without cp only tp 8 with (partial) full recompute fits;
    the plan's best splits the sequence instead, fits, and is expected faster than every layout without cp."""
    result = S.plan("llama3.1-8b", 8, 80 * GB, LONG)
    best = result.fits[0]
    assert best.layout.cp > 1 and best.memory.total <= 80 * GB
    lay = best.layout
    assert lay.tp * lay.cp * lay.pp * lay.dp == 8 and LONG % (2 * lay.cp) == 0
    plain = [p for p in result.fits if p.layout.cp == 1]
    assert {(p.layout.tp, p.layout.recompute) for p in plain} == {(8, "full")}
    fastest_plain = max(p.speed.tokens_per_sec_per_gpu for p in plain)
    assert best.speed.tokens_per_sec_per_gpu > S.CONTEXT_SPEEDUP * fastest_plain
    assert all(
        p.speed.tokens_per_sec_per_gpu > S.CONTEXT_SPEEDUP * fastest_plain for p in result.fits if p.layout.cp > 1
    )


def test_cp_is_proposed_when_nothing_fits_without_it(monkeypatch):
    """On 16 x 40 GB no layout without cp fits a 131072-token sequence of Llama 3.1 8B; with cp some do."""
    result = S.plan("llama3.1-8b", 16, 40 * GB, LONG)
    assert result.fits and all(p.layout.cp > 1 and p.memory.total <= 40 * GB for p in result.fits)
    assert S.layout_fits("llama3.1-8b", 16, 40 * GB, LONG)  # minimum_gpus' question: the cp layouts count
    monkeypatch.setattr(S, "context_sizes", lambda gpus, seq: [1])  # the search without cp
    alone = S.plan("llama3.1-8b", 16, 40 * GB, LONG, explain=False)
    assert not alone.fits and not S.layout_fits("llama3.1-8b", 16, 40 * GB, LONG)


def test_short_sequences_keep_cp_1():
    """At 4096 tokens cp only adds traffic and shrinks the GEMMs: the plan lists no cp layout, and the best
    layout's cp twin (cp 2 in place of dp 2) is slower."""
    result = S.plan("llama2-7b", 8, 80 * GB, 4096)
    assert result.fits and all(p.layout.cp == 1 for p in result.fits)
    best = result.fits[0].layout
    assert best.dp > 1
    twin = dataclasses.replace(best, cp=2, dp=best.dp // 2)
    twin_speed = P.estimate_speed(get_preset("llama2-7b"), twin, 4096, 8, 8)
    assert twin_speed.parts["cp_comm"] > 0
    assert twin_speed.tokens_per_sec_per_gpu < result.fits[0].speed.tokens_per_sec_per_gpu
    assert next(S.candidate_layouts("llama2-7b", 8, 4096, 8, context=[2, 4, 8]), None) is not None  # considered


def test_context_sizes():
    assert S.context_sizes(8, LONG) == [1, 2, 4, 8]
    assert S.context_sizes(12, 4096) == [1, 2, 4]  # powers of two dividing the GPU count
    assert S.context_sizes(16, 4100) == [1, 2]  # 4100 cuts into 4 chunks, not 8


def test_cp_in_the_table_and_the_json(capsys):
    result = S.plan("llama3.1-8b", 8, 80 * GB, LONG)
    table = format_table(result, result.fits[:3]).splitlines()
    header = table[1].split()
    assert header[1:3] == ["tp", "cp"]
    assert [row.split()[2] for row in table[2:5]] == [str(p.layout.cp) for p in result.fits[:3]]
    flags = ["--model", "llama3.1-8b", "--gpus", "8", "--gpu-memory", "80GB", "--seq-length", str(LONG)]
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *flags, "--top", "2", "--json"])
    assert exit_info.value.code == 0
    first = json.loads(capsys.readouterr().out)["layouts"][0]
    assert first["cp"] > 1 and first["tp"] * first["cp"] * first["pp"] * first["dp"] == 8
