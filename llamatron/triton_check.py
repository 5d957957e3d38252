"""Whether Triton is installed, looked up once at import (not while torch.compile traces a layer), and the
switch each model op with Triton kernels (`--swiglu-backend`, `--rmsnorm-backend`, `--rope-backend`,
`--cross-entropy-backend`) reads."""

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None


class KernelSwitch:
    """"auto"/"triton": the op's Triton kernels on CUDA; "torch": the plain expression (compiled with the layer).

    Process-wide and read when a layer is compiled or run (torch.compile guards on `setting`).
    """

    def __init__(self, what: str):
        self.what = what
        self.setting = "auto"

    def set(self, setting: str) -> None:
        if setting not in ("auto", "triton", "torch"):
            raise ValueError(f"unknown {self.what} backend {setting!r}; use auto, triton or torch")
        self.setting = setting

    def on(self, x) -> bool:
        """The kernels run for this tensor: on CUDA, with Triton installed, unless set to torch."""
        return self.setting != "torch" and x.is_cuda and HAS_TRITON
