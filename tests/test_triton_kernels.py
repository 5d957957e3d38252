"""The Triton kernels themselves, run on CPU by Triton's interpreter (TRITON_INTERPRET=1).

The GPU tests (test_gpu.py) run them compiled on CUDA; these run the same kernel source everywhere the test
extras install triton, so a wrong index or formula fails on a CPU too.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")  # a test dependency on Linux x86-64 (pyproject [test]); no wheels elsewhere

ROOT = Path(__file__).resolve().parents[1]


def _run_interpreted(code: str) -> None:
    """Run `code` in a fresh interpreter with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_swiglu_kernels_match_the_plain_expression():
    _run_interpreted("""
        import torch
        import torch.nn.functional as F
        from llamatron.kernels.swiglu_op import _kernels

        torch.manual_seed(0)
        # ffn 100: one partial block; 1500: a full block of 1024 and a partial one
        for rows, ffn in ((3, 100), (2, 1500)):
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
                x = torch.randn(rows, 2 * ffn, dtype=dtype)
                dy = torch.randn(rows, ffn, dtype=dtype)
                out, dx = torch.empty(rows, ffn, dtype=dtype), torch.empty_like(x)
                _kernels().forward(x, out, rows, ffn)
                _kernels().backward(x, dy, dx, rows, ffn)
                xr = x.float().requires_grad_()
                gate, up = xr.chunk(2, dim=-1)
                ref = F.silu(gate) * up
                (g_ref,) = torch.autograd.grad(ref, xr, dy.float())
                torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
                torch.testing.assert_close(dx.float(), g_ref, rtol=tol, atol=tol)
    """)


def test_gather_sum_kernel_matches_the_expression():
    """The MoE combine's kernel (kernels/gather_sum_op.py): each token's k rows at the index, weighted or not,
    summed in fp32 with one rounding, against the expression in fp64; hidden 1100: a full block and a partial one."""
    _run_interpreted("""
        import torch
        from llamatron.kernels.gather_sum_op import _kernels

        torch.manual_seed(0)
        for tokens, k, hidden in ((5, 1, 100), (3, 3, 1100), (2, 8, 64)):
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
                rows = torch.randn(tokens * k, hidden, dtype=dtype)
                index = torch.randperm(tokens * k)
                weights = torch.rand(tokens, k, dtype=dtype)
                for w in (weights, None):
                    out = torch.empty(tokens, hidden, dtype=dtype)
                    _kernels().run(rows, index, w, out, k)
                    ref = rows.double()[index].view(tokens, k, hidden)
                    ref = (ref if w is None else ref * w.double().unsqueeze(-1)).sum(1)
                    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    """)


def test_gradient_accumulation_kernel_writes_then_adds_exactly():
    _run_interpreted("""
        import torch
        from llamatron.parallel.grad_accumulate import _BLOCK, _kernel

        torch.manual_seed(0)
        kernel = _kernel()
        for n in (1, 4097, 2 * 4096 + 5):
            grad = torch.randn(n, dtype=torch.bfloat16)
            dst = torch.randn(n)
            grid = (-(-n // _BLOCK),)
            kernel[grid](dst, grad, n, OVERWRITE=True, BLOCK=_BLOCK)
            assert torch.equal(dst, grad.float())
            kernel[grid](dst, grad, n, OVERWRITE=False, BLOCK=_BLOCK)
            assert torch.equal(dst, grad.float() + grad.float())
    """)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_triton_adamw_matches_the_fused_torch_path(precision):
    """--adamw-kernel triton against the default (torch's fused AdamW + copy) on the same model and data:
    steps with clipping active (the gradient scale path), decayed and undecayed parameters, then a skipped
    (non-finite) step. fp32: master = parameter; bf16/fp16: fp32 masters and the half weights written by the
    kernel (the interpreter truncates instead of rounding, so those agree within one ulp here; exactly on GPU);
    fp16 also divides out the dynamic loss scale in the kernel."""
    _run_interpreted(f"""
        import torch
        from llamatron.config.settings import config_from_values
        from llamatron.training.validate import validate
        from llamatron.data.batches import micro_batches_for_step
        from llamatron.data.mock import MockDataset
        from llamatron.training.engine import build_engine, train_step
        from llamatron.parallel.mesh import build_mesh

        cfg = config_from_values({{"model": "llama-test", "mock_data": True, "seq_length": 16, "micro_batch_size": 2,
                                  "global_batch_size": 4, "device": "cpu", "clip_grad": 0.05, "lr": 1e-2,
                                  "train_steps": 4, "precision": "{precision}"}})
        engines = [build_engine(cfg, validate(cfg, 1), build_mesh()) for _ in range(2)]
        engines[1].optimizer.kernel = "triton"  # config validation keeps it to CUDA; the interpreter runs it here
        data = MockDataset(256, 16, 0)
        steps = 3 if "{precision}" == "fp32" else 1  # half: the interpreter's truncated weights would make the
        for step in range(steps):                     # next gradients differ, so compare one step there
            outs = [train_step(e, micro_batches_for_step(data, step * 4, 4, 2, 1, 0), step) for e in engines]
            assert float(outs[0]["grad_norm"]) > 0.05  # clipping is active
        for e in engines:  # a non-finite step is skipped on device, step counters included
            e.optimizer.grads()[0][0] = float("nan")
            e.optimizer.step(1e-2)
        a, b = engines[0].optimizer, engines[1].optimizer
        # ~0.1% of an update (lr 1e-2) after one step; fp32 runs three, whose rounding differences feed the next
        # gradients (with triton 3.9's interpreter one element of 16384 ends 1.7e-5 apart): 0.3% there
        atol = 3e-5 if steps == 3 else 1e-5
        for name in ("master", "exp_avg", "exp_avg_sq", "steps"):
            for x, y in zip(getattr(a, name), getattr(b, name)):
                torch.testing.assert_close(y, x, rtol=1e-4, atol=atol)
        assert float(b.steps[0]) == steps
        pa, pb = a.buffers[0].param_data.float(), b.buffers[0].param_data.float()
        mantissa = {{"fp32": None, "bf16": 7, "fp16": 10}}["{precision}"]
        ulp = pa.abs() * 2.0 ** -mantissa if mantissa else torch.zeros_like(pa)
        assert ((pa - pb).abs() <= ulp + atol).all()
    """)


