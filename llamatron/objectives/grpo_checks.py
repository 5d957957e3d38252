"""--objective grpo's settings against the rest of the run, checked before any memory is spent (one line each)."""

from __future__ import annotations

from ..config.objective_settings import ObjectiveConfig


def grpo_problems(ob: ObjectiveConfig) -> list[str]:
    """What --objective grpo cannot run with."""
    if ob.objective != "grpo":
        return []
    return ["--objective grpo: its rollouts are not built yet (the loss alone is: objectives/grpo.py)"]
