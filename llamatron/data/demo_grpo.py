"""The GRPO demo's task, with no download: single-digit sums ("3+4=", answer 7; the 55 with a sum below 10), on a
tokenizer of one token per character (the digits, "+", "=", a space and <|endoftext|>). The answer is verifiable
(the built-in exact_answer reward) and a small model learns it by reinforcement alone, from initialisation: a
one-token completion drawn among 16, right at first about 1 time in 12.

Built into runs/demo/data/grpo/ (the tokenizer directory and prompts.jsonl), again on every call: it takes
milliseconds.
"""

from __future__ import annotations

import json
import os
from typing import Any

import tokenizers

from .demo_corpus import DEMO_DATA_DIR
from .tokenizer import EOD_TOKEN, Tokenizer

GRPO_DEMO_DIR = os.path.join(DEMO_DATA_DIR, "grpo")

# The demo's settings where the user gave none; model_overrides: llama-test's vocabulary cut to the task's.
GRPO_DEMO_DEFAULTS: dict[str, Any] = {
    "model": "llama-test",
    "reward": ["exact_answer"],
    "num_generations": 8,
    "max_completion_length": 1,
    "seq_length": 5,
    "micro_batch_size": 128,
    "global_batch_size": 128,
    "train_steps": 150,
    "lr": 2e-3,
    "min_lr": 2e-3,
    "warmup_steps": 0,
    "log_interval": 10,
    "eval_interval": 0,
    "save": os.path.join("runs", "demo", "grpo-checkpoint"),
}
GRPO_DEMO_MODEL_OVERRIDES = {"vocab_size": 16}


def prepare_grpo_demo(work_dir: str = GRPO_DEMO_DIR) -> dict[str, str]:
    """Write the task's tokenizer and prompts into `work_dir`; returns their paths (absolute)."""
    os.makedirs(work_dir, exist_ok=True)
    vocab = {EOD_TOKEN: 0, **{str(d): d + 1 for d in range(10)}, "+": 11, "=": 12, " ": 13}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=EOD_TOKEN))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens([EOD_TOKEN])
    tokenizer_dir = os.path.abspath(os.path.join(work_dir, "tokenizer"))
    Tokenizer(backend, "huggingface", tokenizer_dir, config=None).save(tokenizer_dir)
    prompts = os.path.abspath(os.path.join(work_dir, "prompts.jsonl"))
    with open(prompts, "w", encoding="utf-8") as f:
        for a in range(10):
            for b in range(10 - a):
                f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return {"prompts": prompts, "tokenizer": tokenizer_dir}
