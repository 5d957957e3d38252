"""Loss curves of runs' metrics files side by side (training loss, and validation loss at each evaluation) as a
PNG, and each run's final validation loss relative to the first run's.

usage: python benchmarks/plot_loss.py OUT.png LABEL=METRICS.jsonl [LABEL=METRICS.jsonl ...]   (needs matplotlib)
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    train, valid = [], []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("loss") is None:
                continue
            (valid if record.get("split") == "valid" else train).append((record["step"], record["loss"]))
    return train, valid


def main(out: str, runs: list[str]) -> None:
    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(12, 4.5))
    finals = {}
    for run in runs:
        label, path = run.split("=", 1)
        train, valid = read(path)
        ax_train.plot(*zip(*train), label=label, linewidth=1)
        ax_valid.plot(*zip(*valid), label=label, marker=".", linewidth=1)
        finals[label] = valid[-1][1]
    for ax, title in ((ax_train, "training loss"), (ax_valid, "validation loss")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    first = next(iter(finals.values()))
    for label, loss in finals.items():
        print(json.dumps({"run": label, "final_valid_loss": loss, "vs_first": loss / first - 1}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
