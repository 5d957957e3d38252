"""GRPO under parallel layouts equals the single process (fp32, gloo) on every logged field but speed: the
rollouts (each row's sampling noise keyed by its place in the batch, not by the rank: training/rollouts.py), their
rewards and advantages, the loss, grad norm, clip shares and KL. Each layout decodes on its own training weights:
tensor-parallel ranks on their shards, data-parallel ranks their share of the prompts."""

from __future__ import annotations

import json

import pytest
from layout import assert_matches, run_train

from llamatron.data.tokenizer import train_bpe_tokenizer

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all-linear"]
SPEED = ("rollout_tokens_per_sec", "train_tokens_per_sec")

LORA_BETA = [*LORA, "--beta", "0.05"]

# name -> (flags, processes, model, the single process's flags)
LAYOUTS = {
    "dp2-distopt": (["--distributed-optimizer"], 2, "llama-test", []),
    "tp2": (["--tp", "2"], 2, "llama-test", []),
    "lora-beta-dp2": (LORA_BETA, 2, "llama-test", LORA_BETA),
    # a mixture of experts (no expert parallelism): its router losses ride along, its statistics are logged
    "moe-dp2": ([], 2, "mixtral-test", []),
}


@pytest.fixture(scope="module")
def grpo(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("grpo-task")
    train_bpe_tokenizer(["1+2=3 4+5=9 the answer is 7\n" * 40], 300, str(root / "tok"))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(8)))
    return [
        "--objective", "grpo", "--prompts", str(prompts), "--tokenizer", str(root / "tok"),
        "--model-override", "vocab_size=512", "--reward", "exact_answer", "regex:[0-9]", "--reward-weights", "1", "0.5",
        "--num-generations", "4", "--max-completion-length", "6", "--seq-length", "24", "--num-iterations", "2",
        "--temperature", "0.9", "--lr", "1e-2", "--train-steps", "4", "--eval-interval", "0",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(grpo, tmp_path_factory):
    cache: dict[tuple, list[dict]] = {}

    def get(model: str, flags: list[str]) -> list[dict]:
        key = (model, *flags)
        if key not in cache:
            d = tmp_path_factory.mktemp("grpo-single")
            cache[key] = run_train([*grpo, *flags], 1, d, model=model, mock_data=False)
        return cache[key]

    return get


def _without_speed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in SPEED} for r in records]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grpo_layout_matches_single_process(name, grpo, reference, tmp_path):
    flags, nproc, model, single_flags = LAYOUTS[name]
    got = run_train([*grpo, *flags], nproc, tmp_path, model=model, mock_data=False)
    single = reference(model, single_flags)
    assert_matches(_without_speed(single), _without_speed(got))
    assert any(r["grad_norm"] > 0 for r in single) and any(r["clip_ratio/region_mean"] > 0 for r in single)
    if name.startswith("lora"):
        assert single[-1]["kl"] > 0  # the reference (adapters off) and the policy part
    if name.startswith("moe"):
        assert single[-1]["moe_aux_loss"] > 0 and len(single[-1]["expert_token_share"]) == 4
