"""Training samples from preprocessed preference pairs: sample 2j is pair j's chosen sequence, sample 2j+1 its rejected.

Each sequence is one prompt + response, padded (token 0) to ``seq_length + 1`` tokens, with a loss mask on the
response; a response cut by truncation keeps its first tokens. A pair where either response loses every trained
token to the cut is left out (and warned about). The pairs of a split are shuffled anew each epoch from the seed,
and a pair's two sequences are always adjacent samples at an even index: an even micro-batch size
(objectives/preference.py says so) keeps both in one micro-batch of one data-parallel rank.

A sample may carry ``ref_logp``, the reference model's log-probability of its response, once the run's reference
pass (training/reference_logps.py) has set ``reference``: a table over all the records of the data, by record
index and response (0 chosen, 1 rejected).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llamatron.data.indexed import IndexedDataset, index_path
from llamatron.data.preference import RESPONSES, response_prefix
from llamatron.data.samples import check_mask_values, check_token_ids, index_cache_dir, split_documents
from llamatron.data.sft import mask_prefix
from llamatron.errors import DataError, MissingDataError


class PreferencePairs:
    """The four datasets of ``preprocess --preference`` output ``prefix``, checked against each other."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.tokens: list[IndexedDataset] = []
        self.masks: list[IndexedDataset] = []
        for response in RESPONSES:
            tokens = _open(response_prefix(prefix, response), prefix)
            mask = _open(mask_prefix(response_prefix(prefix, response)), prefix)
            if not np.array_equal(tokens.sizes, mask.sizes):
                raise DataError(
                    f"{index_path(mask.prefix)} does not match {index_path(tokens.prefix)} (different sizes): the "
                    "token and mask datasets come from different preprocess runs; run preprocess --preference again"
                )
            self.tokens.append(tokens)
            self.masks.append(mask)
        if len(self.tokens[0]) != len(self.tokens[1]):
            raise DataError(
                f"--preference-data {prefix}: {len(self.tokens[0])} chosen but {len(self.tokens[1])} rejected "
                "responses (files of different preprocess runs); run preprocess --preference again"
            )

    def __len__(self) -> int:
        return len(self.tokens[0])

    def trains_within(self, record: int, capacity: int) -> bool:
        """Whether both responses of ``record`` keep a trained token in their first ``capacity`` tokens (the
        first token is never predicted); either may be shorter than that."""
        for mask in self.masks:
            n = min(int(mask.sizes[record]), capacity)
            if n < 2 or not mask.get(record, 1, n - 1).any():
                return False
        return True

    def alike_within(self, records: np.ndarray, capacity: int) -> int:
        """How many of ``records`` have the same chosen and rejected sequence (tokens and mask) in their first
        ``capacity`` tokens: DPO compares the two, so such a pair adds nothing to the gradient."""
        lengths = [np.minimum(tokens.sizes[records], capacity) for tokens in self.tokens]
        same = lengths[0] == lengths[1]
        alike = 0
        for record, n in zip(records[same].tolist(), lengths[0][same].tolist()):
            both = (self.tokens, self.masks)
            alike += all(np.array_equal(c.get(record, 0, n), r.get(record, 0, n)) for c, r in both)
        return alike

    def sequence(self, record: int, response: int, capacity: int) -> dict[str, np.ndarray]:
        """Record ``record``'s prompt + response ``response`` (0 chosen, 1 rejected) as one padded sample."""
        n = min(int(self.tokens[response].sizes[record]), capacity)
        tokens = np.zeros(capacity, dtype=np.int64)
        loss_mask = np.zeros(capacity, dtype=bool)
        tokens[:n] = self.tokens[response].get(record, 0, n)
        loss_mask[:n] = self.masks[response].get(record, 0, n) != 0
        loss_mask[0] = False
        return {"tokens": tokens, "loss_mask": loss_mask}


def _open(prefix: str, given: str) -> IndexedDataset:
    try:
        return IndexedDataset(prefix)
    except MissingDataError as err:
        hint = ""
        for response in RESPONSES:  # the user named one of the files instead of the prefix
            for suffix in (f"_{response}", f"_{response}_mask"):
                if given.endswith(suffix):
                    hint = f"; give the prefix without {suffix}: --preference-data {given[: -len(suffix)]}"
        raise MissingDataError(
            f"{err}; --preference-data needs the four datasets `preprocess --preference` writes "
            f"(PREFIX_chosen, PREFIX_rejected and their _mask){hint}"
        ) from None