def test_rmsnorm_kernels_match_the_plain_expression():
    """Forward (with and without the residual add) and backward (input gradient, the residual's gradient
    added, weight gradient summed over programs of several rows, the last one partly empty)."""
    _run_interpreted("""
        import torch
        from llamatron.kernels import rmsnorm_op

        rmsnorm_op._BACKWARD_PROGRAMS = 3  # 7 rows: programs of 3 rows, the last holding one
        torch.manual_seed(0)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)):
            for cols in (48, 130):  # 130: a partly masked block of 256
                x, delta, dy, dh = (torch.randn(7, cols, dtype=dtype) for _ in range(4))
                w = (1 + 0.1 * torch.randn(cols)).to(dtype)
                h, y, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(7)
                rmsnorm_op._forward(x, delta, w, h, y, rstd, 1e-5)
                xr, dr, wr = (t.float().requires_grad_() for t in (x, delta, w))
                h_ref = (xr + dr).to(dtype).float()
                y_ref = rmsnorm_op.reference_rms_norm(h_ref, wr, 1e-5)
                torch.testing.assert_close(h.float(), h_ref, rtol=tol, atol=tol)
                torch.testing.assert_close(y.float(), y_ref, rtol=tol, atol=tol)
                y2, rstd2 = torch.empty_like(x), torch.empty(7)
                rmsnorm_op._forward(x, None, w, None, y2, rstd2, 1e-5)
                torch.testing.assert_close(y2.float(), rmsnorm_op.reference_rms_norm(x.float(), w.float(), 1e-5),
                                           rtol=tol, atol=tol)
                for grad_h in (dh, None):
                    dx = torch.empty_like(x)
                    dw = rmsnorm_op._backward(dy, grad_h, h, w, rstd, dx)
                    hr = h.float().requires_grad_()
                    wr2 = w.float().requires_grad_()
                    gx, gw = torch.autograd.grad(rmsnorm_op.reference_rms_norm(hr, wr2, 1e-5), (hr, wr2), dy.float())
                    if grad_h is not None:
                        gx = gx + grad_h.float()
                    torch.testing.assert_close(dx.float(), gx, rtol=tol, atol=tol)
                    torch.testing.assert_close(dw.float(), gw, rtol=tol, atol=tol * cols ** 0.5)
    """)


