"""The demo: `llamatron train` with no data trains llama-tiny on a corpus that needs no download
(data/demo_corpus.py builds it); `llamatron train --objective dpo` with no data then aligns that model with DPO
on pairs built from the same corpus (the real continuation of a source file against the same continuation with
a few tokens swapped, data/demo_preference.py); `llamatron train --objective grpo` with no data trains a small
model from initialisation by GRPO alone to answer single-digit sums (data/demo_grpo.py).

The demos' own settings (`DEMO_DEFAULTS`, `DPO_DEMO_DEFAULTS`, where the user gave none), their checkpoint
directories (a new demo run saves beside the previous ones: runs/demo/checkpoint, then checkpoint-2, ...; nothing
saved is deleted, as a LoRA checkpoint or the DPO demo may start from it) and the summaries they print at the end
are here.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any

from ..checkpoint import step_dirs
from ..config.settings import RunConfig, set_setting
from ..data.demo_corpus import DEMO_DATA_DIR, DEMO_DIR, on_console, prepare_demo_data
from ..data.demo_grpo import GRPO_DEMO_DEFAULTS, GRPO_DEMO_DIR, GRPO_DEMO_MODEL_OVERRIDES, prepare_grpo_demo
from ..data.demo_preference import PAIRS_NAME, prepare_demo_pairs
from ..data.tokenizer import load_tokenizer
from ..inference.generate import load_for_generation, sample
from ..training.evaluation import format_metrics
from ..training.trainer import checkpoint_root

# The demo's settings where the user gave none: llama-tiny learns code in a few CPU minutes.
DEMO_DEFAULTS = {
    "seq_length": 256,
    "micro_batch_size": 8,
    "global_batch_size": 16,
    "train_steps": 200,
    "lr": 2e-3,
    "min_lr": 2e-4,
    "warmup_steps": 20,
    "eval_interval": 50,
    "eval_iters": 8,
    "save": os.path.join(DEMO_DIR, "checkpoint"),
}


# The DPO demo's: from the newest language-model demo checkpoint when there is one (else from initialisation), 8 pairs
# a step of a 64-token prompt and a 32-token reply; evaluated on 40 held-out pairs before training and every 25 steps.
DPO_DEMO_DEFAULTS = {
    "seq_length": 95,
    "micro_batch_size": 8,
    "global_batch_size": 16,
    "train_steps": 100,
    "lr": 1e-4,
    "min_lr": 1e-5,
    "warmup_steps": 10,
    "eval_interval": 25,
    "eval_iters": 5,
    "log_interval": 5,
    "save": os.path.join(DEMO_DIR, "dpo-checkpoint"),
}


def is_demo(cfg: RunConfig) -> bool:
    """No data of any kind given: the demo corpus; but DPO fine-tuning a --load model of the user's own needs its
    own pairs (validation says so), the demo's being of the demo's tokenizer."""
    d = cfg.data
    if cfg.objective.objective == "dpo" and cfg.train.load and cfg.train.finetune:
        return False
    given = d.data or d.mock_data or d.sft_data or d.preference_data or cfg.objective.prompts
    return not given


def _demo_defaults(cfg: RunConfig) -> dict[str, Any]:
    return {"dpo": DPO_DEMO_DEFAULTS, "grpo": GRPO_DEMO_DEFAULTS}.get(cfg.objective.objective, DEMO_DEFAULTS)


def apply_demo_defaults(cfg: RunConfig) -> None:
    for key, value in _demo_defaults(cfg).items():
        if key not in cfg.explicit:
            set_setting(cfg, key, value)
    if cfg.objective.objective == "dpo":
        _prepare_dpo_demo(cfg)
    if cfg.objective.objective == "grpo":
        _prepare_grpo_demo(cfg)
    if "save" not in cfg.explicit:
        cfg.train.save = _demo_save_dir(cfg)


def _demo_save_dir(cfg: RunConfig) -> str:
    """Where a demo run without --save saves: resuming (--load without --finetune), the run it resumes; else a
    directory of its own beside the previous demo runs' (the first run's runs/demo/checkpoint, a rerun's
    checkpoint-2, -3, ...), so that nothing saved is replaced."""
    t = cfg.train
    if "load" in cfg.explicit and t.load and not t.finetune:
        return checkpoint_root(t.load)
    return fresh_run_dir(str(t.save))


def _numbered_runs(base: str) -> list[tuple[int, str]]:
    """(n, path) of base (n 1) and base-N (n N) present on disk, by n."""
    parent, name = os.path.split(base)
    found = [(1, base)] if os.path.lexists(base) else []
    pattern = re.compile(re.escape(name) + r"-([0-9]+)")
    for entry in os.listdir(parent or ".") if os.path.isdir(parent or ".") else []:
        if (m := pattern.fullmatch(entry)) and int(m.group(1)) >= 2:
            found.append((int(m.group(1)), os.path.join(parent, entry)))
    return sorted(found)


def _holds_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "latest")) or bool(step_dirs(path))


def fresh_run_dir(base: str) -> str:
    """base, or base-N one past the highest present; the highest itself while it is a directory that holds no
    checkpoint (a run that stopped before its first save, or this run's rank 0 having made it: every rank of a
    run must pick the same)."""
    runs = _numbered_runs(base)
    if not runs:
        return base
    n, path = runs[-1]
    if os.path.isdir(path) and not os.path.islink(path) and not _holds_checkpoint(path):
        return path
    return f"{base}-{n + 1}"


def newest_run_checkpoint(base: str) -> str | None:
    """The highest-numbered of base, base-2, ... that holds a checkpoint (None without any)."""
    held = [path for _, path in _numbered_runs(base) if os.path.isfile(os.path.join(path, "latest"))]
    return held[-1] if held else None


def _prepare_dpo_demo(cfg: RunConfig) -> None:
    """The pairs (rank 0 builds them, the other ranks wait for them), and the newest language-model demo
    checkpoint as the start and reference when there is one."""
    if os.environ.get("RANK", "0") == "0":
        corpus = prepare_demo_data(DEMO_DATA_DIR, say=on_console)
        prefix = prepare_demo_pairs(DEMO_DATA_DIR, corpus["prefix"], say=on_console)
    else:
        prefix = os.path.join(os.path.abspath(DEMO_DATA_DIR), PAIRS_NAME)
        while not os.path.isfile(prefix + ".json"):
            time.sleep(1)
    cfg.data.preference_data = prefix
    cfg.data.tokenizer = os.path.abspath(os.path.join(DEMO_DATA_DIR, "tokenizer"))
    if cfg.train.load or "load" in cfg.explicit:
        return
    base = str(DEMO_DEFAULTS["save"])
    start = newest_run_checkpoint(base)
    if start is not None:
        cfg.train.load, cfg.train.finetune = start, True
    elif os.environ.get("RANK", "0") == "0":
        print(f"no language-model demo checkpoint in {base} (run `llamatron train` first): DPO from initialisation")


def _prepare_grpo_demo(cfg: RunConfig) -> None:
    """The task's tokenizer and prompts (every rank writes the same bytes), and the model's vocabulary cut to the
    task's unless the user chose a model."""
    if "model" not in cfg.explicit and not cfg.model_overrides:
        cfg.model_overrides = dict(GRPO_DEMO_MODEL_OVERRIDES)
    task = prepare_grpo_demo()
    cfg.objective.prompts, cfg.data.tokenizer = task["prompts"], task["tokenizer"]


