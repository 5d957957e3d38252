"""GPU checks (pytest -m gpu on a CUDA machine): fast paths against plain PyTorch, NCCL layouts against 1 GPU."""

import pytest
import torch
from layout import run_train

from llamatron.kernels.cross_entropy_op import cross_entropy_per_token

pytestmark = pytest.mark.gpu

GPU_ARGS = ["--device", "cuda", "--precision", "bf16", "--seq-length", "128", "--train-steps", "6"]


def _model(name="llama-test", seed=0, kernels=None, **changes):
    """A bf16 CUDA model; `kernels`: its KernelChoices (default: auto everywhere)."""
    import dataclasses

    from llamatron.models import KernelChoices, apply_kernels, build_model, get_preset, materialize

    cfg = dataclasses.replace(get_preset(name), **changes)
    model = materialize(build_model(cfg), cfg, seed, "cuda", torch.bfloat16)
    apply_kernels(model, kernels or KernelChoices())
    return cfg, model


def _assert_same_loss_and_grads(cfg, reference, other) -> None:
    """One forward/backward of both models on the same tokens: loss within 1e-2, each gradient within 5%
    (relative norm). Parameter names are the same under recompute (it keeps the layer's place)."""
    x = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda")
    outs = []
    for model in (reference, other):
        loss = cross_entropy_per_token(model(x), x).float().mean()
        loss.backward()
        outs.append((loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-2, atol=1e-2)
    for n, g in outs[0][1].items():
        rel = (g - outs[1][1][n]).norm() / g.norm().clamp_min(1e-6)
        assert rel < 5e-2, (n, float(rel))


# mistral: a window mask; qwen2: q/k/v biases; qwen3: q/k norms (no fused rotary) and head_dim 32 of hidden 64
@pytest.mark.parametrize("name", ["llama-test", "falcon40b-test", "mistral-test", "qwen2-test", "qwen3-test"])
def test_compiled_layers_match_eager(name):
    from llamatron.training.engine import apply_compile

    cfg, eager = _model(name)
    _, compiled = _model(name)
    apply_compile(compiled)
    _assert_same_loss_and_grads(cfg, eager, compiled)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputed_compiled_layers_match_plain_layers(recompute):
    """Recompute (checkpointed compiled layers around the Triton SwiGLU op) gives the plain run's loss and
    gradients: the custom op's saved input is recomputed, not stale."""
    from llamatron.training.engine import apply_compile, apply_recompute

    cfg, plain = _model()
    _, recomputed = _model()
    apply_recompute(recomputed, recompute, None)
    apply_compile(recomputed)
    _assert_same_loss_and_grads(cfg, plain, recomputed)


def _fa4_usable() -> bool:
    from llamatron.kernels.flash4_op import available

    return available() and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


needs_fa4 = pytest.mark.skipif(not _fa4_usable(), reason="needs flash-attn-4 and a Hopper or newer GPU")


@needs_fa4
def test_compiled_layers_with_fa4_match_eager_sdpa():
    """--attention-backend fa4 inside compiled layers (one graph around the custom op) gives the eager SDPA
    model's loss and gradients. Head dim 64 (256 / 4 heads): FA4 has no kernels for llama-test's 16."""
    from llamatron.models import KernelChoices
    from llamatron.training.engine import apply_compile

    cfg, eager = _model(hidden_size=256)
    _, compiled = _model(hidden_size=256, kernels=KernelChoices(attention="fa4"))
    apply_compile(compiled)
    _assert_same_loss_and_grads(cfg, eager, compiled)


def test_sdpa_attention_matches_math_reference():
    from llamatron.models.attention import attention_core

    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    out = attention_core(q, k, v).float()
    kr, vr = k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1)
    scores = (q.float() @ kr.transpose(-1, -2)) / 8.0
    scores = scores.masked_fill(torch.ones(256, 256, device="cuda").triu(1).bool(), float("-inf"))
    ref = torch.softmax(scores, -1) @ vr
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", ["auto", "cudnn", "flash", "efficient", pytest.param("fa4", marks=needs_fa4)])
def test_each_attention_backend_matches_math(backend):
    """--attention-backend: each kernel (GQA, causal; SDPA's and FlashAttention 4) agrees with SDPA's math
    kernel, forward and gradients."""
    from llamatron.models.attention import attention_core

    torch.manual_seed(0)
    q = torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for name in ("math", backend):
        out = attention_core(q, k, v, backend=name)
        results.append((out.float(), *(g.float() for g in torch.autograd.grad(out, (q, k, v), grad_out))))
    for ref, got in zip(*results):
        assert ((got - ref).norm() / ref.norm()) < 1e-2


