"""Document boundaries inside pre-training samples, found from end-of-document (EOD) tokens.

Pre-training samples are windows of a stream of documents, each ending with
the EOD token that ``preprocess --append-eod`` writes. Three independent
options (Megatron's) make a sample behave like separate documents:

- ``reset_position_ids``: rotary positions restart at 0 after each EOD;
- ``reset_attention_mask``: a token attends only to tokens of its own document
  (the EOD closes the document it ends);
- ``eod_mask_loss``: no loss on predicting an EOD token.

``DocumentBoundaries`` wraps a dataset of token samples and returns dicts
that ``batches.collate`` turns into ``position_ids``, ``document_ids`` and
masked ``labels``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def document_ids_and_positions(tokens: np.ndarray, eod_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token: its document's index within the sample, and its position in that document.

    A new document starts right after each EOD token.
    """
    n = tokens.size
    document_ids = np.zeros(n, dtype=np.int64)
    np.cumsum(tokens[:-1] == eod_id, out=document_ids[1:])
    starts = np.flatnonzero(np.diff(document_ids, prepend=-1))
    position_ids = np.arange(n, dtype=np.int64) - np.repeat(starts, np.diff(np.append(starts, n)))
    return document_ids, position_ids


class DocumentBoundaries:
    """A dataset of token samples with the boundary options applied (see the module doc)."""

    def __init__(
        self,
        dataset: Sequence,
        eod_id: int,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
    ) -> None:
        self.dataset = dataset
        self.eod_id = int(eod_id)
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.eod_mask_loss = eod_mask_loss

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        tokens = np.asarray(self.dataset[index], dtype=np.int64)
        sample = {"tokens": tokens}
        if self.eod_mask_loss:
            sample["loss_mask"] = tokens != self.eod_id
        if self.reset_position_ids or self.reset_attention_mask:
            document_ids, position_ids = document_ids_and_positions(tokens, self.eod_id)
            if self.reset_position_ids:
                sample["position_ids"] = position_ids
            if self.reset_attention_mask:
                sample["document_ids"] = document_ids
        return sample
