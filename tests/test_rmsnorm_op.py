"""The RMSNorm custom ops' autograd wiring, through their CPU kernels (the Triton kernels: test_triton_kernels)."""

import torch

from llamatron.kernels.rmsnorm_op import add_rms_norm_op, reference_rms_norm, rms_norm_op
from llamatron.models.layers import RMSNorm


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad)


def test_rms_norm_op_matches_the_module_forward_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 12, dtype=torch.float32, requires_grad=True)
    w = torch.randn(12, dtype=torch.float32, requires_grad=True)
    dy = torch.randn(2, 5, 12, dtype=torch.float32)
    y, _ = rms_norm_op(x, w, 1e-5)
    ref = reference_rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, ref)
    for got, want in zip(_grads(y, (x, w), dy), _grads(ref, (x, w), dy)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # same math, another summation order


def test_add_rms_norm_op_routes_both_gradients_to_both_summands():
    """d(x) = d(delta) = the residual's gradient + the norm's input gradient; the weight gets the norm's."""
    torch.manual_seed(0)
    x, delta = (torch.randn(3, 8, dtype=torch.float32, requires_grad=True) for _ in range(2))
    w = torch.randn(8, dtype=torch.float32, requires_grad=True)
    dh, dy = torch.randn(3, 8, dtype=torch.float32), torch.randn(3, 8, dtype=torch.float32)
    h, y, _ = add_rms_norm_op(x, delta, w, 1e-6)
    h_ref = x + delta
    y_ref = reference_rms_norm(h_ref, w, 1e-6)
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(y, y_ref)
    got = torch.autograd.grad((h, y), (x, delta, w), (dh, dy))
    want = torch.autograd.grad((h_ref, y_ref), (x, delta, w), (dh, dy))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_module_add_and_norm_equals_add_then_norm_off_cuda():
    norm = RMSNorm(6)
    x, delta = torch.randn(4, 6), torch.randn(4, 6)
    h, y = norm.add_and_norm(x, delta)
    torch.testing.assert_close(h, x + delta)
    torch.testing.assert_close(y, norm(x + delta))
