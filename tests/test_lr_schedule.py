"""The learning-rate schedule against its formulas written out: linear warm-up from peak/warmup, then cosine or
linear decay from --lr to the --min-lr floor (issue 39: the only check used lr_at as its own reference)."""

from __future__ import annotations

import math

import pytest
from layout import BASE_ARGS, run_train

from llamatron.optim import lr_at

PEAK, FLOOR = 1e-3, 1e-4


def test_warmup_climbs_linearly_to_the_peak():
    # step k (0-based) of a 4-step warm-up trains at (k + 1) / 4 of the peak
    assert [lr_at(k, PEAK, FLOOR, 4, 100, "cosine") for k in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_starts_at_the_peak_and_ends_on_the_floor(schedule):
    warmup, total = 10, 110  # 100 decay steps
    assert lr_at(warmup, PEAK, FLOOR, warmup, total, schedule) == pytest.approx(PEAK)
    assert lr_at(total, PEAK, FLOOR, warmup, total, schedule) == pytest.approx(FLOOR)
    assert lr_at(10 * total, PEAK, FLOOR, warmup, total, schedule) == pytest.approx(FLOOR)  # and stays there
    # halfway: the mean of peak and floor for both shapes (cos(pi/2) = 0)
    assert lr_at(warmup + 50, PEAK, FLOOR, warmup, total, schedule) == pytest.approx(5.5e-4)


def test_a_quarter_of_the_way_down():
    # cosine: floor + (peak - floor) * (1 + cos(pi/4)) / 2 = 1e-4 + 9e-4 * 0.853553...; linear: 1e-4 + 9e-4 * 0.75
    assert lr_at(35, PEAK, FLOOR, 10, 110, "cosine") == pytest.approx(1e-4 + 9e-4 * 0.8535533905932737)
    assert lr_at(35, PEAK, FLOOR, 10, 110, "linear") == pytest.approx(1e-4 + 9e-4 * 0.75)
    assert lr_at(35, PEAK, FLOOR, 10, 110, "constant") == PEAK


def test_a_training_run_logs_the_schedule_it_was_given(tmp_path):
    """What the optimizer used, as logged per step: 6 steps, 2 of warm-up, cosine to --min-lr 1e-4."""
    args = [*BASE_ARGS, "--train-steps", "6", "--warmup-steps", "2", "--lr-schedule", "cosine"]
    logged = [r["lr"] for r in run_train(args, 1, tmp_path)]
    decay = [FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert logged == pytest.approx([5e-4, 1e-3, *decay], rel=1e-6)
    assert logged[-1] == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(3 * math.pi / 4)))  # 2.318e-4: floor counts
