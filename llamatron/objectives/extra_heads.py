"""A family's extra prediction heads in the language-model loss (models/family.py ExtraHeads; DeepSeek-V3's
multi-token prediction): head j's logits at position i predict label i + offsets[j], and the step's loss adds

    loss_weight / J · Σ_j (head j's cross entropy summed over the global batch / its label count there)

each head's count taken over the global batch as the main loss's normaliser is (the last offsets[j] places of a
sequence and IGNORE_INDEX labels count nothing). The unweighted mean over the heads is logged as its own field.
The per-token cross entropy is the main loss's (vocabulary-parallel under tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

import torch
import torch.nn.functional as F

from ..models import IGNORE_INDEX, ModelConfig, Transformer
from ..models.attention import load_balanced_index
from ..models.family import ExtraHeads
from ..models.transformer import extra_heads_of


def labels_ahead(labels: torch.Tensor, offset: int) -> torch.Tensor:
    """labels (batch, seq) moved `offset` places left: position i holds label i + offset, IGNORE_INDEX past the end."""
    return F.pad(labels[:, offset:], (0, min(offset, labels.shape[1])), value=IGNORE_INDEX)


def local_labels_ahead(mb: Mapping[str, torch.Tensor], offset: int, context: tuple[int, int]) -> torch.Tensor:
    """labels_ahead at this rank's tokens: under context parallelism (cp size, rank) from the whole sequence's
    labels (parallel/context.py keeps them), at the positions the rank holds."""
    size, rank = context
    if size == 1:
        return labels_ahead(mb["labels"], offset)
    whole = mb["whole_labels"]
    return labels_ahead(whole, offset)[:, load_balanced_index(whole.shape[1], size, rank, whole.device)]


def extra_heads_problems(cfg: ModelConfig, fsdp_replicas: int) -> list[str]:
    """Why this model's extra heads cannot train so (empty: they can). fsdp_replicas: the ranks --fsdp shards the
    weights over (0 without --fsdp). Under --fsdp over several ranks the run parts from the single process's at its
    second step (DeepSeek-V3's MTP, dp 2: grad norm 0.9274 against 0.9263), the embedding being used again by the
    heads: refused until that is found."""
    if fsdp_replicas < 2 or extra_heads_of(cfg) is None:
        return []
    return [
        f"--fsdp over {fsdp_replicas} ranks with this {cfg.family} model's extra prediction heads does not train "
        "as one process does yet; drop --fsdp (the distributed optimizer shards the optimizer state) or the heads "
        "(their count set to 0 with --model-override)"
    ]


class ExtraHeadsTraining:
    """The model's extra heads on this rank: their share of each micro-batch's loss on the last stage (`chunk`, the
    one holding them) and the step's statistic, which every pipeline stage adds to (0 where they are not)."""

    def __init__(self, heads: ExtraHeads, chunk: Transformer, device: torch.device):
        self.chunk, self.offsets, self.weight = chunk, heads.offsets, heads.loss_weight
        self.stat_name = heads.stat_name
        self.loss_sum = torch.zeros((), device=device)  # the step's unweighted extra loss (this rank's share)

    @staticmethod
    def attach(chunks: list[Transformer], model_cfg: ModelConfig, device: torch.device) -> ExtraHeadsTraining | None:
        """None for a model without extra heads; on a rank without the last stage, their statistic's place."""
        last = chunks[-1]
        heads = last.extra_heads if last.extra_heads is not None else extra_heads_of(model_cfg)
        return None if heads is None else ExtraHeadsTraining(cast(ExtraHeads, heads), last, device)

    def _ahead(self, mb: Mapping[str, torch.Tensor], offset: int) -> torch.Tensor:
        return local_labels_ahead(mb, offset, self.chunk.parallel.context)

    def counts(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Each head's label count over this rank's micro-batches, (J,) float."""
        return torch.stack(
            [
                torch.stack([(self._ahead(mb, k) != IGNORE_INDEX).sum() for mb in micro_batches]).sum()
                for k in self.offsets
            ]
        ).float()

    def loss(
        self,
        per_token: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        mb: Mapping[str, torch.Tensor],
        counts: torch.Tensor,
    ) -> torch.Tensor:
        """This micro-batch's weighted extra loss from the heads' logits of its forward; `counts`: each head's
        global-batch label count (clamped >= 1)."""
        logits = self.chunk.take_extra_logits()
        assert len(logits) == len(self.offsets), "the extra heads' logits of this micro-batch are missing"
        terms = [per_token(x, self._ahead(mb, k)).sum() for x, k in zip(logits, self.offsets)]
        extra = (torch.stack(terms) / counts).mean()
        self.loss_sum += extra.detach()
        return self.weight * extra


__all__ = ["ExtraHeadsTraining", "extra_heads_problems", "labels_ahead", "local_labels_ahead"]
