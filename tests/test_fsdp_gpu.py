"""--fsdp on the GPU (pytest -m gpu): one rank, compiled, bf16, against the default data-parallel path; two ranks
(NCCL: the gathers and reduce-scatters on the device) against one process where two GPUs are visible."""

import pytest
import torch
from layout import assert_matches, run_train

pytestmark = pytest.mark.gpu

ARGS = ["--device", "cuda", "--precision", "bf16", "--seq-length", "128", "--train-steps", "6", "--compile"]


def test_fsdp_one_rank_compiled_matches_the_default(tmp_path):
    """With one rank the shard is the whole model (nothing gathered): the same step, up to the order the gradient
    norm sums its parts in."""
    default = run_train(ARGS, 1, tmp_path)
    fsdp = run_train([*ARGS, "--fsdp"], 1, tmp_path)
    assert_matches(default, fsdp, rtol=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_two_gpus_matches_one(tmp_path):
    args = [a for a in ARGS if a != "--compile"] + ["--precision", "fp32"]
    alone = run_train(args, 1, tmp_path)
    assert_matches(alone, run_train([*args, "--fsdp"], 2, tmp_path), rtol=1e-4)
