"""`llamatron plan`'s memory model: parameters and activations against hand counts and autograd, whole layouts by
hand, and the planner's memory and speed against the H200 runs of benchmarks/h200_peak_memory.json (the search,
its minimums, ranking and errors: test_plan_search.py)."""

import dataclasses

import pytest
import torch
from plan_layouts import planned
from planner_rows import ROWS, SPEED_ROWS, config_of

from llamatron.config.settings import config_from_values
from llamatron.kernels import triton_check
from llamatron.kernels.cross_entropy_op import cross_entropy_per_token
from llamatron.models import PRESET_NAMES, KernelChoices, apply_kernels, build_model, get_preset, materialize
from llamatron.models.families import family_of
from llamatron.models.inventory import num_params
from llamatron.models.layer_input import LayerInput
from llamatron.models.layers import rope_cos_sin
from llamatron.planning import activations as A
from llamatron.planning import plan as P
from llamatron.planning.params import layer_shards
from llamatron.training.engine import apply_recompute

EAGER = P.Precision(
    compiled=False, fused_norms=False, fused_rope=False, fused_swiglu=False, fused_loss=False
)  # what runs on CPU


# ---- parameters ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_parameter_counts_match_the_model(name):
    cfg = get_preset(name)
    model = build_model(cfg)  # on meta: free (a mixture of experts: every expert)
    assert sum(layer_shards(cfg, index=0)) == sum(p.numel() for p in model.layers["0"].parameters())
    assert P.stage_params(cfg, 1, 1, 0, cfg.num_layers)[0] == sum(p.numel() for p in model.parameters())


