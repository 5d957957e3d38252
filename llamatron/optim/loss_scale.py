"""Dynamic loss scaling for fp16: keep small gradients representable, back off on overflow.

The scale lives on the device and is updated there, so a step needs no host sync.
The engine divides the loss by (total_tokens / scale) instead of total_tokens, so
gradients arrive multiplied by `scale`; the optimizer divides them back before
clipping and skips the update when they overflowed.
"""

from __future__ import annotations

import torch


class DynamicLossScaler:
    def __init__(
        self,
        device: torch.device,
        initial: float = 2.0**16,
        growth_interval: int = 1000,
        backoff: float = 0.5,
        growth: float = 2.0,
        min_scale: float = 1.0,
    ):
        self.scale = torch.tensor(initial, device=device, dtype=torch.float32)
        self.good_steps = torch.zeros((), device=device, dtype=torch.int64)
        self.growth_interval, self.backoff, self.growth, self.min_scale = growth_interval, backoff, growth, min_scale

    def update(self, found_inf: torch.Tensor) -> None:
        """After a step: halve on overflow (the step was skipped), double after `growth_interval` clean steps."""
        overflow = found_inf > 0
        self.good_steps = torch.where(overflow, torch.zeros_like(self.good_steps), self.good_steps + 1)
        grow = self.good_steps >= self.growth_interval
        scale = torch.where(
            overflow,
            (self.scale * self.backoff).clamp_min(self.min_scale),
            torch.where(grow, self.scale * self.growth, self.scale),
        )
        self.good_steps = torch.where(grow, torch.zeros_like(self.good_steps), self.good_steps)
        self.scale = scale

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": float(self.scale), "good_steps": int(self.good_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.scale.fill_(state["scale"])
        self.good_steps.fill_(state["good_steps"])
