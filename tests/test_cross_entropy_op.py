"""The cross-entropy custom op's autograd wiring, through its CPU kernels (the Triton kernels:
test_triton_kernels; on CUDA: test_gpu)."""

import pytest
import torch

from llamatron.models.cross_entropy_op import IGNORE_INDEX, cross_entropy_op, reference_cross_entropy


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
    """The model's loss function routes through the custom op when the switch says so (CUDA in real runs; its
    CPU kernel here), and through torch's loss with backend torch."""
    import llamatron.models.cross_entropy_op as ce

    calls = []
    real = ce.cross_entropy_op
    monkeypatch.setattr(ce, "cross_entropy_op", lambda *a: calls.append(1) or real(*a))
    logits, labels = torch.randn(3, 4, 10), torch.randint(0, 10, (3, 4))
    monkeypatch.setattr(ce, "use_kernels", lambda x: True)
    torch.testing.assert_close(ce.cross_entropy_per_token(logits, labels), reference_cross_entropy(logits, labels))
    assert calls == [1]
    monkeypatch.setattr(ce, "use_kernels", lambda x: False)
    ce.cross_entropy_per_token(logits, labels)
    assert calls == [1]
