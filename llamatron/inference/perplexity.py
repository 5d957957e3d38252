"""Token-level loss and perplexity of a model on a `.bin/.idx` set (data/indexed.py).

The documents are read in order and joined into one stream, as pre-training samples are (data/samples.py,
without the shuffle), and cut into windows of seq_length + 1 tokens that share one token with the next: every
token but the first is predicted once, with the window's earlier tokens as its context. Windows go through the
model batch_size at a time; the last, shorter one is padded and its padding predicts nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..data.indexed import IndexedDataset
from ..errors import DataError
from ..models import IGNORE_INDEX, Transformer


def token_windows(dataset: IndexedDataset, seq_length: int, documents: int | None = None) -> Iterator[np.ndarray]:
    """Windows of seq_length + 1 tokens of the first `documents` documents (all by default) joined in order; the
    last may be shorter (at least 2 tokens)."""
    count = len(dataset) if documents is None else min(documents, len(dataset))
    window: list[np.ndarray] = []
    held = 0
    for doc in range(count):
        tokens = dataset.get(doc)
        while tokens.size:
            take = min(seq_length + 1 - held, tokens.size)
            window.append(tokens[:take])
            held, tokens = held + take, tokens[take:]
            if held == seq_length + 1:
                full = np.concatenate(window)
                yield full
                window, held = [full[-1:]], 1  # the next window starts with this one's last token
    if held > 1:
        yield np.concatenate(window)


@torch.no_grad()
def perplexity(
    model: Transformer, dataset: IndexedDataset, seq_length: int, batch_size: int, documents: int | None = None
) -> dict[str, float]:
    """loss (mean cross entropy per predicted token, nats), perplexity (its exp), tokens (predicted), windows."""
    device = next(model.parameters()).device
    vocab = model.cfg.vocab_size
    loss_sum, tokens, windows = 0.0, 0, 0
    batch: list[np.ndarray] = []

    def run(batch: list[np.ndarray]) -> None:
        nonlocal loss_sum, tokens, windows
        longest = max(w.size for w in batch)
        ids = torch.zeros(len(batch), longest - 1, dtype=torch.long)
        labels = torch.full((len(batch), longest - 1), IGNORE_INDEX, dtype=torch.long)
        for row, w in enumerate(batch):
            t = torch.from_numpy(w.astype(np.int64))
            ids[row, : w.size - 1], labels[row, : w.size - 1] = t[:-1], t[1:]
        logits = model(ids.to(device)).float()
        loss = F.cross_entropy(
            logits.flatten(0, 1), labels.to(device).flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        loss_sum += float(loss)
        tokens += int((labels != IGNORE_INDEX).sum())
        windows += len(batch)

    for w in token_windows(dataset, seq_length, documents):
        if int(w.max()) >= vocab:
            raise DataError(
                f"{dataset.prefix}: token id {int(w.max())} is outside the model's vocabulary of {vocab}; "
                "evaluate data tokenized with this model's tokenizer"
            )
        batch.append(w)
        if len(batch) == batch_size:
            run(batch)
            batch = []
    if batch:
        run(batch)
    if not tokens:
        raise DataError(f"{dataset.prefix}: no token to predict (the set holds fewer than 2 tokens)")
    loss = loss_sum / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens, "windows": windows}
