"""Training samples from preprocessed conversations: packed (or padded) sequences with loss masks.

A sample holds ``seq_length + 1`` tokens like a pre-training sample, as a dict
that ``batches.collate`` understands:

- ``tokens``: int64; padding is token 0.
- ``loss_mask``: bool, True where the token is a training target (assistant
  tokens; never padding, never the first token of a conversation).
- packed only: ``document_ids`` (which conversation of the sample each token
  belongs to; the padding is one more document) and ``position_ids`` (restart
  at 0 for each conversation), so attention and rotary positions stay inside
  a conversation exactly as if it were alone.

Packing is best-fit decreasing over conversation lengths, which wastes little
space; the resulting sequences are shuffled anew each epoch from the seed.
A conversation longer than a sample is truncated (counted in ``truncated``); one
that truncation leaves without a trained token is counted in ``untrained`` and
warned about, and a split where no conversation keeps one is a DataError.
With ``pack=False`` each sample is one conversation followed by padding.
"""

from __future__ import annotations

import bisect
import os
import time
from typing import Any

import numpy as np

from llamatron.data.cache import ArrayCache, cache_key
from llamatron.data.indexed import IndexedDataset, index_path
from llamatron.data.samples import check_mask_values, check_token_ids, index_cache_dir, split_documents
from llamatron.data.sft import mask_prefix
from llamatron.errors import DataError, MissingDataError


def pack_conversations(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing bin packing: (offsets, items) with bin b = items[offsets[b]:offsets[b+1]].

    Items are indices into ``lengths``; every length must be in [1, capacity]. Longest first,
    each into the fullest bin it still fits (ties: the earliest item, the earliest bin).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"lengths must lie in [1, {capacity}]")
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # (space left, bin id), sorted
    for item in np.argsort(-lengths, kind="stable").tolist():
        size = int(lengths[item])
        at = bisect.bisect_left(open_bins, (size, -1))  # the fullest bin that still fits
        if at < len(open_bins):
            space, bin_id = open_bins.pop(at)
            bins[bin_id].append(item)
        else:
            space, bin_id = capacity, len(bins)
            bins.append([item])
        if space - size > 0:
            bisect.insort(open_bins, (space - size, bin_id))
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in bins], out=offsets[1:])
    items = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(offsets[-1]))
    return offsets, items