def print_grpo_demo_summary(checkpoint: str) -> None:
    """The saved policy's greedy answers to every sum of the task: the share right."""
    model, _ = load_for_generation(checkpoint)
    tok = load_tokenizer(os.path.join(GRPO_DEMO_DIR, "tokenizer"))
    right = [(a + b, tok.decode(sample(model, tok.encode(f"{a}+{b}="), 1, temperature=0)))
             for a in range(10) for b in range(10 - a)]  # fmt: skip
    share = sum(str(s) == answer for s, answer in right) / len(right)
    print(f"greedy answers right: {share:.0%} of the {len(right)} sums (1 in 16 by chance)\ncheckpoint: {checkpoint}")


def demo_start_note(cfg: RunConfig) -> Callable[[], None]:
    """The line a demo run prints once its settings are checked: where it saves when earlier demo runs are
    kept beside it, and which checkpoint the DPO demo starts from."""
    base = str(_demo_defaults(cfg)["save"])
    save, load = str(cfg.train.save), cfg.train.load

    def note() -> None:
        if os.environ.get("RANK", "0") != "0":
            return
        if "save" not in cfg.explicit and save != base and "load" not in cfg.explicit:
            print(f"this demo run saves to {save}; the earlier demo runs' checkpoints are kept", flush=True)
        if cfg.objective.objective == "dpo" and load and "load" not in cfg.explicit:
            print(f"DPO from the language-model demo's checkpoint {load}", flush=True)

    return note


