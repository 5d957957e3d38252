"""Runs `llamatron train` with randomness in every training step, drawn from the process's Python, NumPy and
torch generators as dropout would, for the test that --load restores them:

    python tests/random_training.py train ...

llamatron's models have no dropout, so without this nothing in a run would show whether the states came back.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

from llamatron import cli
from llamatron.models.transformer import Transformer


def main() -> None:
    random.seed(0)  # the trainer seeds torch with --seed; these two are the test's
    np.random.seed(0)
    forward = Transformer.forward

    def noisy_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if not self.training:  # evaluation draws nothing, as dropout would not
            return out
        scale = 1.0 + 0.1 * (random.random() + float(np.random.rand()))
        return torch.nn.functional.dropout(out, 0.2, training=True) * scale

    Transformer.forward = noisy_forward
    cli.main(sys.argv[1:])


if __name__ == "__main__":
    main()
