"""Deterministic synthetic tokens with learnable structure, for tests and benchmarks.

Each sample walks through the vocabulary in small steps: token[t+1] = token[t] + d (mod V)
with d drawn from four fixed strides. A model that learns the rule reaches a loss
of ln 4 ~ 1.39 from ln V at the start, so the loss visibly falls. Sample i depends
only on (seed, i), never on the layout that reads it.
"""

from __future__ import annotations

import numpy as np

STRIDES = np.array([1, 2, 3, 5], dtype=np.int64)


class MockDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int, num_samples: int = 2**31 - 1):
        self.vocab_size, self.seq_length, self.seed, self.num_samples = vocab_size, seq_length, seed, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(i)])
        start = rng.integers(0, self.vocab_size)
        steps = STRIDES[rng.integers(0, len(STRIDES), self.seq_length)]
        tokens = np.concatenate([[start], start + np.cumsum(steps)]) % self.vocab_size
        return tokens.astype(np.int64)
