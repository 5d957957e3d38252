"""--rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START by INCREMENT until it is
--global-batch-size, evenly over the first SAMPLES training samples (Megatron-LM's rule and flag).

A step's batch size is a function of the samples consumed before it, so a resume (which restores
consumed_samples) continues the ramp where it was, and what a step trains on stays a function of the data
position alone: step k trains on samples [consumed_k, consumed_k + size(consumed_k)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSizes:
    """The global batch size of each step: constant, or ramped up (`rampup`: START, INCREMENT, SAMPLES)."""

    global_batch_size: int
    rampup: tuple[int, int, int] | None = None

    @classmethod
    def of(cls, global_batch_size: int, rampup: Sequence[int] | None) -> BatchSizes:
        return cls(global_batch_size, tuple(rampup) if rampup else None)  # type: ignore[arg-type]

    def at(self, consumed_samples: int) -> int:
        """The batch size of the step that starts after `consumed_samples` samples."""
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples = self.rampup
        increments = (self.global_batch_size - start) // increment
        if consumed_samples >= samples or increments == 0:
            return self.global_batch_size
        done = int(consumed_samples * increments // samples)  # increments reached: samples / increments apart
        return min(start + done * increment, self.global_batch_size)

    def samples_for(self, steps: int, consumed_samples: int = 0) -> int:
        """Samples that `steps` steps consume from `consumed_samples` on."""
        consumed = consumed_samples
        for done in range(steps):
            size = self.at(consumed)
            if size == self.global_batch_size:  # the ramp is over: the rest in one go
                return consumed + size * (steps - done) - consumed_samples
            consumed += size
        return consumed - consumed_samples

    def sizes(self) -> list[int]:
        """Every batch size a run uses, smallest first."""
        if self.rampup is None:
            return [self.global_batch_size]
        start, increment, _ = self.rampup
        return list(range(start, self.global_batch_size, increment)) + [self.global_batch_size]


def rampup_problems(rampup: Sequence[int] | None, global_batch_size: int, per_micro_batch: int) -> list[str]:
    """What is wrong with --rampup-batch-size for this --global-batch-size, when each step's batch must be a
    multiple of `per_micro_batch` (micro-batch size x data-parallel size)."""
    if not rampup:
        return []
    if len(rampup) != 3:
        return [f"--rampup-batch-size takes START INCREMENT SAMPLES (3 numbers), not {len(rampup)}"]
    start, increment, samples = rampup
    if min(start, increment, samples) < 1:
        return [f"--rampup-batch-size {start} {increment} {samples}: each number must be at least 1"]
    if start >= global_batch_size:
        return [f"--rampup-batch-size starts at {start}, not below --global-batch-size {global_batch_size}"]
    if (global_batch_size - start) % increment:
        return [
            f"--rampup-batch-size: --global-batch-size {global_batch_size} - START {start} is not a multiple of "
            f"INCREMENT {increment}"
        ]
    bad = [f"{name} {n}" for name, n in (("START", start), ("INCREMENT", increment)) if n % per_micro_batch]
    if bad:
        return [
            f"--rampup-batch-size: START and INCREMENT must be multiples of micro-batch-size x data-parallel size "
            f"= {per_micro_batch}; not so: {' and '.join(bad)}"
        ]
    return []
