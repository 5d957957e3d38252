"""The demo's corpus: this interpreter's standard library source, tokenized, needing no download.

``prepare_demo_data`` collects ``.py`` files of the standard library (no site-packages, no test suites, no very
large generated files), writes them as a jsonl corpus, trains a small byte-level BPE tokenizer on it and
preprocesses it into ``.bin/.idx``. A marker file written last records a finished build, so a second call returns
at once. (The demo run's settings and summary are the train command's: commands/demo.py.)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any

from .indexed import IndexedDataset
from .preprocess import output_prefix_for, preprocess
from .tokenizer import train_bpe_tokenizer

DEMO_DIR = "runs/demo"
DEMO_DATA_DIR = os.path.join(DEMO_DIR, "data")
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


def silent(message: str) -> None:
    """A `say` that says nothing (a library call, a test)."""


def on_console(message: str) -> None:
    """A `say` for the demo's run: the line now, before the run's own lines."""
    print(message, flush=True)


def prepare_demo_data(
    work_dir: str,
    vocab_size: int = 4096,
    max_bytes: int = DEFAULT_MAX_BYTES,
    workers: int = 1,
    say: Callable[[str], None] = silent,
) -> dict[str, Any]:
    """Build (or reuse) the demo corpus in ``work_dir``; ``say`` gets a line as each phase starts (the tokenizer's
    training and the tokenizing take a while on a small machine, with nothing else to show).

    Returns ``prefix`` (for ``--data``), ``tokenizer`` (a directory), ``jsonl``,
    and the counts ``files``, ``bytes``, ``documents``, ``tokens``, ``vocab_size``.
    """
    work_dir = os.path.abspath(os.fspath(work_dir))
    settings = {"vocab_size": vocab_size, "max_bytes": max_bytes, "python": sys.version.split()[0]}
    recorded = _completed_build(work_dir, settings)
    if recorded is not None:
        say(f"demo corpus: built before, in {work_dir}")
        return recorded
    began = time.monotonic()

    os.makedirs(work_dir, exist_ok=True)
    marker = os.path.join(work_dir, MARKER)
    if os.path.exists(marker):
        os.remove(marker)  # different settings: this build replaces the old one
    say(f"demo corpus: collecting up to {max_bytes / 2**20:.3g} MiB of the standard library's .py files")
    sources = stdlib_source_files(max_bytes)
    size = sum(len(text.encode("utf-8")) for _, text in sources)
    paths = _layout(work_dir)
    jsonl, tokenizer_dir, prefix = paths["jsonl"], paths["tokenizer"], paths["prefix"]
    with open(jsonl + ".tmp", "w", encoding="utf-8") as f:
        for _, text in sources:
            f.write(json.dumps({"text": text}) + "\n")
    os.replace(jsonl + ".tmp", jsonl)

    say(
        f"demo corpus: training a {vocab_size:,}-token byte-level BPE tokenizer on {len(sources):,} files "
        f"({size / 2**20:.1f} MiB)"
    )
    tokenizer = train_bpe_tokenizer((text for _, text in sources), vocab_size, tokenizer_dir)
    say(f"demo corpus: tokenizing the files into {prefix}.bin/.idx")
    summary = preprocess(jsonl, os.path.join(work_dir, "demo"), tokenizer_dir, workers=workers, progress=False)
    IndexedDataset(prefix)  # fail here, not in the trainer, if anything is off
    say(f"demo corpus: built in {time.monotonic() - began:.0f}s ({summary['tokens']:,} tokens)")

    result = {
        **paths,
        "files": len(sources),
        "bytes": size,
        "documents": summary["documents"],
        "tokens": summary["tokens"],
        "vocab_size": tokenizer.vocab_size,
        "settings": settings,
    }
    with open(marker + ".tmp", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    os.replace(marker + ".tmp", marker)
    return result
