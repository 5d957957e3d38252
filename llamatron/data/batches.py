"""The samples of one optimizer step, cut for this data-parallel rank into micro-batches.

Step k trains on global samples [k*G, (k+1)*G) (G = global batch size), so
what a step sees depends only on the global batch and `consumed_samples`,
never on the layout. Data-parallel rank r takes the r-th contiguous 1/dp of it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..models import IGNORE_INDEX


def micro_batches_for_step(dataset: Sequence, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                           dp: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    per_rank = global_batch_size // dp
    first = consumed_samples + dp_rank * per_rank
    out = []
    for start in range(first, first + per_rank, micro_batch_size):
        out.append(collate([dataset[(start + j) % len(dataset)] for j in range(micro_batch_size)]))
    return out


def collate(samples: list) -> dict[str, torch.Tensor]:
    """Samples of seq+1 tokens (optionally dicts with a loss mask) -> input_ids / labels."""
    if isinstance(samples[0], dict):
        tokens = torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64))
        mask = torch.from_numpy(np.stack([s["loss_mask"] for s in samples]).astype(bool))
    else:
        tokens = torch.from_numpy(np.stack(samples).astype(np.int64))
        mask = None
    labels = tokens[:, 1:].clone()
    if mask is not None:
        labels[~mask[:, 1:]] = IGNORE_INDEX
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": labels}
