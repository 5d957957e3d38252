"""The demo: `llamatron train` with no data trains llama-tiny on a corpus that needs no download
(data/demo_corpus.py builds it); `llamatron train --objective dpo` with no data then aligns that model with DPO
on pairs built from the same corpus (the real continuation of a source file against the same continuation with
a few tokens swapped, data/demo_preference.py).

The demos' own settings (`DEMO_DEFAULTS`, `DPO_DEMO_DEFAULTS`, where the user gave none), their checkpoint
directories (a new demo run replaces the previous one's) and the summaries they print at the end are here.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from ..config.settings import RunConfig, section_of
from ..data.demo_corpus import DEMO_DATA_DIR, DEMO_DIR, on_console, prepare_demo_data
from ..data.demo_preference import PAIRS_NAME, prepare_demo_pairs
from ..data.tokenizer import load_tokenizer
from ..inference.generate import load_for_generation, sample
from ..training.evaluation import format_metrics

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


# The DPO demo's: from the language-model demo's checkpoint when there is one (else from initialisation), 8 pairs
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
    """No data of any kind given: the demo corpus."""
    d = cfg.data
    return d.data is None and not d.mock_data and d.sft_data is None and d.preference_data is None


def apply_demo_defaults(cfg: RunConfig) -> None:
    dpo = cfg.objective.objective == "dpo"
    for key, value in (DPO_DEMO_DEFAULTS if dpo else DEMO_DEFAULTS).items():
        if key not in cfg.explicit:
            setattr(getattr(cfg, section_of(key)), key, value)
    if dpo:
        _prepare_dpo_demo(cfg)


def _prepare_dpo_demo(cfg: RunConfig) -> None:
    """The pairs (rank 0 builds them, the other ranks wait for them), and the language-model demo's checkpoint as
    the start and reference when it exists."""
    if os.environ.get("RANK", "0") == "0":
        corpus = prepare_demo_data(DEMO_DATA_DIR, say=on_console)
        prefix = prepare_demo_pairs(DEMO_DATA_DIR, corpus["prefix"], say=on_console)
    else:
        prefix = os.path.join(os.path.abspath(DEMO_DATA_DIR), PAIRS_NAME)
        while not os.path.isfile(prefix + ".json"):
            time.sleep(1)
    cfg.data.preference_data = prefix
    cfg.data.tokenizer = os.path.abspath(os.path.join(DEMO_DATA_DIR, "tokenizer"))
    start = os.path.join(DEMO_DIR, "checkpoint")
    if cfg.train.load or "load" in cfg.explicit:
        return
    if os.path.isfile(os.path.join(start, "latest")):
        cfg.train.load, cfg.train.finetune = start, True
    elif os.environ.get("RANK", "0") == "0":
        print(f"no language-model demo checkpoint in {start} (run `llamatron train` first): DPO from initialisation")


def previous_demo_replacer(cfg: RunConfig) -> Callable[[], None] | None:
    """The demo's own checkpoint directory (no --save given) holds the previous demo run, which a new run replaces
    (where a run saving into another run's directory is refused: train.check_save_dir): the step that clears it,
    for run_training to take once the run's settings are checked, so that a refused run leaves it (the DPO demo
    starts from it). None for a run with its own --save or --load."""
    if "save" in cfg.explicit or "load" in cfg.explicit:
        return None
    save = str(cfg.train.save)  # apply_demo_defaults set it

    def clear() -> None:
        if os.environ.get("RANK", "0") == "0" and os.path.isdir(save) and os.listdir(save):
            print(f"replacing the previous demo run's checkpoints in {save}", flush=True)
            shutil.rmtree(save)

    return clear


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
    """Reward accuracy and margin on the held-out pairs, from the evaluation before training to the last."""
    first, last = valid[0], valid[-1]
    print(
        f"held-out pairs: reward accuracy {first['rewards_accuracy']:.2f} at step {first['step']} -> "
        f"{last['rewards_accuracy']:.2f} at step {last['step']} (the share of pairs where the real continuation "
        f"gained more than the corrupted one), reward margin {first['rewards_margin']:.3f} -> "
        f"{last['rewards_margin']:.3f}, DPO loss {first['dpo_loss']:.3f} -> {last['dpo_loss']:.3f}\n"
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
