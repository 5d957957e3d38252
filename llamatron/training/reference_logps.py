"""DPO's reference model, as a pass before the first step: each preference sequence's log-probability under the
starting weights, computed once and cached beside the data.

The reference is the model the run starts from (TRL's too): the --load checkpoint or the seed's initialisation,
with a LoRA run's adapters as they start (zero, or `--lora-init-from`'s, or a loaded LoRA checkpoint's). The pass
runs through the same engine as training, under any layout (the pipeline's forward-only schedule, the
tensor-parallel vocabulary loss), in eval mode: each data-parallel rank computes its contiguous share of every
round of one global batch, and the table is summed over the replicas. Training then needs no second model and no
extra forward per step.

The table is cached in the data's index cache directory (--data-cache-path, else beside the data) as
`PREFIX-reference-KEY.npy`, KEY a digest of what determines it: the reference weights (the checkpoint's sha256
fingerprint or the seed), the model, the precision, the sequence length and the data files (size and time). A
checkpoint names the KEY and file it trained against (meta.json "dpo_reference"); a resume reads that file, and
recomputes it only where it still can:
a LoRA run whose adapters started at zero, whose reference is its frozen base with the adapters switched off.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..adapters.lora import adapters_off
from ..checkpoint.reader import fingerprint, resolve_checkpoint
from ..data.batches import micro_batches_for_rank, to_device
from ..data.cache import cache_key, file_signature
from ..data.indexed import data_path
from ..data.preference_dataset import PreferenceDataset, PreferencePairs
from ..data.samples import index_cache_dir
from ..errors import CheckpointError, DataError
from ..objectives.preference import PreferenceObjective
from ..parallel.mesh import sum_from_last_stage
from .engine import Engine, forward_each

REFERENCE_KEY = "dpo_reference"


class _ReferenceSamples:
    """Every sequence the run reads, in record order: 2j and 2j+1 are `records[j]`'s chosen and rejected."""

    def __init__(self, pairs: PreferencePairs, records: np.ndarray, seq_length: int):
        self.pairs, self.records, self.capacity = pairs, records, seq_length + 1

    def __len__(self) -> int:
        return 2 * self.records.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.pairs.sequence(int(self.records[index // 2]), index % 2, self.capacity)


def reference_cache_key(engine: Engine, weights: str, pairs: PreferencePairs) -> str:
    """What determines the table: the reference weights, the model, precision, sequence length and the data."""
    cfg = engine.cfg
    # the data by its files' sizes and modification times (as the index caches): rewritten pairs of the same
    # lengths are other pairs
    files = [file_signature(data_path(d.prefix)) for d in (*pairs.tokens, *pairs.masks)]
    model = sorted(dataclasses.asdict(engine.model_cfg).items())
    return cache_key("dpo-reference", weights, model, engine.derived.dtype_name, cfg.data.seq_length, *files)


def reference_weights(engine: Engine) -> str:
    """What the reference weights are: the loaded checkpoint's fingerprint, else the initialisation's seed."""
    t = engine.cfg.train
    if t.load:
        return fingerprint(resolve_checkpoint(t.load))
    return f"initialisation, seed {t.seed}"


@torch.no_grad()
def compute_reference_logps(engine: Engine, samples: _ReferenceSamples, base: bool = False) -> np.ndarray:
    """The log-probability of each of `samples` (float64) under the engine's weights, or with `base` its LoRA
    adapters switched off; a collective over every rank."""
    objective = engine.objective
    assert isinstance(objective, PreferenceObjective)  # --objective dpo builds it (engine._objective)
    cfg, mesh = engine.cfg, engine.mesh
    size, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    n = len(samples)
    table = torch.zeros(n, dtype=torch.float64, device=engine.device)
    start_of: dict[int, int] = {}  # a micro-batch (by id) -> the index of its first sequence

    def store(model, logits: torch.Tensor, mb: dict) -> None:
        logps, _ = objective.sequence_logps(logits, mb["labels"])
        index = torch.arange(start_of[id(mb)], start_of[id(mb)] + logps.numel(), device=logps.device)
        keep = index < n  # the last round wraps around to sequences already counted
        if mesh.cp_rank == 0:  # every context-parallel rank holds the whole sums; the table adds the replicas'
            table[index[keep]] = logps[keep].double()

    for first in range(0, n, size):
        batches = to_device(micro_batches_for_rank(samples, first, size, mbs, mesh), engine.device)
        per_rank = size // mesh.layout.dp
        start_of.clear()
        start_of.update({id(mb): first + mesh.dp_rank * per_rank + k * mbs for k, mb in enumerate(batches)})
        with adapters_off(engine.chunks) if base else nullcontext():
            forward_each(engine, batches, store)
    return sum_from_last_stage(table, mesh).cpu().numpy()


# What a run can do about its reference table being damaged (or gone): computed again from the weights it started
# with where the run has them; a resumed full fine-tune's weights are no longer the reference.
_RECOMPUTE = "delete it: the next run computes them again"
_LOST = (
    "this resumed run cannot compute them again (its weights are no longer the reference): put an intact copy "
    "back, or start the DPO run again from the checkpoint it started from"
)


def _read_table(path: str, records: int, fix: str) -> np.ndarray | None:
    if not os.path.isfile(path):
        return None
    try:
        table = np.load(path, allow_pickle=False)  # data, never code
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable reference log-probs ({err}); {fix}") from None
    if table.shape != (records, 2) or table.dtype != np.float64:
        raise DataError(f"{path}: reference log-probs of shape {table.shape}, expected ({records}, 2); {fix}")
    return table


def attach_reference(
    engine: Engine, datasets: list[PreferenceDataset], resumed: dict[str, Any] | None, zero_adapters: bool
) -> dict[str, Any]:
    """Give the preference datasets their reference log-probs: read from the cache, else computed now (a
    collective). `resumed`: the loaded checkpoint's "dpo_reference" entry when resuming a DPO run;
    `zero_adapters`: a fresh LoRA run's adapters start at zero. Returns the entry its checkpoints record."""
    cfg, mesh = engine.cfg, engine.mesh
    pairs = datasets[0].pairs
    fresh = resumed is None
    if resumed is None:
        resumed = {"key": reference_cache_key(engine, reference_weights(engine), pairs), "base": zero_adapters}
    key = _checked_entry(resumed)
    directory = index_cache_dir(pairs.prefix, cfg.data.data_cache_path)
    path = os.path.join(directory, f"{os.path.basename(pairs.prefix)}-reference-{key}.npy")
    recomputable = fresh or resumed["base"]
    table = _read_table(path, len(pairs), _RECOMPUTE if recomputable else _LOST)
    if table is None:
        if not recomputable:
            raise CheckpointError(f"the reference log-probs this DPO run trained against ({path}) are gone; {_LOST}")
        records = np.unique(np.concatenate([ds.records for ds in datasets]))
        samples = _ReferenceSamples(pairs, records, cfg.data.seq_length)
        logps = compute_reference_logps(engine, samples, base=not fresh)
        table = np.zeros((len(pairs), 2), dtype=np.float64)
        table[records] = logps.reshape(-1, 2)
        if mesh.rank == 0:
            _write_table(path, table, records.size)
    if dist.is_initialized():
        dist.barrier()
    for ds in datasets:
        ds.reference = table
    return {"key": key, "file": path, "base": bool(resumed["base"])}


def _write_table(path: str, table: np.ndarray, pairs: int) -> None:
    """Cache the table (every rank holds it already); a directory that cannot be written costs a later resume
    only, so it is a warning."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(temporary, "wb") as f:
            np.save(f, table)
        os.replace(temporary, path)
    except OSError as err:
        print(
            f"warning: reference log-probs of {pairs:,} pairs computed but not cached ({err}); a resume of this run "
            "will need them: give --data-cache-path a writable directory",
            file=sys.stderr,
            flush=True,
        )
        return
    print(f"reference log-probs of {pairs:,} pairs computed, cached in {path}", flush=True)


def _checked_entry(entry: Any) -> str:
    """The cache key of a checkpoint's "dpo_reference" entry (a hex digest: it names a file)."""
    key = entry.get("key") if isinstance(entry, dict) else None
    if not isinstance(key, str) or not key.isalnum() or not isinstance(entry.get("base"), bool):
        raise CheckpointError(f"meta.json: malformed {REFERENCE_KEY} entry {entry!r}; resume from another checkpoint")
    return key


__all__ = ["REFERENCE_KEY", "attach_reference", "compute_reference_logps"]
