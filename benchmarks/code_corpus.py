"""A real-text corpus of ~tens of millions of tokens for loss-curve comparisons (FP8 against bf16: RESULTS.md):
the Python source of installed packages, one document per file, deduplicated, in sorted path order.

usage: python benchmarks/code_corpus.py OUT_DIR MAX_MB PACKAGE_DIR...
prints the --data prefix, the tokenizer directory and the token count as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from llamatron.data.indexed import IndexedDataset
from llamatron.data.preprocess import preprocess
from llamatron.data.tokenizer import train_bpe_tokenizer


def source_files(roots: list[str], max_bytes: int) -> list[str]:
    texts, seen, total = [], set(), 0
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            digest = hashlib.sha256(text.encode()).digest()
            if len(text) < 200 or digest in seen:
                continue
            seen.add(digest)
            texts.append(text)
            total += len(text)
            if total >= max_bytes:
                return texts
    return texts


def main(out_dir: str, max_mb: float, roots: list[str]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    docs = source_files(roots, int(max_mb * 2**20))
    tokenizer = os.path.join(out_dir, "tokenizer")
    train_bpe_tokenizer(docs[:: max(1, len(docs) // 2000)], vocab_size=8192, out_dir=tokenizer)  # a sample suffices
    jsonl = os.path.join(out_dir, "code.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    prefix = preprocess(jsonl, os.path.join(out_dir, "code"), tokenizer, progress=False)["outputs"]["text"]
    os.remove(jsonl)
    lengths = np.asarray(IndexedDataset(prefix).sizes)
    print(json.dumps({"data": prefix, "tokenizer": tokenizer, "documents": len(lengths), "tokens": int(lengths.sum())}))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3:])
