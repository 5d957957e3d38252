"""The demo: `llamatron train` with no data trains llama-tiny on a corpus that needs no download
(data/demo_corpus.py builds it).

The demo's own settings (`DEMO_DEFAULTS`, where the user gave none), its checkpoint directory (a new demo run
replaces the previous one's) and the summary it prints at the end are here.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from ..config.settings import RunConfig, section_of
from ..data.demo_corpus import DEMO_DATA_DIR, DEMO_DIR
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


def is_demo(cfg: RunConfig) -> bool:
    """No data of any kind given: the demo corpus."""
    d = cfg.data
    return d.data is None and not d.mock_data and d.sft_data is None and d.preference_data is None


def apply_demo_defaults(cfg: RunConfig) -> None:
    for key, value in DEMO_DEFAULTS.items():
        if key not in cfg.explicit:
            setattr(getattr(cfg, section_of(key)), key, value)


def clear_previous_demo_checkpoint(cfg: RunConfig) -> bool:
    """The demo's own checkpoint directory (no --save given) holds the previous demo run: a new run replaces it,
    where a run saving into another run's directory is refused (train.check_save_dir)."""
    if "save" in cfg.explicit or cfg.train.load:
        return False
    save = str(cfg.train.save)  # apply_demo_defaults set it
    if os.environ.get("RANK", "0") == "0" and os.path.isdir(save) and os.listdir(save):
        print(f"replacing the previous demo run's checkpoints in {save}", flush=True)
        shutil.rmtree(save)
    return True


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
