"""fp16 with dynamic loss scaling (issue 5, mixed precision)."""

import torch
from layout import run_train

from llamatron.optim import DynamicLossScaler


def test_scaler_backs_off_on_overflow_and_grows_after_clean_steps():
    s = DynamicLossScaler(torch.device("cpu"), initial=1024.0, growth_interval=3)
    s.update(torch.tensor(1.0))
    assert float(s.scale) == 512.0
    for _ in range(2):
        s.update(torch.tensor(0.0))
    assert float(s.scale) == 512.0
    s.update(torch.tensor(0.0))
    assert float(s.scale) == 1024.0 and int(s.good_steps) == 0


def test_fp16_training_tracks_fp32_and_skips_overflowing_steps(tmp_path):
    ref = run_train([], 1, tmp_path)
    fp16 = run_train(["--precision", "fp16"], 1, tmp_path)
    assert not any(r["skipped"] for r in fp16)
    for a, b in zip(ref, fp16):
        assert abs(a["loss"] - b["loss"]) < 0.05 * a["loss"]
    assert fp16[-1]["loss"] < fp16[0]["loss"]


def test_overflow_skips_the_step_and_halves_the_scale(tmp_path):
    # 2**60 times any gradient overflows fp16 (max 65504): every step overflows and is skipped.
    records = run_train(
        ["--precision", "fp16", "--initial-loss-scale", str(2.0**60), "--train-steps", "3", "--eval-interval", "3"],
        1,
        tmp_path,
        include_eval=True,
    )
    runs = [r for r in records if r.get("split") is None]
    assert [r["skipped"] for r in runs] == [True, True, True]
    assert [r["loss_scale"] for r in runs] == [2.0**59, 2.0**58, 2.0**57]  # recorded after the step's update
    # Skipped steps leave the weights untouched: validation loss after 3 steps equals the one before any.
    valid = [r["loss"] for r in records if r.get("split") == "valid"]
    assert len(valid) == 2 and valid[0] == valid[1]
