"""Preprocessing throughput: `llamatron preprocess` on a deterministic jsonl corpus.

Generates SIZE MB of English-like jsonl (the same bytes on every machine for a
given --seed), trains a byte-level BPE tokenizer on a slice of it (not timed),
then runs `llamatron preprocess --workers N` as a child process and measures
its wall time and the peak memory of the whole process tree (the command and
its tokenizer workers, sampled every 50 ms): PSS summed over the processes
(shared pages split between the processes that map them) and RSS summed (an
upper bound: pages shared by the forked workers count once per process).

    python benchmarks/preprocess_bench.py --size-mb 100 --workers 2

Target (issue 8): 100 MB with --workers 2 on the 2-core machine in at most
120 s, peak memory under 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "su",
    "ta",
    "ri",
    "on",
    "el",
    "an",
    "th",
    "er",
    "in",
    "qu",
    "st",
    "ar",
    "ou",
    "ch",
    "be",
    "de",
    "ma",
    "pre",
    "con",
    "ing",
    "ed",
    "ly",
    "tion",
    "al",
    "re",
    "ex",
]
PUNCTUATION = np.array([". ", ". ", ". ", "? ", "! ", "; ", ", "])


def make_lexicon(rng: np.random.RandomState, size: int) -> np.ndarray:
    """`size` distinct pseudo-words of 1-4 syllables; rank 0 is the most frequent."""
    words: dict[str, None] = {}
    while len(words) < size:
        count = rng.randint(1, 5)
        words["".join(SYLLABLES[i] for i in rng.randint(0, len(SYLLABLES), count))] = None
    return np.array(list(words), dtype=object)


def generate_corpus(path: str, size_mb: float, seed: int = 0) -> tuple[int, int]:
    """Write documents of Zipf-distributed words until the file holds size_mb MB; return (docs, bytes)."""
    rng = np.random.RandomState(seed)
    lexicon = make_lexicon(rng, 30_000)
    target = int(size_mb * 1e6)
    written = docs = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            num_words = int(min(rng.lognormal(6.0, 0.8), 20_000)) + 5  # ~500 words on average
            ranks = np.minimum(rng.zipf(1.2, num_words) - 1, len(lexicon) - 1)
            words = lexicon[ranks]
            # Sentences of 5-25 words, capitalised, with punctuation; paragraphs now and then.
            pieces, start = [], 0
            while start < num_words:
                end = min(num_words, start + rng.randint(5, 26))
                sentence = " ".join(words[start:end])
                pieces.append(sentence[:1].upper() + sentence[1:] + PUNCTUATION[rng.randint(len(PUNCTUATION))])
                if rng.rand() < 0.15:
                    pieces.append("\n\n")
                start = end
            line = json.dumps({"id": docs, "text": "".join(pieces).strip()}) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            docs += 1
    return docs, written


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _memory_bytes(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process; PSS shares each page among the processes mapping it."""
    values = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values.get("Rss", 0), values.get("Pss", 0)


def tree_memory(root: int) -> tuple[int, int]:
    """(RSS, PSS) of a process and all its descendants, summed."""
    rss = pss = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        r, p = _memory_bytes(pid)
        rss, pss = rss + r, pss + p
        stack.extend(_children(pid))
    return rss, pss


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, int, int, int]:
    """Run cmd; return (wall seconds, peak tree RSS, peak tree PSS, exit code)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        rss, pss = tree_memory(proc.pid)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.05)
    return time.perf_counter() - start, peak_rss, peak_pss, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=100.0, help="corpus size in MB (10^6 bytes)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=32000, help="byte-level BPE vocabulary size")
    parser.add_argument(
        "--tokenizer-train-mb", type=float, default=8.0, help="MB of the corpus the tokenizer learns from"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None, help="keep the corpus and outputs here (default: a temporary dir)")
    args = parser.parse_args()

    from llamatron.data.tokenizer import train_bpe_tokenizer

    work_dir = args.work_dir or tempfile.mkdtemp(prefix="preprocess_bench_")
    os.makedirs(work_dir, exist_ok=True)
    corpus = os.path.join(work_dir, f"corpus_{args.size_mb:g}mb_seed{args.seed}.jsonl")
    if not os.path.isfile(corpus):
        t = time.perf_counter()
        docs, size = generate_corpus(corpus + ".tmp", args.size_mb, args.seed)
        os.replace(corpus + ".tmp", corpus)
        seconds = time.perf_counter() - t
        print(f"generated {corpus}: {docs} documents, {size / 1e6:.1f} MB in {seconds:.1f}s", flush=True)
    tokenizer_dir = os.path.join(work_dir, f"tokenizer_{args.vocab_size}")
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        t = time.perf_counter()
        budget, texts = int(args.tokenizer_train_mb * 1e6), []
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                texts.append(json.loads(line)["text"])
                budget -= len(line)
                if budget <= 0:
                    break
        train_bpe_tokenizer(texts, args.vocab_size, tokenizer_dir)
        print(f"trained a {args.vocab_size}-token byte-level BPE in {time.perf_counter() - t:.1f}s", flush=True)

    prefix = os.path.join(work_dir, "out")
    cmd = [
        sys.executable,
        "-m",
        "llamatron",
        "preprocess",
        "--input",
        corpus,
        "--output-prefix",
        prefix,
        "--tokenizer",
        tokenizer_dir,
        "--workers",
        str(args.workers),
    ]
    print("running:", " ".join(cmd), flush=True)
    wall, peak_rss, peak_pss, code = run_measured(cmd, dict(os.environ))
    if code != 0:
        sys.exit(f"preprocess failed with exit code {code}")
    size_mb = os.path.getsize(corpus) / 1e6
    tokens = os.path.getsize(prefix + "_text_document.bin") // 2
    ok = wall <= 120 and peak_rss < 2**30
    print(
        f"RESULT preprocess: {size_mb:.1f} MB jsonl, {args.workers} workers, vocab {args.vocab_size}: "
        f"{wall:.1f} s wall ({size_mb / wall:.2f} MB/s, {tokens / wall / 1e6:.2f} M tokens/s), {tokens} tokens; "
        f"peak memory of the process tree: {peak_pss / 2**20:.0f} MiB PSS, {peak_rss / 2**20:.0f} MiB RSS summed "
        f"(counts shared pages once per process); targets: <= 120 s, < 1024 MiB -> {'PASS' if ok else 'FAIL'}"
    )
    if args.work_dir is None:
        shutil.rmtree(work_dir)


if __name__ == "__main__":
    main()
