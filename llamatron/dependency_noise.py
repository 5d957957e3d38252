"""Log lines of the libraries llamatron uses that say nothing to its users, kept off the console.

Importing transformers or peft imports torchao when it is installed, and torchao then logs a warning for each of
its optional native kernels the machine cannot load (its CUDA kernels on a CPU machine, kernels for another
Python: "Failed to load .../_C_cutlass_90a.abi3.so"), and torch one for each of torchao's enums it registers ("is
an Enum subclass and is now natively supported"). llamatron calls neither torchao's native kernels (its FP8 paths
use torch's scaled matmuls and torchao's Triton kernels) nor anything those lines concern. lm-eval notes each metric
a task file lists without its aggregation, which it then takes from the metric. Every other warning of these
loggers still shows.
"""

from __future__ import annotations

import logging

# logger name -> fragments of the messages dropped (all must occur)
_DROPPED = {
    "torchao": ("Failed to load ", ".so: "),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    # lm-eval, for each metric a task file lists without its aggregation or direction: it takes the metric's
    # own default (mean, higher is better for acc), as the task's author left it to
    "lm_eval.api.task": ("[Task: ", "] metric ", " is defined, but ", " is not. using default "),
}


class _Drop(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(fragment in message for fragment in self.fragments)


def quiet_dependency_noise() -> None:
    """Install the filters (once per logger)."""
    for name, fragments in _DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(fragments))
