"""The learning-rate schedule every optimizer follows: linear warm-up, then constant, linear or cosine decay."""

from __future__ import annotations

import math


def lr_problems(lr: float, min_lr: float) -> list[str]:
    """The learning-rate schedule's flags that do not go together (each one's range is declared on its flag)."""
    return [f"--min-lr {min_lr} is above --lr {lr}"] if min_lr > lr else []


def lr_at(step: int, peak: float, floor: float, warmup: int, total: int, schedule: str) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then constant/linear/cosine to `floor`."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    if schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")
