"""The cross-entropy custom op's autograd wiring, through its CPU kernels (the Triton kernels:
test_triton_kernels; on CUDA: test_gpu)."""

import pytest
import torch

from llamatron.kernels.cross_entropy_op import IGNORE_INDEX, cross_entropy_op, reference_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_op_matches_torch_loss_and_gradient(dtype):
    """Per-token loss (fp32, labels' shape), 0 and a zero gradient row for ignored labels, and the gradient of a
    weighted sum (a non-uniform incoming gradient) in the logits' dtype."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 7, 50)).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (2, 7))
    labels[0, 2] = labels[1, 6] = IGNORE_INDEX
    weights = torch.rand(2, 7)
    loss, lse = cross_entropy_op(logits, labels)
    ref = reference_cross_entropy(logits, labels)
    assert loss.shape == labels.shape and loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), -1).flatten())
    assert loss[0, 2] == 0 and loss[1, 6] == 0
    (grad,) = torch.autograd.grad((loss * weights).sum(), logits)
    (want,) = torch.autograd.grad((ref * weights).sum(), logits)
    assert grad.dtype == dtype and grad[0, 2].eq(0).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad.float(), want.float(), rtol=tol, atol=tol)


def test_model_loss_runs_the_op_when_its_kernels_are_on(monkeypatch):
    """The model's loss function routes through the custom op when its choice says so (CUDA in real runs; its
    CPU kernel here), and through torch's loss with backend torch."""
    import llamatron.kernels.cross_entropy_op as ce
    from llamatron.kernels import triton_check

    calls = []
    real = ce.cross_entropy_op
    monkeypatch.setattr(ce, "cross_entropy_op", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(triton_check, "kernels_on", lambda backend, x: backend != "torch")  # CUDA with Triton
    logits, labels = torch.randn(3, 4, 10), torch.randint(0, 10, (3, 4))
    torch.testing.assert_close(ce.CrossEntropy()(logits, labels), reference_cross_entropy(logits, labels))
    assert calls == [1]
    ce.CrossEntropy("torch")(logits, labels)
    assert calls == [1]


def test_cross_entropy_op_passes_opcheck_with_non_contiguous_logits():
    """torch.library.opcheck: the fake (meta) outputs match the real ones in shape, dtype and strides, and the
    autograd registration is consistent, also for logits whose vocabulary dimension is not the innermost in memory."""
    torch.manual_seed(0)
    logits = torch.randn(10, 3, 4).permute(1, 2, 0).requires_grad_()  # (3, 4, vocab 10), non-contiguous
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 9], [0, 5, 5, 3], [IGNORE_INDEX, 8, 7, 6]])
    torch.library.opcheck(cross_entropy_op, (logits, labels))
    loss, lse = cross_entropy_op(logits, labels)
    assert loss.requires_grad and not lse.requires_grad  # the log-sum-exp has no gradient path
    torch.testing.assert_close(loss, reference_cross_entropy(logits, labels), rtol=1e-5, atol=1e-5)


def test_cross_entropy_op_refuses_mismatched_labels_and_poisons_out_of_range_ones():
    logits = torch.randn(2, 5, 10, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"labels \(2, 4\) do not match logits \(2, 5, 10\)"):
        cross_entropy_op(logits, torch.zeros(2, 4, dtype=torch.long))
    labels = torch.tensor([[1, 10, 2, -3, IGNORE_INDEX], [0, 1, 2, 3, 4]])  # 10 and -3: outside the vocabulary
    loss, _ = cross_entropy_op(logits, labels)
    assert loss[0, 1].isnan() and loss[0, 3].isnan() and loss[0, 4] == 0 and loss[1].isfinite().all()
    (grad,) = torch.autograd.grad(loss[1].sum() + loss[0, 1], logits)
    assert grad[0, 1].isnan().all() and grad[1].isfinite().all()  # the step's non-finite check then skips it


def test_cross_entropy_op_under_torch_compile_matches_eager():
    """Compiled as the engine compiles the loss (its CPU kernel here; the CUDA kernels: test_gpu)."""
    torch.manual_seed(0)
    loss_fn = torch.compile(lambda x, y: cross_entropy_op(x, y)[0], dynamic=False)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 6))
    labels[0, 1] = IGNORE_INDEX
    loss = loss_fn(logits, labels)
    ref = reference_cross_entropy(logits, labels)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(loss.sum(), logits), torch.autograd.grad(ref.sum(), logits)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
