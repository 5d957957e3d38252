"""--rampup-batch-size START INCREMENT SAMPLES: Megatron-LM's batch-size ramp, what a step trains on, its
layout independence, and a resume in the middle of the ramp."""

import pytest
from layout import assert_matches, run_train

from llamatron.config.settings import config_from_values
from llamatron.data.batch_rampup import BatchSizes, rampup_problems
from llamatron.errors import ConfigError
from llamatron.training.validate import validate

RAMP = [
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--rampup-batch-size",
    "2",
    "2",
    "12",
    "--train-steps",
    "7",
]


def megatron_size(consumed: int, start: int, increment: int, samples: int, final: int) -> int:
    """Megatron-LM's rule, written out: the batch grows by `increment` every samples / increments samples."""
    increments = (final - start) // increment
    if consumed > samples:
        return final
    return start + int(consumed / (samples / increments)) * increment


@pytest.mark.parametrize("ramp", [(2, 2, 12), (16, 16, 1000), (8, 8, 99), (4, 60, 7)])
def test_the_batch_grows_as_megatron_grows_it(ramp):
    final = 64
    sizes = BatchSizes.of(final, ramp)
    consumed, seen = 0, []
    for _ in range(200):
        assert sizes.at(consumed) == megatron_size(consumed, *ramp, final), consumed
        seen.append(sizes.at(consumed))
        consumed += seen[-1]
    assert seen == sorted(seen) and seen[0] == ramp[0] and seen[-1] == final
    assert set(seen) <= set(sizes.sizes())
    for steps in (0, 1, 5, 200):
        assert sizes.samples_for(steps) == sum(seen[:steps])
    assert sizes.samples_for(3, consumed_samples=seen[0]) == sum(seen[1:4])
    assert BatchSizes.of(final, None).at(12345) == final and BatchSizes.of(final, None).samples_for(3) == 3 * final


def test_bad_ramps_are_named():
    assert rampup_problems(None, 8, 2) == []
    assert "3 numbers" in rampup_problems([2, 2], 8, 2)[0]
    assert "not below --global-batch-size 8" in rampup_problems([8, 2, 10], 8, 2)[0]
    assert "not a multiple of INCREMENT 2" in rampup_problems([3, 2, 10], 8, 1)[0]
    assert "size = 4; not so: START 2 and INCREMENT 2" in rampup_problems([2, 2, 10], 8, 4)[0]
    assert rampup_problems([4, 2, 10], 8, 4)[0].endswith("not so: INCREMENT 2")
    assert "at least 1" in rampup_problems([2, 2, 0], 8, 2)[0]
    cfg = config_from_values({"model": "llama-test4", "global_batch_size": 8, "micro_batch_size": 1, "pp": 2,
                              "vpp": 2, "rampup_batch_size": [2, 3, 10]})  # fmt: skip
    with pytest.raises(ConfigError, match="groups of pp=2, but a step has 5"):  # the ramp's 5 micro-batches
        validate(cfg, world_size=2)


def test_each_step_trains_on_its_ramped_batch_under_any_layout_and_resumes_mid_ramp(tmp_path):
    single = run_train(RAMP + ["--save", "ck", "--save-interval", "3"], 1, tmp_path)
    assert [r["global_batch_size"] for r in single] == [2, 2, 4, 6, 8, 8, 8]
    assert [r["consumed_samples"] for r in single] == [2, 4, 8, 14, 22, 30, 38]
    assert_matches(single, run_train(RAMP + ["--distributed-optimizer"], 2, tmp_path))
    resumed = run_train(RAMP + ["--load", "ck/step-3"], 1, tmp_path)  # step 3 ends inside the ramp
    assert_matches(single[3:], resumed, rtol=0)
    constant = run_train(RAMP[:4] + RAMP[-2:], 1, tmp_path)
    assert [r["loss"] for r in constant] != [r["loss"] for r in single]
