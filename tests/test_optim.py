"""Optimizers as plug-ins (llamatron/optim/): the registry, and that nothing outside it names an optimizer's state."""

from __future__ import annotations

import re
from pathlib import Path

from llamatron.optim import OPTIMIZERS

ROOT = Path(__file__).resolve().parents[1] / "llamatron"


def test_no_module_outside_the_optimizers_names_their_state():
    """The checkpoint writer/reader, resharding, planner and bench iterate what the optimizer declares (state kinds,
    bytes per parameter); only llamatron/optim/ (and AdamW's fused kernel, which takes the moments) names them."""
    names = {kind for k in OPTIMIZERS.values() for kind in k.state_kinds}
    pattern = re.compile("|".join(rf"\b{re.escape(n)}\b" for n in names))
    found = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for path in ROOT.rglob("*.py")
        if "optim" not in path.relative_to(ROOT).parts[:1] and path.name != "adamw_kernel.py"
        for line in path.read_text().splitlines()
        if pattern.search(line)
    ]
    assert names and not found, found


def test_optimizer_choices_are_the_registry():
    from llamatron.config.settings import OPTIMIZERS as CHOICES

    assert set(CHOICES) == set(OPTIMIZERS)
