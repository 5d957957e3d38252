"""Build the real-data corpora of the document-mask benchmarks (RESULTS.md run 8) from this interpreter's
standard library source, the demo's corpus (llamatron/data/demo_corpus.py):

- `files`: one document per source file (long documents: thousands of tokens);
- `defs`: each file cut before every top-level `def`/`class`/decorator (short documents, hundreds of tokens).

usage: python benchmarks/doc_corpus.py OUT_DIR [MAX_MB]   (prints each corpus's --data prefix and its
document-length statistics as JSON; --tokenizer is OUT_DIR/tokenizer)
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

from llamatron.data.demo_corpus import stdlib_source_files
from llamatron.data.indexed import IndexedDataset
from llamatron.data.preprocess import preprocess
from llamatron.data.tokenizer import train_bpe_tokenizer

_TOP_LEVEL = re.compile(r"^(?=def |class |async def |@)", re.MULTILINE)


def split_definitions(text: str) -> list[str]:
    return [part for part in _TOP_LEVEL.split(text) if part.strip()]


def main(out_dir: str, max_mb: float = 16.0) -> None:
    os.makedirs(out_dir, exist_ok=True)
    files = [text for _, text in stdlib_source_files(int(max_mb * 2**20))]
    tokenizer = os.path.join(out_dir, "tokenizer")
    train_bpe_tokenizer(files, vocab_size=8192, out_dir=tokenizer)
    corpora = {"files": files, "defs": [part for text in files for part in split_definitions(text)]}
    for name, docs in corpora.items():
        jsonl = os.path.join(out_dir, f"{name}.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        prefix = preprocess(jsonl, os.path.join(out_dir, name), tokenizer, progress=False)["outputs"]["text"]
        os.remove(jsonl)
        lengths = np.asarray(IndexedDataset(prefix).sizes)
        stats = {"mean": float(lengths.mean()), "median": float(np.median(lengths)), "documents": len(lengths)}
        print(
            json.dumps({"corpus": name, "data": prefix, "tokenizer": tokenizer, "tokens": int(lengths.sum()), **stats})
        )


if __name__ == "__main__":
    main(sys.argv[1], *(float(a) for a in sys.argv[2:3]))
