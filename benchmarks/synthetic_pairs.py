"""Write synthetic preference pairs in `preprocess --preference`'s layout (for DPO speed runs without a download).

Each pair: a prompt of random tokens; chosen repeats the prompt's last tokens in reverse (learnable from the
prompt), rejected is random. Usage: python3 benchmarks/synthetic_pairs.py OUT_PREFIX --pairs N --vocab V --length L
"""

from __future__ import annotations

import argparse

import numpy as np

from llamatron.data.indexed import IndexedDatasetWriter
from llamatron.data.preference import preference_outputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prefix")
    p.add_argument("--pairs", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--length", type=int, default=1024, help="tokens of prompt + reply")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    writers = {name: IndexedDatasetWriter(*out) for name, out in preference_outputs(args.prefix, np.int32).items()}
    reply = args.length // 4
    mask = np.r_[np.zeros(args.length - reply), np.ones(reply)].astype(np.uint8)
    for _ in range(args.pairs):
        prompt = rng.integers(3, args.vocab, args.length - reply)
        for response, tokens in (("chosen", prompt[-reply:][::-1]), ("rejected", rng.integers(3, args.vocab, reply))):
            writers[response].add_document(np.concatenate([prompt, tokens]))
            writers[response + "_mask"].add_document(mask)
    for writer in writers.values():
        writer.finalize()
    print(f"{args.pairs} pairs of {args.length} tokens: --preference-data {args.prefix}")


if __name__ == "__main__":
    main()