def test_qkv_rope_kernels_match_split_and_apply_rope():
    """Forward: q and k rotated, v copied, from one QKV row per token (GQA, a padded head count, per-sample
    positions); backward: the three gradients (one of them strided) rotated back into one QKV-row gradient."""
    _run_interpreted("""
        import torch
        from llamatron.models.config import ModelConfig
        from llamatron.models.layers import apply_rope, rope_cos_sin
        from llamatron.kernels.rope_op import _backward_kernel, _forward_kernel, _pow2

        torch.manual_seed(0)
        batch, seq, dim = 2, 5, 16
        # 6 + 2 q+k heads: a power of two; 6 + 3: padded to 16; 5 + 1: multi-query (Falcon 7B)
        for heads, kv, dtype, tol in ((6, 2, torch.float32, 1e-5), (6, 3, torch.bfloat16, 2e-2),
                                      (5, 1, torch.float16, 3e-3)):
            cfg = ModelConfig(family="llama", vocab_size=8, hidden_size=heads * dim, num_layers=1, num_heads=heads,
                              num_kv_heads=kv, ffn_hidden_size=8, max_seq_length=16)
            positions = torch.stack([torch.arange(seq), torch.arange(3, 3 + seq)])
            cos, sin = rope_cos_sin(cfg, positions, dtype)
            qkv = torch.randn(batch, seq, (heads + 2 * kv) * dim, dtype=dtype)
            q, k, v = (torch.empty(batch, seq, n, dim, dtype=dtype) for n in (heads, kv, kv))
            forward, backward = _forward_kernel(), _backward_kernel()
            forward[(batch * seq,)](qkv, cos, sin, q, k, v, seq, *qkv.stride()[:2], *cos.stride()[:2],
                                    *sin.stride()[:2], HEADS=heads, KV_HEADS=kv, HALF=dim // 2,
                                    PAIRS=_pow2(heads + kv), KV_POW2=_pow2(kv))
            ref_in = qkv.float().requires_grad_()
            rq, rk, rv = ref_in.view(batch, seq, -1, dim).split([heads, kv, kv], dim=2)
            rq, rk = (apply_rope(t.transpose(1, 2), cos.float(), sin.float()).transpose(1, 2) for t in (rq, rk))
            for got, want in ((q, rq), (k, rk), (v, rv)):
                torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
            dq = torch.randn(batch, heads, seq, dim, dtype=dtype).transpose(1, 2)  # strided, as attention may give
            dk, dv = torch.randn_like(k), torch.randn_like(v)
            dqkv = torch.empty_like(qkv)
            backward[(batch * seq,)](dq, dk, dv, cos, sin, dqkv, seq, *dq.stride()[:3], *dk.stride()[:3],
                                     *dv.stride()[:3], *cos.stride()[:2], *sin.stride()[:2], HEADS=heads,
                                     KV_HEADS=kv, HALF=dim // 2, PAIRS=_pow2(heads + kv), KV_POW2=_pow2(kv))
            (want,) = torch.autograd.grad((rq, rk, rv), ref_in, (dq.float(), dk.float(), dv.float()))
            torch.testing.assert_close(dqkv.float(), want, rtol=tol, atol=tol)
    """)


def test_cross_entropy_kernels_match_torch():
    _run_interpreted("""
        import torch
        import torch.nn.functional as F
        from llamatron.kernels.cross_entropy_op import IGNORE_INDEX, _FORWARD_BLOCK, _kernels

        torch.manual_seed(0)
        # vocab 100: one partial block; 2 blocks + 5: the running max and sum carried across blocks
        for rows, vocab in ((4, 100), (3, 2 * _FORWARD_BLOCK + 5)):
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
                x = (4 * torch.randn(rows, vocab)).to(dtype)
                labels = torch.randint(0, vocab, (rows,))
                labels[1] = IGNORE_INDEX
                grad = torch.rand(rows)
                loss, lse, dx = torch.empty(rows), torch.empty(rows), torch.empty_like(x)
                _kernels().forward(x, labels, loss, lse)
                _kernels().backward(x, labels, lse, grad, dx)
                xr = x.float().requires_grad_()
                ref = F.cross_entropy(xr, labels, ignore_index=IGNORE_INDEX, reduction="none")
                (ref_dx,) = torch.autograd.grad((ref * grad).sum(), xr)
                torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(lse, torch.logsumexp(x.float(), -1), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(dx.float(), ref_dx, rtol=tol, atol=tol * float(ref_dx.abs().max()))
                assert loss[1] == 0 and dx[1].eq(0).all()
        labels[0] = vocab  # outside the vocabulary: NaN loss and gradient row, nothing read out of bounds
        _kernels().forward(x, labels, loss, lse)
        _kernels().backward(x, labels, lse, grad, dx)
        assert loss[0].isnan() and dx[0].isnan().all() and loss[2:].isfinite().all()
        # a row whose first block is all -inf (a masked vocabulary): no NaN from exp(-inf - -inf)
        x = torch.randn(1, 2 * _FORWARD_BLOCK + 5)
        x[0, :_FORWARD_BLOCK] = float("-inf")
        label = torch.tensor([_FORWARD_BLOCK + 3])
        loss, lse = torch.empty(1), torch.empty(1)
        _kernels().forward(x, label, loss, lse)
        torch.testing.assert_close(loss, F.cross_entropy(x, label, reduction="none"), rtol=1e-5, atol=1e-5)
    """)


