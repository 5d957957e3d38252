"""The DPO demo's preference pairs, built from the demo corpus (demo_corpus.py) with no download.

Each pair is a prompt of `prompt` tokens from a standard-library source file, its real next `reply` tokens (chosen)
and the same tokens with `swaps` pairs of them swapped (rejected: a subtly corrupted continuation), written in
`preprocess --preference`'s layout with the loss on the reply. A marker file written last records a finished
build, so a second call returns at once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np

from .cache import file_signature
from .demo_corpus import silent
from .indexed import IndexedDataset, IndexedDatasetWriter, index_path
from .preference import preference_outputs

PAIRS_NAME = "demo_pref"


def prepare_demo_pairs(
    work_dir: str,
    corpus_prefix: str,
    count: int = 4000,
    prompt: int = 64,
    reply: int = 32,
    swaps: int = 2,
    seed: int = 0,
    say: Callable[[str], None] = silent,
) -> str:
    """Build (or reuse) the demo's pairs in `work_dir` from the token corpus `corpus_prefix`; returns the prefix
    for --preference-data. `say` gets a line before the build."""
    prefix = os.path.join(os.path.abspath(work_dir), PAIRS_NAME)
    marker = prefix + ".json"
    corpus_file = list(file_signature(index_path(corpus_prefix)))
    settings = {"count": count, "prompt": prompt, "reply": reply, "swaps": swaps, "seed": seed, "corpus": corpus_file}
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            if json.load(f) == settings:
                return prefix
        os.remove(marker)
    say(f"demo pairs: building {count:,} preference pairs ({prompt}-token prompts, {reply}-token replies) in {prefix}")
    corpus = IndexedDataset(corpus_prefix)
    long_enough = np.flatnonzero(corpus.sizes >= prompt + reply)
    rng = np.random.default_rng(seed)
    mask = np.r_[np.zeros(prompt), np.ones(reply)].astype(np.uint8)
    writers = [IndexedDatasetWriter(*out) for out in preference_outputs(prefix, corpus.dtype).values()]
    for _ in range(count):
        doc = int(rng.choice(long_enough))
        start = int(rng.integers(0, int(corpus.sizes[doc]) - prompt - reply + 1))
        tokens = corpus.get(doc, start, prompt + reply)
        corrupted = tokens.copy()
        for _ in range(swaps):  # two positions of the reply holding different tokens trade places
            i, j = prompt + rng.choice(reply, 2, replace=False)
            corrupted[i], corrupted[j] = corrupted[j], corrupted[i]
        for writer, array in zip(writers, (tokens, mask, corrupted, mask)):
            writer.add_document(array)
    for writer in writers:
        writer.finalize()
    with open(marker + ".tmp", "w", encoding="utf-8") as f:
        json.dump(settings, f)
    os.replace(marker + ".tmp", marker)
    return prefix


__all__ = ["PAIRS_NAME", "prepare_demo_pairs"]
