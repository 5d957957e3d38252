"""Every number of the simulator's and planner's calibration.yaml is pinned (issue 39): recomputed from the
measurement it cites, fitted to the recorded runs it cites, or inside the public range it cites
(tests/calibration_witness.py) — and moving any one of them by 20% either way fails its witness."""

from __future__ import annotations

import pytest
from calibration_witness import (
    ASSUMED,
    DERIVATION_INPUTS,
    FITTED,
    assumed_problems,
    derived,
    derived_problems,
    fitted_problems,
    leaves,
    scaled,
)

from llamatron.planning.simulator.calibration import calibration_table

TABLE = calibration_table()
DERIVED = sorted(derived(TABLE))
FITTED_PATHS = sorted(FITTED)


def _name(path: tuple[str, ...]) -> str:
    return ".".join(path)


def test_every_number_has_a_witness_and_nothing_else_is_left():
    pinned = set(DERIVED) | set(FITTED) | set(ASSUMED) | set(DERIVATION_INPUTS)
    numbers = set(leaves(TABLE))
    assert numbers - pinned == set(), "numbers with no witness"
    assert pinned - numbers == set(), "witnesses of numbers calibration.yaml no longer has"


def test_derived_numbers_agree_with_their_measurements():
    assert derived_problems(TABLE) == []


def test_assumed_numbers_are_inside_their_cited_ranges():
    assert assumed_problems(TABLE) == []


@pytest.mark.parametrize("path", FITTED_PATHS, ids=_name)
def test_fitted_numbers_fit_their_runs_best_nearby(path):
    assert fitted_problems(TABLE, path) == []


def _problems_with(path: tuple[str, ...], factor: float) -> list[str]:
    moved = scaled(TABLE, path, factor)
    if path in FITTED:
        return fitted_problems(moved, path)
    if path in ASSUMED:
        return assumed_problems(moved)
    return derived_problems(moved)


@pytest.mark.parametrize("factor", [0.8, 1.2])
@pytest.mark.parametrize("path", sorted(set(DERIVED) | set(ASSUMED) | set(DERIVATION_INPUTS)), ids=_name)
def test_moving_a_derived_or_assumed_number_by_20_percent_is_caught(path, factor):
    assert _problems_with(path, factor), f"{_name(path)} x{factor} passes its witness"


@pytest.mark.parametrize("factor", [0.8, 1.2])
@pytest.mark.parametrize("path", FITTED_PATHS, ids=_name)
def test_moving_a_fitted_number_by_20_percent_is_caught(path, factor):
    assert _problems_with(path, factor), f"{_name(path)} x{factor} passes its witness"