def test_decode_attention_kernel_writes_the_cache_and_matches_the_torch_step():
    """kernels/decode_attention_op.py's kernel against the torch ops it replaces (scatter the new key and value into
    each row's slot, then softmax attention under the rows' bias): GQA groups of 1-8 heads, a head size that is not
    a power of two, sliding windows, chunks, both, rows at their first and their last slot. fp32 and fp16 (the
    interpreter's bf16 dots are wrong: bf16 is checked on the GPU, test_decode_gpu.py)."""
    _run_interpreted("""
        import os, sys
        import torch
        sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "tests"))
        from decode_reference import torch_step
        from llamatron.kernels.decode_attention_op import _kernels

        torch.manual_seed(0)
        cases = [  # heads, kv heads, head dim, batch, slots, window, chunk
            (4, 2, 64, 3, 150, None, None), (8, 1, 48, 2, 70, 16, None), (2, 2, 64, 2, 130, None, 32),
            (6, 2, 32, 3, 100, 20, 8), (16, 2, 16, 2, 9, None, None),
        ]
        for heads, kv_heads, dim, batch, slots, window, chunk in cases:
            for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
                positions = torch.randint(0, slots, (batch,))
                positions[0], positions[-1] = slots - 1, 0
                q = torch.randn(batch, 1, heads, dim, dtype=dtype).transpose(1, 2)  # the rotary kernel's layout
                k_new, v_new = (torch.randn(batch, kv_heads, 1, dim, dtype=dtype) for _ in range(2))
                keys, values = (torch.randn(batch, kv_heads, slots, dim, dtype=dtype) for _ in range(2))
                ref, ref_keys, ref_values = torch_step(q, k_new, v_new, keys, values, positions, window, chunk)
                out = torch.empty(q.shape, dtype=dtype)
                _kernels().attend(q, k_new, v_new, keys, values, positions, window or 0, chunk or 0, out)
                assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
                torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    """)


@pytest.mark.parametrize("preset", ["mistral-test", "llama4-test"])
def test_decoding_through_the_kernel_gives_the_full_recompute_logits(preset):
    """The kernel inside the model (the strides the layers hand it, the positions the cache holds): per-row steps
    after a right-padded prefill give the logits of recomputing each whole sequence (a sliding window; Llama 4's
    chunks and NoPE layer), with only the decode kernel switched on."""
    _run_interpreted(f"""
        import dataclasses, types
        import torch
        from llamatron.models import build_model, get_preset, materialize
        from llamatron.kernels import decode_attention_op
        from llamatron.models.kv_cache import KVCache

        calls = []
        def kernel_runs(backend, x):
            calls.append(1)
            return True
        decode_attention_op.triton_check = types.SimpleNamespace(kernels_on=kernel_runs)
        cfg = dataclasses.replace(get_preset("{preset}"), init_std=0.3)
        model = materialize(build_model(cfg), cfg, 1, "cpu", torch.float32).eval()
        prompts = [[5, 17, 99], [5, 17, 99, 3, 42, 7, 200, 11, 64, 128, 31], [5], [5, 17, 99, 3, 42, 7]]
        lengths = torch.tensor([len(p) for p in prompts])
        cache = KVCache(40)
        with torch.no_grad():
            padded = torch.tensor([p + [0] * (11 - len(p)) for p in prompts])
            logits = model(padded, cache=cache, logits_at=lengths - 1)[:, -1]
            cache.continue_rows(lengths)
            seqs = [list(p) for p in prompts]
            for step in range(12):
                for row, ids in enumerate(seqs):
                    full = model(torch.tensor([ids]))[0, -1]
                    assert (logits[row] - full).abs().max() <= 1e-5 * full.abs().max(), (step, row)
                chosen = logits.argmax(-1)
                for ids, token in zip(seqs, chosen.tolist()):
                    ids.append(token)
                logits = model(chosen[:, None], cache=cache)[:, -1]
        assert len(calls) == 12 * cfg.num_layers, len(calls)
    """)