def test_tensor_parallel_parameters_by_hand():
    # Llama 2 70B on tp 8: 8 query heads and 1 KV head of 128 per rank, ffn 28672 / 8, norms replicated.
    cfg = get_preset("llama2-70b")
    qkv = 8192 * (8 + 2 * 1) * 128
    out = 8 * 128 * 8192
    mlp = 3 * 8192 * (28672 // 8)
    assert P.layer_params(cfg, 8) == qkv + out + mlp + 2 * 8192
    # Falcon 40B on tp 16: 8 KV heads, so each rank holds one replicated KV head.
    falcon = get_preset("falcon-40b")
    expected = 8192 * (8 + 2) * 64 + 8 * 64 * 8192 + 2 * 8192 * (32768 // 16) + 4 * 8192
    assert P.layer_params(falcon, 16) == expected
    # Tied embeddings: the last pipeline stage keeps its own copy of the (padded, sharded) vocabulary.
    vocab_rows = P.local_vocab(falcon, 8)
    assert vocab_rows * 8 >= falcon.vocab_size and vocab_rows % 128 == 0
    first, _ = P.stage_params(falcon, 8, 2, 0, 30)
    last, _ = P.stage_params(falcon, 8, 2, 1, 30)
    assert last - first == 2 * 8192  # the final LayerNorm; both hold vocab_rows x h
    assert first == 30 * P.layer_params(falcon, 8) + vocab_rows * 8192


# ---- activations against what autograd really saves ---------------------------------------------------------


def _saved_bytes(fn, exclude: set[int]) -> int:
    """Bytes of distinct storages autograd saves while running fn (parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _on_cpu_too(monkeypatch) -> None:
    """A layer whose choice is "triton" runs the Triton op's custom ops here too (through their CPU kernels: the
    ops, and so what autograd saves, are the ones CUDA runs)."""
    monkeypatch.setattr(triton_check, "kernels_on", lambda backend, x: backend == "triton")


@pytest.fixture(params=[False, True], ids=["torch-norm", "fused-norm"])
def fused_norms(request, monkeypatch):
    """Run the model's RMSNorms as the torch expression, or as the Triton op's custom ops (`_choices`)."""
    _on_cpu_too(monkeypatch)
    return request.param


@pytest.fixture(params=[False, True], ids=["torch-rope-swiglu", "fused-rope-swiglu"])
def fused_rope_swiglu(request, monkeypatch):
    """The QKV split + rotary and SwiGLU as the torch expressions, or as the Triton ops' custom ops."""
    _on_cpu_too(monkeypatch)
    return request.param


def _choices(norms: bool, rope_swiglu: bool) -> KernelChoices:
    """The model kernels the two fixtures stand for."""

    def pick(fused: bool) -> str:
        return "triton" if fused else "torch"

    return KernelChoices(rmsnorm=pick(norms), rope=pick(rope_swiglu), swiglu=pick(rope_swiglu))


def _eager_kernels(cfg, norms: bool, rope_swiglu: bool) -> A.LayerKernels:
    """The planner's view of the eager layer the fixtures set up (Falcon: no RMSNorm or SwiGLU to fuse)."""
    return dataclasses.replace(
        EAGER, fused_norms=norms, fused_rope=rope_swiglu, fused_swiglu=rope_swiglu
    ).layer_kernels(cfg)


def layer_saved_per_token(cfg, dtype: torch.dtype, choices: KernelChoices) -> float:
    """Bytes autograd saves per token in the first decoder layer of `cfg` (its rotary tables included)."""
    torch.manual_seed(0)
    block = family_of(cfg).block(cfg, 0).to(dtype)
    apply_kernels(block, choices)
    batch, seq = 2, 64
    x = torch.randn(batch, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(cfg, torch.arange(seq).expand(batch, seq), dtype)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    return _saved_bytes(lambda: block(x, LayerInput(cos, sin)), params) / (batch * seq)


@pytest.mark.parametrize(
    "name", ["llama-test", "llama3-test", "falcon-test", "falcon40b-test", "qwen2-test", "qwen3-test"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_activations_match_autograd(name, dtype, fused_norms, fused_rope_swiglu):
    cfg = get_preset(name)
    measured = layer_saved_per_token(cfg, dtype, _choices(fused_norms, fused_rope_swiglu))
    a = 2 if dtype == torch.bfloat16 else 4
    terms = A.layer_activation_terms(cfg, a, kernels=_eager_kernels(cfg, fused_norms, fused_rope_swiglu))
    predicted = sum(terms.values()) + 2 * a * cfg.head_dim  # + cos/sin
    # CPU LayerNorm keeps mean/rstd in bf16 (4 bytes), CUDA in fp32 (8, the model's figure): within 1%.
    assert measured == pytest.approx(predicted, rel=0.01)


@pytest.mark.parametrize("name", ["llama-test", "falcon40b-test", "qwen3-test"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_model_activations_match_autograd(name, recompute, fused_norms, fused_rope_swiglu):
    cfg = get_preset(name)
    measured = model_saved_per_token(cfg, recompute, _choices(fused_norms, fused_rope_swiglu))
    chunk = A.chunk_activation_bytes(
        cfg,
        cfg.num_layers,
        True,
        True,
        2,
        1,
        False,
        recompute,
        pipelined=False,
        kernels=_eager_kernels(cfg, fused_norms, fused_rope_swiglu),
    )
    saved_log_softmax = 4 * cfg.vocab_size  # the part of the loss temporaries autograd keeps
    assert measured == pytest.approx(chunk + saved_log_softmax, rel=0.01)


def model_saved_per_token(cfg, recompute: str, choices: KernelChoices) -> float:
    """Bytes autograd saves per token in a bf16 model of `cfg` and its loss, under a recompute mode."""
    model = build_model(cfg)
    materialize(model, cfg, 0, torch.device("cpu"), torch.bfloat16)
    apply_kernels(model, choices)
    if recompute != "none":
        apply_recompute(model, recompute, None)
    batch, seq = 2, 64
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return _saved_bytes(lambda: cross_entropy_per_token(model(ids), ids), params) / (batch * seq)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama-1b", "falcon40b-test"])
def test_compiled_layer_activations_match_autograd_on_gpu(name):
    cfg = get_preset(name)
    block = family_of(cfg).block(cfg, 0).cuda().bfloat16()
    block.forward = torch.compile(block.forward, dynamic=False)
    batch, seq = 1, 1024
    x = torch.randn(batch, seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(cfg, torch.arange(seq, device="cuda").expand(batch, seq), torch.bfloat16)
    block(x, LayerInput(cos, sin))  # compile outside the measurement
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    measured = _saved_bytes(lambda: block(x, LayerInput(cos, sin)), params) / (batch * seq)
    from llamatron.kernels import rope_op

    rope = triton_check.kernels_on("auto", x) and rope_op.supports_head_dim(cfg.head_dim)
    kernels = A.LayerKernels(compiled=True, rope=rope)  # the CUDA default
    predicted = sum(A.layer_activation_terms(cfg, 2, kernels=kernels).values()) + 4 * cfg.head_dim
    assert measured == pytest.approx(predicted, rel=0.05)


def test_tensor_and_sequence_parallel_activation_terms():
    cfg = get_preset("llama2-70b")
    base, tp = A.layer_activation_terms(cfg, 2), A.layer_activation_terms(cfg, 2, tp=8)
    sp = A.layer_activation_terms(cfg, 2, tp=8, sequence_parallel=True)
    for part in ("qkv", "rope", "softmax_stats", "attn_output", "mlp"):
        assert tp[part] * 8 == base[part]  # 8 KV heads over tp 8: one each, so the division is exact
    assert tp["norm_inputs"] == base["norm_inputs"] and sp["norm_inputs"] * 8 == base["norm_inputs"]
    assert sp["norm_outputs"] == base["norm_outputs"]  # projections save their all-gathered input
    full = A.layer_activation_bytes(cfg, 2, 8, True, "full")
    assert full == 2 * 8192 / 8


def test_pipeline_in_flight_counts():
    assert [A.chunks_in_flight(4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]  # 1F1B: pp - rank
    assert [A.chunks_in_flight(4, 1, 2, r) for r in range(4)] == [2, 2, 2, 1]  # fewer micro-batches than stages
    assert A.chunks_in_flight(4, 2, 8, 0) == 8  # interleaved: pp*vpp chunks of 1/vpp stage each
    assert A.chunks_in_flight(1, 1, 64, 0) == 1  # no pipeline: one micro-batch at a time


# ---- whole-layout memory by hand ----------------------------------------------------------------------------


def test_layout_memory_by_hand():
    """llama-test (h 64, 2 layers, 4 heads / 2 KV heads of 16, ffn 160, vocab 256), dp 4 + distributed optimizer."""
    cfg = get_preset("llama-test")
    h, layers, kv, f, vocab, heads, d = 64, 2, 32, 160, 256, 4, 16
    lay = P.Layout(
        tp=1,
        pp=1,
        vpp=1,
        dp=4,
        sequence_parallel=False,
        distributed_optimizer=True,
        recompute="none",
        micro_batch_size=2,
        global_batch_size=16,
    )
    seq, tokens = 32, 2 * 32
    mem = P.layout_memory(cfg, lay, seq, EAGER)

    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    params = layers * per_layer + h + 2 * vocab * h  # + final norm, embedding and head
    assert mem.weights == 2 * params and mem.gradients == 4 * params
    assert mem.optimizer == pytest.approx(12 * params / 4)

    a = 2
    layer = (
        2 * (4 * h + a * h + 4)  # per RMSNorm: fp32 input, normalised, rsqrt
        + 2 * a * h  # the QKV and gate_up projections' inputs
        + a * (h + 2 * kv)
        + a * (h + kv)
        + 4 * heads  # QKV output, roped q/k, logsumexp
        + a * h
        + 4 * a * f
    )  # attention output, SwiGLU
    per_token = layers * layer + 2 * a * d + 8 + (4 * h + a * h + 4) + a * h  # cos/sin, token ids, final norm
    assert mem.activations == pytest.approx(per_token * tokens)

    def fused(**kernel):  # eager with one Triton op
        return P.layout_memory(cfg, lay, seq, dataclasses.replace(EAGER, **kernel)).activations

    assert mem.activations - fused(fused_norms=True) == pytest.approx((2 * layers + 1) * 4 * h * tokens)  # fp32 copies
    assert mem.activations - fused(fused_rope=True) == pytest.approx(layers * a * (h + kv) * tokens)  # QKV output
    assert mem.activations - fused(fused_swiglu=True) == pytest.approx(layers * a * f * tokens)  # silu(gate)

    loss = 12 * vocab * tokens
    largest = max(2 * f * h, vocab * h)
    assert mem.buffers["temporaries"] == pytest.approx(max(loss, layer * tokens))
    assert mem.buffers["param_grad"] == a * largest
    assert mem.buffers["batch"] == 16 * seq * 16 / 4
    assert mem.buffers["staging"] == 0  # the all-gather source (2N/4) is smaller than the backward peak
    dynamic = mem.activations + mem.buffers["temporaries"] + a * largest
    assert mem.buffers["fragmentation"] == pytest.approx(0.15 * dynamic)
    assert mem.buffers["runtime"] == 2**30 + 2**29  # one parallel dimension (dp)
    assert mem.total == pytest.approx(mem.static + mem.activations + sum(mem.buffers.values()))


def test_pipeline_stage_memory_by_hand():
    """llama-test4 on tp 2 (sp) x pp 2, compiled: rank 0 holds 2 layers + the embedding and 2 micro-batches."""
    cfg = get_preset("llama-test4")
    h, kv_local, q_local, d, f_local, a = 64, 16, 32, 16, 80, 2
    layer = (
        (2 * 4 + a * h) / 2  # rsqrt x2 and one residual, sequence-sharded
        + 2 * a * h  # the projections' all-gathered inputs
        + a * (q_local + 2 * kv_local)
        + a * (q_local + kv_local)
        + 4 * 2  # QKV, roped q/k, logsumexp
        + 2 * a * q_local
        + 3 * a * f_local
    )  # attention kernel output + projection input, SwiGLU
    first_chunk = 2 * layer + 2 * a * d + 8  # cos/sin, token ids (the sent output is not kept)
    got = A.chunk_activation_bytes(
        cfg, 2, True, False, a, 2, True, "none", pipelined=True, kernels=A.LayerKernels(compiled=True)
    )
    assert got == pytest.approx(first_chunk)
    lay = planned(2, 2, 1, 1, True, False, "none", 1, 4)
    mem = P.layout_memory(cfg, lay, 32, P.Precision(fused_rope=False))  # the torch rotary, as first_chunk
    assert mem.stage == 0  # two micro-batches in flight outweigh the last stage's (tiny) loss temporaries
    assert mem.activations == pytest.approx(2 * first_chunk * 32)
    embed_rows = 128  # vocab 256 padded to a multiple of 128 * tp, split over 2 ranks
    assert mem.weights == 2 * (2 * P.layer_params(cfg, 2) + embed_rows * h)


def test_predict_peak_memory_reads_the_run_config():
    values = {
        "model": "llama-1b",
        "micro_batch_size": 2,
        "global_batch_size": 16,
        "seq_length": 4096,
        "device": "cuda",
        "precision": "bf16",
    }
    cfg = config_from_values(values)
    out = P.predict_peak_memory(cfg, world_size=1)
    model = get_preset("llama-1b")
    assert out["weights"] == 2 * num_params(model) and out["optimizer"] == 12 * num_params(model)
    parts = out["buffer_parts"]
    assert out["total"] == pytest.approx(out["allocated"] + parts["fragmentation"] + parts["runtime"])
    assert out["allocated_gib"] == pytest.approx(out["allocated"] / 2**30)
    eager = P.predict_peak_memory(config_from_values({**values, "compile": False}), 1)
    assert eager["allocated"] == pytest.approx(out["allocated"])  # the Triton loss keeps no fp32 logits either
    eager_loss = P.predict_peak_memory(
        config_from_values({**values, "compile": False, "cross_entropy_backend": "torch"}), 1
    )
    assert eager_loss["allocated"] > out["allocated"]  # torch's eager loss keeps fp32 logits
    # With the Triton ops (the CUDA default) an eager layer saves what a compiled one does; without them more
    eager_torch = P.predict_peak_memory(config_from_values({**values, "compile": False, "rmsnorm_backend": "torch"}), 1)
    assert eager_torch["activations"] > eager["activations"] == out["activations"]
    sharded = P.predict_peak_memory(config_from_values({**values, "distributed_optimizer": True}), 4)
    assert sharded["optimizer"] == pytest.approx(out["optimizer"] / 4)
    cpu = P.predict_peak_memory(config_from_values({**values, "device": "cpu", "precision": "auto"}), 1)
    assert cpu["weights"] == 4 * num_params(model)  # auto precision on CPU is fp32


def test_loss_temporaries_compiled_and_eager():
    """Compiled loss: the logits and their gradient in the activation dtype; eager: 12 bytes per logit at tp 1."""
    cfg = get_preset("llama-1b")
    assert P.loss_bytes_per_token(cfg, 1, compiled=True, act_bytes=2) == 4 * 32000
    assert P.loss_bytes_per_token(cfg, 1, compiled=False) == 12 * 32000
    assert P.loss_bytes_per_token(cfg, 1, compiled=False, fused=True) == 4 * 32000  # the Triton loss
    assert P.loss_bytes_per_token(cfg, 2, compiled=True) == 10 * 16000  # the vocabulary-parallel loss is not compiled


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['gpus']}gpu {r['flags'][8:]}" for r in ROWS])
def test_planner_matches_peak_memory_measured_on_h200(row):
    """The planner's `allocated` against torch.cuda.max_memory_allocated of real H200 runs: within 5%."""
    cfg = config_of(row["flags"])
    predicted = P.predict_peak_memory(cfg, row["gpus"])["allocated_gib"]
    assert predicted == pytest.approx(row["measured_gib"], rel=0.05), (predicted, row["measured_gib"])


@pytest.mark.parametrize("row", SPEED_ROWS, ids=[f"{r['gpus']}gpu {r['flags'][8:]}" for r in SPEED_ROWS])
def test_planner_speed_matches_h200_throughput(row):
    """The planner ranks layouts by its speed estimate: within 10% of compiled H200 runs of each kind."""
    from llamatron.training.validate import validate

    cfg = config_of(row["flags"])
    layout = P.run_layout(cfg, validate(cfg, row["gpus"], cuda_available=True).dp)
    speed = P.estimate_speed(cfg.model_config(), layout, cfg.data.seq_length, row["gpus"], 8)
    assert speed.tokens_per_sec_per_gpu == pytest.approx(row["tokens_per_sec_per_gpu"], rel=0.10)
