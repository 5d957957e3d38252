"""Using a trained model: sampling (generate.py), `verify` (verify.py), evaluation (model_source.py, perplexity.py,
and the lm-evaluation-harness adapter: harness.py, harness_tasks.py)."""

from __future__ import annotations

from types import ModuleType

from ..errors import MissingPackageError


def lm_eval_harness() -> ModuleType:
    """`harness_tasks` (task names, runs, results; the `LlamatronLM` adapter), imported on first use: it needs
    lm-evaluation-harness, an optional package."""
    try:
        from . import harness_tasks
    except ImportError as e:
        raise MissingPackageError(
            f"lm-eval tasks need lm-evaluation-harness ({e}): pip install 'llamatron[eval]'"
        ) from None
    return harness_tasks