def _attention_against_dense(mask_of, backend="auto", seq=1024, cp=1):
    """Forward and gradients of attention with the mask `mask_of(flex)` gives, the CUDA path (flex=None: what
    the model builds) against the dense reference mask (flex=False) run by SDPA's math kernel in fp32."""
    from llamatron.models.attention import attention_core

    torch.manual_seed(0)
    q = torch.randn(2, 8, seq // cp, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, seq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, seq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(2, 8, seq // cp, 64, device="cuda", dtype=torch.bfloat16)
    fast = mask_of(None)
    results = []
    for mask, name, dtype in ((mask_of(False), "math", torch.float32), (fast, backend, torch.bfloat16)):
        inputs = [t.to(dtype) for t in (q, k, v)]
        out = attention_core(*inputs, mask, name)
        results.append((out.float(), *(g.float() for g in torch.autograd.grad(out, inputs, grad_out.to(dtype)))))
    for ref, got in zip(*results):
        assert ((got - ref).norm() / ref.norm()) < 1e-2
    return fast


@pytest.mark.parametrize("kind", ["window", "documents", "documents+window", "cp-rank1-of-2"])
def test_masked_attention_on_cuda_skips_blocks_and_matches_the_dense_reference(kind):
    """Every mask kind takes flex attention's block-sparse kernel on CUDA (no dense mask), and agrees with the
    dense mask's result, forward and gradients."""
    from llamatron.models.attention import attention_mask

    dev = torch.device("cuda")
    docs = torch.tensor([[0] * 300 + [1] * 500 + [2] * 224, [0] * 1024], device=dev) if "documents" in kind else None
    window = 128 if "window" in kind else None
    context = (2, 1) if kind.startswith("cp") else (1, 0)
    seq = 1024 // context[0]
    fast = _attention_against_dense(
        lambda flex: attention_mask(seq, window, docs, dev, context, flex=flex), cp=context[0]
    )
    assert fast.block is not None and fast.dense is None
    assert fast.block.sparsity() > 0  # blocks skipped


@needs_fa4
def test_fa4_sliding_window_matches_the_dense_reference():
    from llamatron.models.attention import attention_mask

    fast = _attention_against_dense(
        lambda flex: attention_mask(1024, 128, None, torch.device("cuda"), flex=flex), "fa4"
    )
    assert fast.window == 128  # the plain window FA4 runs natively


@pytest.mark.parametrize(
    "shape, dtype",
    [((2, 256, 2 * 5632), torch.bfloat16), ((3, 7, 2 * 100), torch.float32), ((4096, 2 * 1024), torch.float16)],
)
def test_triton_swiglu_matches_torch(shape, dtype):
    """--swiglu-backend: the Triton kernels agree with the plain expression, forward and gradient, eager and
    inside a compiled function (no graph break), for a non-contiguous input too."""
    import torch.nn.functional as F

    from llamatron.kernels.swiglu_op import swiglu_op

    torch.manual_seed(0)
    wide = torch.randn(*shape[:-1], shape[-1] + 8, device="cuda", dtype=dtype)
    for x in (wide[..., : shape[-1]].contiguous(), wide[..., : shape[-1]]):
        x = x.detach().requires_grad_()
        gate, up = x.float().chunk(2, dim=-1)
        ref = F.silu(gate) * up
        dy = torch.randn(ref.shape, device="cuda", dtype=dtype)
        (g_ref,) = torch.autograd.grad(ref, x, dy.float())
        torch.compiler.reset()  # every custom op shares one code object: keep other tests' compilations out
        for fn in (swiglu_op, torch.compile(swiglu_op, fullgraph=True)):
            out = fn(x)
            (g_out,) = torch.autograd.grad(out, x, dy)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
            torch.testing.assert_close(g_out.float(), g_ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_rmsnorm_matches_torch(dtype):
    """--rmsnorm-backend: the Triton kernels (norm alone, and residual add + norm) agree with the plain
    expression, forward and gradients, eager and compiled with fullgraph=True (no graph break)."""
    from llamatron.kernels.rmsnorm_op import add_rms_norm_op, reference_rms_norm, rms_norm_op

    torch.manual_seed(0)
    rows, cols, tol = (4, 1000), 2048, 2e-2 if dtype == torch.bfloat16 else 1e-4
    x, delta = (torch.randn(*rows, cols, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    w = (1 + 0.1 * torch.randn(cols, device="cuda")).to(dtype).requires_grad_()
    dh, dy = (torch.randn_like(x) for _ in range(2))
    h_ref = x + delta
    y_ref = reference_rms_norm(h_ref, w, 1e-5)
    want = [t.float() for t in (h_ref, y_ref, *torch.autograd.grad((h_ref, y_ref), (x, delta, w), (dh, dy)))]
    y1_ref = reference_rms_norm(x, w, 1e-5)
    want1 = [t.float() for t in (y1_ref, *torch.autograd.grad(y1_ref, (x, w), dy))]
    torch.compiler.reset()
    for add_op, op in (
        (add_rms_norm_op, rms_norm_op),
        (torch.compile(add_rms_norm_op, fullgraph=True), torch.compile(rms_norm_op, fullgraph=True)),
    ):
        h, y, _ = add_op(x, delta, w, 1e-5)
        got = [h, y, *torch.autograd.grad((h, y), (x, delta, w), (dh, dy))]
        y1, _ = op(x, w, 1e-5)
        got1 = [y1, *torch.autograd.grad(y1, (x, w), dy)]
        for g, r in zip(got + got1, want + want1):
            scale = r.abs().max().clamp_min(1.0)  # the weight gradient sums 2000 rows
            torch.testing.assert_close(g.float() / scale, r / scale, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_qkv_rope_matches_torch(dtype):
    """The QKV split + rotary op (the CUDA default) against split + apply_rope: llama-1b's GQA shape, positions
    that differ per sample, forward and the QKV gradient, eager and compiled with fullgraph=True."""
    from llamatron.kernels.rope_op import qkv_rope_op
    from llamatron.models.config import ModelConfig
    from llamatron.models.layers import apply_rope, rope_cos_sin

    torch.manual_seed(0)
    batch, seq, heads, kv, dim = 2, 256, 32, 8, 64
    cfg = ModelConfig(
        family="llama",
        vocab_size=8,
        hidden_size=heads * dim,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=8,
        max_seq_length=4096,
    )
    positions = torch.stack([torch.arange(seq), torch.arange(seq).remainder(100)]).cuda()  # a document restart
    cos, sin = rope_cos_sin(cfg, positions, dtype)
    qkv = torch.randn(batch, seq, (heads + 2 * kv) * dim, device="cuda", dtype=dtype, requires_grad=True)
    grads = [torch.randn(batch, seq, n, dim, device="cuda", dtype=dtype) for n in (heads, kv, kv)]
    q, k, v = qkv.view(batch, seq, -1, dim).split([heads, kv, kv], dim=2)
    want = [apply_rope(t.transpose(1, 2), cos, sin).transpose(1, 2) for t in (q, k)] + [v]
    want = [*want, *torch.autograd.grad(want, qkv, grads)]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.compiler.reset()
    for op in (qkv_rope_op, torch.compile(qkv_rope_op, fullgraph=True)):
        got = op(qkv, cos, sin, heads, kv)
        got = [*got, *torch.autograd.grad(got, qkv, grads)]
        for g, w in zip(got, want):
            scale = w.float().abs().max()  # half types: a rounding step of the largest values
            torch.testing.assert_close(g.float() / scale, w.float() / scale, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "kernel, model",
    [
        ("rmsnorm", "llama-test"),
        ("rope", "llama-test"),
        ("rope", "mistral-test"),  # mistral: packed documents, a window
        ("cross_entropy", "llama-test"),
    ],
)
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_kernels_in_the_model_match_the_torch_path(kernel, model, compiled):
    """A model whose norms (with the residual add before them) or QKV split + rotary run as Triton kernels,
    against the plain expressions: same gradients, eager and with compiled layers. mistral-test runs two packed
    documents per row (positions restart, flex-attention document mask with its sliding window)."""
    from llamatron.models import KernelChoices
    from llamatron.training.engine import apply_compile

    cfg, reference = _model(model, kernels=KernelChoices(**{kernel: "torch"}))
    _, fused = _model(model)  # auto: the Triton kernels on CUDA
    if compiled:
        apply_compile(fused)
    x = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda")
    packed = {}
    if model == "mistral-test":
        docs = torch.tensor([[0] * 50 + [1] * 78, [0] * 100 + [1] * 28], device="cuda")
        starts = torch.tensor([[0] * 50 + [50] * 78, [0] * 100 + [100] * 28], device="cuda")
        packed = {"document_ids": docs, "position_ids": torch.arange(128, device="cuda") - starts}
    cross_entropy_per_token(reference(x, **packed), x).float().mean().backward()
    cross_entropy_per_token(fused(x, **packed), x).float().mean().backward()
    for (n, p), q in zip(reference.named_parameters(), fused.parameters()):
        rel = (p.grad.float() - q.grad.float()).norm() / p.grad.float().norm().clamp_min(1e-6)
        assert rel < 5e-2, (n, float(rel))  # as _assert_same_loss_and_grads: bf16 rounding, not bugs (~20%)


@pytest.mark.parametrize(
    "shape, dtype", [((2, 300, 32000), torch.bfloat16), ((5, 4099), torch.float32), ((3, 50), torch.float16)]
)
def test_triton_cross_entropy_matches_torch(shape, dtype):
    """The loss per token and the logits' gradient against torch's fp32 cross-entropy of the same logits, with
    ignored labels (loss 0, zero gradient rows), vocabularies that end mid-block, and a non-uniform incoming
    gradient; a label outside the vocabulary gives NaN, not a read out of bounds."""
    import torch.nn.functional as F

    from llamatron.kernels.cross_entropy_op import IGNORE_INDEX, cross_entropy_op

    torch.manual_seed(0)
    vocab = shape[-1]
    logits = (3 * torch.randn(shape, device="cuda")).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, shape[:-1], device="cuda")
    labels.view(-1)[::3] = IGNORE_INDEX
    weights = torch.rand(shape[:-1], device="cuda")
    loss = cross_entropy_op(logits, labels)[0]
    (grad,) = torch.autograd.grad((loss * weights).sum(), logits)
    ref_logits = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(
        ref_logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), ref_logits)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(grad.view(-1, vocab)[::3], torch.zeros_like(grad.view(-1, vocab)[::3]))
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # one rounding of each gradient element to the half type
    torch.testing.assert_close(grad.float(), ref_grad, rtol=tol, atol=tol * ref_grad.abs().max().item())
    labels.view(-1)[1] = vocab
    bad = cross_entropy_op(logits, labels)[0]
    assert bad.view(-1)[1].isnan() and bad.view(-1)[0] == 0 and bad.view(-1)[2:].isfinite().all()


def test_triton_adamw_matches_torch_fused_adamw():
    """--adamw-kernel triton: one segment's update equals torch's fused AdamW (gradient scale, weight decay,
    3 steps, then a skipped one) and the bf16 weights it writes equal the master rounded to bf16."""
    from torch.optim.adamw import adamw as functional_adamw

    from llamatron.kernels.adamw_kernel import adamw_segment

    torch.manual_seed(0)
    n = 3 * 2048 + 7
    ours = [torch.randn(n, device="cuda"), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
    ref = [t.clone() for t in ours]
    step, ref_step = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(2.5, device="cuda")
    for k in range(4):
        found_inf = torch.tensor(float(k == 3), device="cuda")
        grad = torch.randn(n, device="cuda")
        functional_adamw(
            [ref[0]],
            [grad.clone()],
            [ref[1]],
            [ref[2]],
            [],
            [ref_step],
            fused=True,
            amsgrad=False,
            beta1=0.9,
            beta2=0.95,
            lr=1e-2,
            weight_decay=0.1,
            eps=1e-8,
            maximize=False,
            grad_scale=scale,
            found_inf=found_inf,
        )
        step += 1 - found_inf
        adamw_segment(
            ours[0],
            grad,
            ours[1],
            ours[2],
            step,
            out,
            lr=1e-2,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            grad_scale=scale,
            found_inf=found_inf,
        )
    assert float(step) == float(ref_step) == 3
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)  # fp32 rounding of the bias corrections
    assert torch.equal(out, ours[0].bfloat16())


@pytest.mark.parametrize("overwrite", [True, False])
def test_gradient_accumulation_kernel_matches_torch(overwrite):
    """The bf16 -> fp32 main_grad kernel (write, then add) equals torch's copy_/add_ exactly."""
    from llamatron.parallel.grad_accumulate import accumulate_grad

    torch.manual_seed(0)
    for n in (1, 4097, 3 * 4096 + 5):
        grad = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dst = torch.randn(n, device="cuda")
        ref = dst.clone().copy_(grad) if overwrite else dst.clone().add_(grad)
        accumulate_grad(dst, grad, overwrite)
        assert torch.equal(dst, ref)


def _close(ref, got, rtol):
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= rtol * a["loss"], (a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", [["--distributed-optimizer"], ["--tp", "2"], ["--tp", "2", "--sequence-parallel"]])
def test_nccl_layouts_match_one_gpu(tmp_path, layout):
    ref = run_train(GPU_ARGS, 1, tmp_path)
    got = run_train(GPU_ARGS + layout, 2, tmp_path)
    _close(ref, got, rtol=2e-2)  # bf16: different reduction orders


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", [["--pp", "2"], ["--pp", "2", "--vpp", "2"]], ids=["pp2", "pp2-vpp2"])
def test_nccl_pipeline_layouts_match_one_gpu(tmp_path, layout):
    """1F1B and interleaved schedules over NCCL (sends/receives between GPUs, outputs freed once sent) against
    one GPU; llama-test4 has the 4 layers that 2 stages x 2 chunks need."""
    ref = run_train(GPU_ARGS, 1, tmp_path, model="llama-test4")
    got = run_train(GPU_ARGS + layout, 2, tmp_path, model="llama-test4")
    _close(ref, got, rtol=2e-2)  # bf16: different reduction orders


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_lora_layers_compiled_and_recomputed_match_eager(recompute):
    """LoRA adapters inside compiled (and checkpointed) layers: the eager model's loss and adapter gradients.
    A compiled forward must not make the adapters' row map itself (place_adapters does), or the checkpointed
    forward and its recomputation compile to different graphs."""
    import dataclasses

    from llamatron.adapters.lora import place_adapters
    from llamatron.adapters.targets import apply_lora, find_targets
    from llamatron.models import build_model, get_preset, materialize
    from llamatron.training.engine import apply_compile, apply_recompute

    cfg = dataclasses.replace(get_preset("llama-test"), num_layers=2)
    models = []
    for _ in range(2):
        model = build_model(cfg)
        apply_lora(model, find_targets(model, cfg, ["all-linear"]), 4, 8.0, 0.0)
        materialize(model, cfg, 0, "cuda", torch.bfloat16)
        place_adapters(model)
        with torch.no_grad():  # B away from zero: every adapter's gradient and update is non-zero
            for n, p in model.named_parameters():
                if n.endswith("lora_b"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
        models.append(model)
    if recompute != "none":
        apply_recompute(models[1], recompute, None)
    apply_compile(models[1])
    x = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda")
    outs = []
    for model in models:
        loss = cross_entropy_per_token(model(x), x).float().mean()
        loss.backward()
        outs.append((loss.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-2, atol=1e-2)
    assert outs[0][1].keys() == outs[1][1].keys() and len(outs[0][1]) == 2 * 2 * 4  # A and B, 4 linears a layer
    for n, g in outs[0][1].items():
        assert (g - outs[1][1][n]).norm() / g.norm().clamp_min(1e-6) < 5e-2, n
