"""Whether Triton is installed, looked up once at import (not while torch.compile traces a layer)."""

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None
