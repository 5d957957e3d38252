"""Whether Triton is installed, looked up once at import (not while torch.compile traces a layer), and the
test each layer with Triton kernels makes with its own choice (`--swiglu-backend`, `--rmsnorm-backend`,
`--rope-backend`, `--cross-entropy-backend`: kernels/choices.py; models/kernels.py gives each layer its own)."""

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None


def kernels_on(backend: str, x) -> bool:
    """A layer whose choice is `backend` runs its Triton kernels for this tensor: on CUDA, with Triton installed,
    unless the choice is torch. Layers call it as `triton_check.kernels_on`, so tests can stand in for CUDA."""
    return backend != "torch" and x.is_cuda and HAS_TRITON
