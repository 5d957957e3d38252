"""Supervised fine-tuning (--sft-data: the loss on the responses only, a mean over the global batch's trained
tokens) under parallel layouts equals the single process (fp32, gloo): every logged field of every step and of the
evaluation."""

from __future__ import annotations

import numpy as np
import pytest
from layout import assert_matches, run_train

from llamatron.data.indexed import IndexedDatasetWriter
from llamatron.data.sft import mask_prefix


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> str:
    """64 conversations written directly (token ids below llama-test's 256): a prompt, then a reply that repeats
    its last tokens reversed, the loss on the reply; of different lengths, so micro-batches hold different numbers
    of trained tokens."""
    prefix = str(tmp_path_factory.mktemp("sft") / "conv")
    tokens, mask = IndexedDatasetWriter(prefix, np.uint16), IndexedDatasetWriter(mask_prefix(prefix), np.uint8)
    rng = np.random.default_rng(0)
    for _ in range(64):
        prompt = rng.integers(3, 256, int(rng.integers(4, 14)))
        n = int(rng.integers(2, prompt.size + 1))
        tokens.add_document(np.concatenate([prompt, prompt[-n:][::-1]]))
        mask.add_document(np.r_[np.zeros(prompt.size), np.ones(n)].astype(np.uint8))
    tokens.finalize(), mask.finalize()
    return prefix


def sft(prefix: str, workdir) -> list[str]:
    return ["--sft-data", prefix, "--data-cache-path", str(workdir), "--lr", "1e-2"]


@pytest.fixture(scope="module")
def reference(conversations, tmp_path_factory) -> list[dict]:
    workdir = tmp_path_factory.mktemp("sft-single")
    return run_train(sft(conversations, workdir), 1, workdir, mock_data=False)


@pytest.mark.parametrize(
    "layout",
    [["--tp", "2", "--sequence-parallel"], ["--distributed-optimizer"]],
    ids=["tp2-sp", "dp2-distopt"],
)
def test_sft_layout_matches_single_process(layout, conversations, reference, tmp_path):
    got = run_train([*sft(conversations, tmp_path), *layout], 2, tmp_path, mock_data=False)
    assert reference.valid and got.valid  # the evaluation is compared too
    assert_matches(reference, got)