class SFTDataset:
    """Packed or padded conversation samples over ``conversations`` of the token/mask datasets."""

    CACHE_NAMES = ("bin_offsets", "bin_items", "sample_order")

    def __init__(
        self,
        tokens: IndexedDataset,
        mask: IndexedDataset,
        conversations: np.ndarray,
        seq_length: int,
        num_samples: int,
        seed: int,
        pack: bool = True,
        cache_dir: str | None = None,
        split_name: str = "train",
    ) -> None:
        if tokens.sizes.shape != mask.sizes.shape or not np.array_equal(tokens.sizes, mask.sizes):
            raise DataError(
                f"{index_path(mask.prefix)} does not match {index_path(tokens.prefix)} (different "
                "conversation sizes): the token and mask datasets come from different preprocess runs"
            )
        self.tokens, self.mask = tokens, mask
        self.seq_length, self.num_samples, self.seed, self.pack = seq_length, num_samples, seed, pack
        capacity = seq_length + 1
        conversations = np.asarray(conversations, dtype=np.int64)
        sizes = tokens.sizes[conversations].astype(np.int64)
        self.conversations = conversations[sizes > 0]
        self.truncated = int((sizes > capacity).sum())
        lengths = np.minimum(sizes[sizes > 0], capacity)
        if self.conversations.size == 0:
            raise DataError(f"{tokens.prefix}: no conversations in this split; cannot build {num_samples} samples")
        self.split_name, self.longest = split_name, int(sizes.max())
        self.untrained = self._count_untrained(self.conversations[lengths == capacity], capacity)
        if self.untrained == self.conversations.size:
            # Training would run on loss 0 and report perplexity 1: nothing to learn from.
            raise DataError(
                f"--sft-data {tokens.prefix}: {self._untrained_text()}, so no sample has a token to "
                f"train on; {self._fix()}"
            )
        start = time.perf_counter()
        key = cache_key("sft", seq_length, num_samples, seed, pack, self.conversations, lengths)
        cache = ArrayCache(cache_dir, os.path.basename(tokens.prefix), f"sft-{split_name}", key, self.CACHE_NAMES)
        (self.bin_offsets, self.bin_items, self.sample_order), self.loaded_from_cache = cache.get_or_build(
            lambda: self._build(lengths, capacity)
        )
        self.build_seconds = time.perf_counter() - start
        self.num_sequences = self.bin_offsets.size - 1
        # Share of sample tokens that are conversation tokens rather than padding.
        self.fill = float(lengths.sum() / (self.num_sequences * capacity))

    def _count_untrained(self, candidates: np.ndarray, capacity: int) -> int:
        """How many of these (truncated) conversations keep no trained token within their first ``capacity``."""
        # Position 0 is never trained (see __getitem__), so look at 1..capacity-1 only.
        return sum(not self.mask.get(int(c), 1, capacity - 1).any() for c in candidates.tolist())

    def _untrained_text(self) -> str:
        return (
            f"{self.untrained} of the {self.conversations.size} conversations of the {self.split_name} split "
            f"lose all their trained (assistant) tokens to truncation at {self.seq_length + 1} tokens"
        )

    def _fix(self) -> str:
        return (
            f"raise --seq-length (the longest conversation has {self.longest} tokens: --seq-length "
            f"{self.longest - 1} holds it whole) or shorten the prompts"
        )

    def warning(self) -> str | None:
        """A warning for conversations that truncation leaves with nothing to train on, else None."""
        if not self.untrained:
            return None
        return (
            f"warning: --sft-data {self.tokens.prefix}: {self._untrained_text()} (their assistant replies come "
            f"after the cut) and train on nothing; {self._fix()}"
        )

    def _build(self, lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.pack:
            offsets, positions = pack_conversations(lengths, capacity)
            items = self.conversations[positions]
        else:
            offsets, items = np.arange(lengths.size + 1, dtype=np.int64), self.conversations
        # Epoch e visits every sequence once, in its own order; as many epochs as the samples need.
        num_bins = offsets.size - 1
        rng = np.random.RandomState(self.seed)
        epochs = max(1, -(-self.num_samples // num_bins))
        order = np.concatenate([rng.permutation(num_bins) for _ in range(epochs)])[: self.num_samples]
        return offsets, items, order.astype(np.int64)

    def describe(self) -> str:
        """The data line a run prints: the dataset's size, its split's packing, and the samples drawn."""
        packing = f"packed into {self.num_sequences:,} sequences" if self.pack else "one per sequence (--no-pack)"
        return (
            f"sft data {self.tokens.prefix}: {len(self.tokens):,} conversations, {self.tokens.num_tokens:,} tokens "
            f"({self.split_name} split: {self.conversations.size:,} conversations {packing} of "
            f"{self.seq_length + 1} tokens, {self.fill:.0%} filled; {self.truncated} truncated to "
            f"{self.seq_length + 1} tokens); {self.num_samples:,} samples drawn"
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        capacity = self.seq_length + 1
        sequence = int(self.sample_order[index])
        members = self.bin_items[self.bin_offsets[sequence] : self.bin_offsets[sequence + 1]]
        tokens = np.zeros(capacity, dtype=np.int64)
        loss_mask = np.zeros(capacity, dtype=bool)
        document_ids = np.full(capacity, len(members), dtype=np.int64)  # padding: a document of its own
        position_ids = np.zeros(capacity, dtype=np.int64)
        at = 0
        for k, conversation in enumerate(members.tolist()):
            n = min(int(self.tokens.sizes[conversation]), capacity - at)
            tokens[at : at + n] = self.tokens.get(conversation, 0, n)
            loss_mask[at : at + n] = self.mask.get(conversation, 0, n) != 0
            loss_mask[at] = False  # a conversation's first token is never predicted from the one before
            document_ids[at : at + n] = k
            position_ids[at : at + n] = np.arange(n)
            at += n
        position_ids[at:] = np.arange(capacity - at)
        sample: dict[str, Any] = {"tokens": tokens, "loss_mask": loss_mask}
        if self.pack:
            sample["document_ids"], sample["position_ids"] = document_ids, position_ids
        return sample


def build_sft_datasets(
    prefix: str,
    split: str,
    seq_length: int,
    train_samples: int,
    valid_samples: int,
    seed: int,
    pack: bool = True,
    vocab_size: int | None = None,
    cache_path: str | None = None,
) -> tuple[SFTDataset, SFTDataset | None]:
    """Train and validation datasets for ``--sft-data PREFIX`` (conversations split by ``split``); index caches
    in ``cache_path`` (--data-cache-path), else beside the data."""
    base = prefix[: -len("_mask")]
    if (
        prefix.endswith("_mask")
        and os.path.isfile(index_path(base))
        and not os.path.isfile(index_path(mask_prefix(prefix)))
    ):
        raise DataError(
            f"--sft-data {prefix} is the loss mask of {base}; give the token dataset, --sft-data {base} "
            "(its _mask is found from it)"
        )
    tokens = IndexedDataset(prefix)
    try:
        mask = IndexedDataset(mask_prefix(prefix))
    except MissingDataError as err:
        raise MissingDataError(
            f"{err}; --sft-data needs the loss mask that `preprocess --sft` writes next to the "
            f"tokens: is {prefix} a --data (pre-training) dataset?"
        ) from None
    cache_dir = index_cache_dir(prefix, cache_path)
    if vocab_size is not None:
        check_token_ids(tokens, vocab_size, cache_dir)
    check_mask_values(mask, "`llamatron preprocess --sft`", cache_dir)
    train_ids, valid_ids, _ = split_documents(len(tokens), split)
    if train_ids.size == 0:
        raise DataError(f"--sft-data {prefix} split={split!r}: the train split has no conversations")
    train = SFTDataset(tokens, mask, train_ids, seq_length, train_samples, seed, pack, cache_dir)
    valid = None
    if valid_ids.size and valid_samples > 0 and tokens.sizes[valid_ids].sum() > 0:
        valid = SFTDataset(tokens, mask, valid_ids, seq_length, valid_samples, seed, pack, cache_dir, "valid")
    return train, valid
