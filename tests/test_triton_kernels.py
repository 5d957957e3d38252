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
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_swiglu_kernels_match_the_plain_expression():
    _run_interpreted("""
        import torch
        import torch.nn.functional as F
        from llamatron.models.swiglu_op import _kernels

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
