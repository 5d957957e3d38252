"""DeepSeek-V3's rotary embedding: its YaRN softmax scale and the row order of its published weights (YaRN's
frequencies and cos/sin factor are the shared rotary tables', models/yarn.py). YaRN's attention factor takes two
forms:

- on the rotated dimensions: cos and sin multiplied by `yarn_attention_factor` (models/yarn.py; transformers:
  mscale(factor, mscale) / mscale(factor, mscale_all_dim); 1 for DeepSeek-V3, whose two are equal);
- on every dimension: the softmax scale multiplied by mscale(factor, mscale_all_dim)² (`yarn_softmax_scale`;
  DeepSeek's reference attention and transformers' `yarn_apply_mscale`). DeepSeek's reference reads `mscale` there
  where transformers reads `mscale_all_dim`; the published configs set both to the same value.

DeepSeek's checkpoints lay each rotary head out in interleaved pairs (0, 1), (2, 3), ... (transformers'
`rope_interleave`), where llamatron rotates the two halves (0, d/2), (1, d/2 + 1), ... (`layers.apply_rope`).
Rotating a pair and reordering commute, so import reorders the rotary rows of the projections that make the rotary
query and key (`halves_from_interleaved`: evens, then odds), export puts them back, and the scores are unchanged:
both sides of q·k carry the same order.
"""

from __future__ import annotations

import torch

from ...yarn import yarn_mscale


def yarn_softmax_scale(qk_head_dim: int, factor: float, mscale_all_dim: float | None) -> float:
    """The softmax scale of multi-head latent attention under YaRN: qk_head_dim^-1/2 · mscale(factor,
    mscale_all_dim)² (qk_head_dim^-1/2 when mscale_all_dim is unset or 0)."""
    scale = qk_head_dim**-0.5
    if mscale_all_dim:
        scale *= yarn_mscale(factor, mscale_all_dim) ** 2
    return scale


def halves_from_interleaved(t: torch.Tensor, block: int, rope_dim: int) -> torch.Tensor:
    """Rows of a weight (or bias) made of blocks of `block` rows, each ending in `rope_dim` rotary rows laid out in
    interleaved pairs: the rotary rows of every block reordered to evens, then odds (llamatron's halves)."""
    return _reorder_rotary_rows(t, block, (rope_dim // 2, 2))


def interleaved_from_halves(t: torch.Tensor, block: int, rope_dim: int) -> torch.Tensor:
    """The inverse of `halves_from_interleaved`: the export order."""
    return _reorder_rotary_rows(t, block, (2, rope_dim // 2))


def _reorder_rotary_rows(t: torch.Tensor, block: int, grid: tuple[int, int]) -> torch.Tensor:
    """Each block's last grid[0] · grid[1] rows read as a (grid[0], grid[1]) grid and written transposed."""
    rope_dim = grid[0] * grid[1]
    blocks = t.reshape(-1, block, *t.shape[1:])
    rope = blocks[:, block - rope_dim :]
    moved = rope.reshape(rope.shape[0], *grid, *t.shape[1:]).transpose(1, 2).reshape(rope.shape)
    return torch.cat([blocks[:, : block - rope_dim], moved], dim=1).reshape(t.shape)


__all__ = [
    "halves_from_interleaved",
    "interleaved_from_halves",
    "yarn_softmax_scale",
]