class PreferenceDataset:
    """The samples of one split's pairs (see the module docstring)."""

    def __init__(
        self, pairs: PreferencePairs, records: np.ndarray, seq_length: int, num_samples: int, seed: int, name: str
    ) -> None:
        self.pairs, self.seq_length, self.split_name = pairs, seq_length, name
        capacity = seq_length + 1
        records = np.asarray(records, dtype=np.int64)
        longest = np.maximum(pairs.tokens[0].sizes[records], pairs.tokens[1].sizes[records])
        self.truncated = int((longest > capacity).sum())
        keep = np.ones(records.size, dtype=bool)
        for i in np.flatnonzero(longest > capacity).tolist():
            keep[i] = pairs.trains_within(int(records[i]), capacity)
        self.records, self.dropped, self.longest = records[keep], int((~keep).sum()), int(longest.max(initial=0))
        self.alike = pairs.alike_within(self.records, capacity)
        if self.records.size == 0:
            raise DataError(
                f"--preference-data {pairs.prefix}: no pair of the {name} split keeps a trained response token "
                f"within {capacity} tokens; {self._fix()}"
            )
        rng = np.random.RandomState(seed)
        wanted = -(-num_samples // 2)
        epochs = max(1, -(-wanted // self.records.size))
        self.order = np.concatenate([self.records[rng.permutation(self.records.size)] for _ in range(epochs)])
        self.reference: np.ndarray | None = None  # (records, 2) reference log-probs, set by the reference pass

    def _fix(self) -> str:
        return (
            f"raise --seq-length (the longest sequence has {self.longest} tokens: --seq-length {self.longest - 1} "
            "holds it whole) or shorten the prompts"
        )

    def warning(self) -> str | None:
        """The pairs left out, and those that train nothing (chosen and rejected alike), a line each; else None."""
        lines, given = [], f"warning: --preference-data {self.pairs.prefix}"
        if self.dropped:
            lines.append(
                f"{given}: {self.dropped} of the {self.records.size + self.dropped} pairs of the {self.split_name} "
                f"split lose every trained token of a response to truncation at {self.seq_length + 1} tokens and are "
                f"left out; {self._fix()}"
            )
        if self.alike:
            lines.append(
                f"{given}: {self.alike} of the {self.records.size} pairs of the {self.split_name} split have the same "
                f"chosen and rejected sequence (in their first {self.seq_length + 1} tokens): DPO compares the two, "
                "so they add nothing to the gradient (and count as not preferred in rewards_accuracy); check how the "
                "pairs were made"
            )
        return "\n".join(lines) or None

    def describe(self) -> str:
        return (
            f"preference data {self.pairs.prefix}: {len(self.pairs):,} pairs ({self.split_name} split: "
            f"{self.records.size:,} pairs, {self.truncated} with a response truncated to {self.seq_length + 1} "
            f"tokens, {self.dropped} left out); {len(self):,} samples (two per pair)"
        )

    def __len__(self) -> int:
        return 2 * self.order.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        record, response = int(self.order[index // 2]), index % 2
        sample: dict[str, Any] = self.pairs.sequence(record, response, self.seq_length + 1)
        if self.reference is not None:
            sample["ref_logp"] = float(self.reference[record, response])
        return sample


def build_preference_datasets(
    prefix: str,
    split: str,
    seq_length: int,
    train_samples: int,
    valid_samples: int,
    seed: int,
    vocab_size: int | None = None,
    cache_path: str | None = None,
) -> tuple[PreferenceDataset, PreferenceDataset | None]:
    """Train and validation datasets of ``--preference-data PREFIX`` (its records split by ``split``)."""
    pairs = PreferencePairs(prefix)
    for tokens, mask in zip(pairs.tokens, pairs.masks):
        if vocab_size is not None:
            check_token_ids(tokens, vocab_size, index_cache_dir(tokens.prefix, cache_path))
        check_mask_values(mask, "`llamatron preprocess --preference`", index_cache_dir(mask.prefix, cache_path))
    train_ids, valid_ids, _ = split_documents(len(pairs), split)
    if train_ids.size == 0:
        raise DataError(f"--preference-data {prefix} split={split!r}: the train split has no pairs")
    train = PreferenceDataset(pairs, train_ids, seq_length, train_samples, seed, "train")
    valid = None
    if valid_ids.size and valid_samples > 0:
        valid = PreferenceDataset(pairs, valid_ids, seq_length, valid_samples, seed, "valid")
    return train, valid


__all__ = ["PreferenceDataset", "PreferencePairs", "build_preference_datasets"]
