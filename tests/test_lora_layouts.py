"""LoRA under parallel layouts equals the single process (fp32, gloo): per-step loss and grad norm, with every
linear adapted. Tensor parallelism splits the adapters with their linear (tp 4 on 2 KV heads: replicated K/V rows
and their B rows); pipelines adapt each stage's layers; the distributed optimizer holds the adapters only."""

from __future__ import annotations

import pytest
from layout import assert_matches, run_train

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all-linear", "--lr", "1e-2"]
# name -> (flags, processes, model)
LAYOUTS = {
    "pp2-vpp2-dp2-distopt": (
        ["--pp", "2", "--vpp", "2", "--micro-batch-size", "1", "--distributed-optimizer"],
        4,
        "llama-test4",
    ),
    "tp2-sp-cp2": (["--tp", "2", "--sequence-parallel", "--cp", "2"], 4, "llama-test4"),
    "tp4": (["--tp", "4"], 4, "llama-test4"),
    "ep2": (["--ep", "2"], 2, "mixtral-test4"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache: dict[str, list[dict]] = {}

    def get(model: str) -> list[dict]:
        if model not in cache:
            cache[model] = run_train(LORA, 1, tmp_path_factory.mktemp(f"lora-{model}"), model=model)
        return cache[model]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_single_process(name, reference, tmp_path):
    flags, nproc, model = LAYOUTS[name]
    assert_matches(reference(model), run_train([*LORA, *flags], nproc, tmp_path, model=model))
