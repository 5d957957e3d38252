"""The demo: `llamatron train` with no data trains llama-tiny on a corpus that needs no download.

The corpus is this interpreter's standard library source. ``prepare_demo_data`` collects ``.py`` files of the
standard library (no site-packages, no test suites, no very large generated files), writes them as a jsonl
corpus, trains a small byte-level BPE tokenizer on it and preprocesses it into ``.bin/.idx``. A marker file
written last records a finished build, so a second call returns at once.

The demo's own settings (`DEMO_DEFAULTS`, where the user gave none), its checkpoint directory (a new demo run
replaces the previous one's) and the summary it prints at the end are here too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from typing import Any

from .config import RunConfig, section_of
from .data.indexed import IndexedDataset
from .data.preprocess import output_prefix_for, preprocess
from .data.tokenizer import load_tokenizer, train_bpe_tokenizer
from .evaluation import format_metrics
from .generate import load_for_generation, sample

DEMO_DIR = "runs/demo"
DEMO_DATA_DIR = os.path.join(DEMO_DIR, "data")
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

DEFAULT_MAX_BYTES = 8 << 20
MAX_FILE_BYTES = 200_000  # larger stdlib files are generated tables, not code worth learning
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
MARKER = "demo_data.json"


def stdlib_source_files(max_bytes: int) -> list[tuple[str, str]]:
    """(relative path, text) of standard library sources, up to ``max_bytes`` in all.

    Files are taken in the order of a hash of their path: deterministic, yet a
    small budget still gets a mix of the library rather than its first
    packages alphabetically.
    """
    root = sysconfig.get_paths()["stdlib"]
    candidates = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in EXCLUDED_DIRS and not d.startswith("test"))
        for name in files:
            path = os.path.join(directory, name)
            if name.endswith(".py") and not name.startswith("test_") and os.path.getsize(path) <= MAX_FILE_BYTES:
                relative = os.path.relpath(path, root).replace(os.sep, "/")
                candidates.append((hashlib.sha1(relative.encode()).hexdigest(), relative, path))
    chosen, total = [], 0
    for _, relative, path in sorted(candidates):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        size = len(text.encode("utf-8"))
        if not text.strip() or total + size > max_bytes:
            continue
        chosen.append((relative, text))
        total += size
    if not chosen:
        raise RuntimeError(f"no standard library sources found under {root} (max_bytes={max_bytes})")
    return chosen


def _layout(work_dir: str) -> dict[str, str]:
    return {
        "prefix": output_prefix_for(os.path.join(work_dir, "demo"), "text"),
        "tokenizer": os.path.join(work_dir, "tokenizer"),
        "jsonl": os.path.join(work_dir, "demo_corpus.jsonl"),
    }


def _completed_build(work_dir: str, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The result of an earlier build with the same settings, if it is complete."""
    marker = os.path.join(work_dir, MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding="utf-8") as f:
        recorded = json.load(f)
    if recorded.get("settings") != settings:
        return None
    paths = _layout(work_dir)  # not the recorded paths: the directory may have moved
    needed = [paths["prefix"] + ".bin", paths["prefix"] + ".idx", os.path.join(paths["tokenizer"], "tokenizer.json")]
    return {**recorded, **paths} if all(os.path.isfile(p) for p in needed) else None


def prepare_demo_data(
    work_dir: str, vocab_size: int = 4096, max_bytes: int = DEFAULT_MAX_BYTES, workers: int = 1
) -> dict[str, Any]:
    """Build (or reuse) the demo corpus in ``work_dir``.

    Returns ``prefix`` (for ``--data``), ``tokenizer`` (a directory), ``jsonl``,
    and the counts ``files``, ``bytes``, ``documents``, ``tokens``, ``vocab_size``.
    """
    work_dir = os.path.abspath(os.fspath(work_dir))
    settings = {"vocab_size": vocab_size, "max_bytes": max_bytes, "python": sys.version.split()[0]}
    recorded = _completed_build(work_dir, settings)
    if recorded is not None:
        return recorded

    os.makedirs(work_dir, exist_ok=True)
    marker = os.path.join(work_dir, MARKER)
    if os.path.exists(marker):
        os.remove(marker)  # different settings: this build replaces the old one
    sources = stdlib_source_files(max_bytes)
    paths = _layout(work_dir)
    jsonl, tokenizer_dir, prefix = paths["jsonl"], paths["tokenizer"], paths["prefix"]
    with open(jsonl + ".tmp", "w", encoding="utf-8") as f:
        for _, text in sources:
            f.write(json.dumps({"text": text}) + "\n")
    os.replace(jsonl + ".tmp", jsonl)

    tokenizer = train_bpe_tokenizer((text for _, text in sources), vocab_size, tokenizer_dir)
    summary = preprocess(jsonl, os.path.join(work_dir, "demo"), tokenizer_dir, workers=workers, progress=False)
    IndexedDataset(prefix)  # fail here, not in the trainer, if anything is off

    result = {
        **paths,
        "files": len(sources),
        "bytes": sum(len(text.encode("utf-8")) for _, text in sources),
        "documents": summary["documents"],
        "tokens": summary["tokens"],
        "vocab_size": tokenizer.vocab_size,
        "settings": settings,
    }
    with open(marker + ".tmp", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    os.replace(marker + ".tmp", marker)
    return result


def is_demo(cfg: RunConfig) -> bool:
    """No data of any kind given: the demo corpus."""
    return cfg.data.data is None and not cfg.data.mock_data and cfg.data.sft_data is None


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