def validation_summary(valid: list[dict[str, Any]]) -> str | None:
    """The validation loss from the first evaluation record to the last (None without any)."""
    if not valid:
        return None
    first, last = valid[0], valid[-1]
    if len(valid) == 1:  # e.g. stopped before the second evaluation: no progress to show
        return f"validation loss {first['loss']:.3f} at step {first['step']}, the only evaluation of this run"
    metrics = {k: v for k, v in last.items() if k not in ("step", "split", "consumed_samples")}
    return (
        f"validation loss {first['loss']:.3f} at step {first['step']} -> {last['loss']:.3f} at step "
        f"{last['step']} ({format_metrics(metrics)})"
    )


def print_dpo_demo_summary(valid: list[dict[str, Any]], checkpoint: str) -> None:
    """Reward accuracy and margin on the held-out pairs, from the evaluation before training to the last, and the
    language-model loss on them, which DPO may well raise (said, so that it is not taken for a fault)."""
    if not valid:  # e.g. --split 100,0,0: no held-out pairs
        print(f"no held-out pairs were evaluated (no validation split)\ncheckpoint: {checkpoint}")
        return
    first, last = valid[0], valid[-1]
    rose = (
        ", a rise DPO is expected to give: it lowers the corrupted continuations' probability (half of these "
        "responses) and need not raise the real ones'"
        if last["loss"] > first["loss"]
        else ""
    )
    print(
        f"held-out pairs: reward accuracy {first['rewards_accuracy']:.2f} at step {first['step']} -> "
        f"{last['rewards_accuracy']:.2f} at step {last['step']} (the share of pairs where the real continuation "
        f"gained more than the corrupted one), reward margin {first['rewards_margin']:.3f} -> "
        f"{last['rewards_margin']:.3f}, DPO loss {first['dpo_loss']:.3f} -> {last['dpo_loss']:.3f}\n"
        f"language-model loss on their responses {first['loss']:.3f} -> {last['loss']:.3f}{rose}\n"
        f"checkpoint: {checkpoint}"
    )


def print_demo_summary(valid: list[dict[str, Any]], checkpoint: str) -> None:
    """The validation loss from the first evaluation to the last, and a sample from the saved checkpoint."""
    summary = validation_summary(valid)
    if summary:
        print(summary)
    model, _ = load_for_generation(checkpoint)
    tok = load_tokenizer(os.path.join(DEMO_DATA_DIR, "tokenizer"))
    ids = sample(model, tok.encode("def "), max_new_tokens=80, temperature=0.7, seed=0)
    print(
        f"checkpoint: {checkpoint}\nsample (prompt 'def '):\n" + "-" * 40 + "\ndef " + tok.decode(ids) + "\n" + "-" * 40
    )
