"""The samples of one optimizer step, cut for this data-parallel rank into micro-batches.

Step k trains on global samples [k*G, (k+1)*G) (G = global batch size), so
what a step sees depends only on the global batch and `consumed_samples`,
never on the layout. Data-parallel rank r takes the r-th contiguous 1/dp of it;
under context parallelism each of its cp ranks keeps its part of every sequence.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from ..models import IGNORE_INDEX
from ..parallel.context import split_for_context
from ..parallel.mesh import Mesh


class Samples(Protocol):
    """What training and evaluation read: samples by index (a dict of token arrays each), and how many."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def micro_batches_for_step(
    dataset: Samples, consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp: int, dp_rank: int
) -> list[dict[str, torch.Tensor]]:
    per_rank = global_batch_size // dp
    first = consumed_samples + dp_rank * per_rank
    out = []
    for start in range(first, first + per_rank, micro_batch_size):
        out.append(collate([dataset[(start + j) % len(dataset)] for j in range(micro_batch_size)]))
    return out


def micro_batches_for_rank(
    dataset: Samples, consumed_samples: int, global_batch_size: int, micro_batch_size: int, mesh: Mesh
) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of the step starting at `consumed_samples`: its data-parallel share, each
    sequence cut to its context-parallel part."""
    mbs = micro_batches_for_step(
        dataset, consumed_samples, global_batch_size, micro_batch_size, mesh.layout.dp, mesh.dp_rank
    )
    return [split_for_context(mb, mesh.layout.cp, mesh.cp_rank) for mb in mbs]


def collate(samples: list) -> dict[str, torch.Tensor]:
    """Samples of seq+1 tokens -> input_ids / labels.

    A sample may be a dict of seq+1 arrays: "tokens", and optionally "loss_mask" (True where the
    token is a target), "position_ids" and "document_ids" (data/boundaries.py, data/sft_dataset.py),
    which become (batch, seq) "position_ids" / "document_ids" for the model, and "ref_logp", a reference
    model's log-probability of the sample (data/preference_dataset.py), which becomes (batch,) "ref_logps".
    """
    if not isinstance(samples[0], dict):
        samples = [{"tokens": s} for s in samples]

    def stack(key: str, dtype: type) -> torch.Tensor:
        return torch.from_numpy(np.stack([s[key] for s in samples]).astype(dtype))

    tokens = stack("tokens", np.int64)
    labels = tokens[:, 1:].clone()
    if "loss_mask" in samples[0]:
        labels[~stack("loss_mask", bool)[:, 1:]] = IGNORE_INDEX
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": labels}
    for key in ("position_ids", "document_ids"):
        if key in samples[0]:
            batch[key] = stack(key, np.int64)[:, :-1].contiguous()
    if "ref_logp" in samples[0]:
        batch["ref_logps"] = torch.tensor([s["ref_logp"] for s in samples], dtype=torch.float64)
    return batch


def to_device(micro_batches: list[dict], device: torch.device) -> list[dict]:
    return [{k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in micro_batches]


def batch_problems(global_batch_size: int, micro_batch_size: int, dp: int) -> list[str]:
    """A step's samples must split into whole micro-batches on every data-parallel rank."""
    if global_batch_size % (micro_batch_size * dp):
        return [
            f"--global-batch-size {global_batch_size} is not a multiple of micro-batch-size x data-parallel size = "
            f"{micro_batch_size} x {dp} = {micro_batch_size * dp}"
        ]
    return []
