"""DeepSeek-V3's rotary embedding: YaRN scaling (its frequencies and its two attention factors) and the row order
of its published weights.

YaRN (Peng et al. 2023; DeepSeek-V3's `rope_scaling` of type yarn) keeps the high-frequency dimensions of the
rotary embedding as trained, slows the low-frequency ones by `factor` and blends the band between them, which
`beta_fast` and `beta_slow` bound in rotations over the trained context. Its attention factor takes two forms:

- on the rotated dimensions: cos and sin multiplied by `yarn_attention_factor` (transformers:
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

import math

import torch


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 · mscale · ln(factor) + 1 (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(
    factor: float,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
) -> float:
    """What cos and sin are multiplied by: `attention_factor` when given, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are set (non-zero), else mscale(factor)."""
    if attention_factor is not None:
        return attention_factor
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_softmax_scale(qk_head_dim: int, factor: float, mscale_all_dim: float | None) -> float:
    """The softmax scale of multi-head latent attention under YaRN: qk_head_dim^-1/2 · mscale(factor,
    mscale_all_dim)² (qk_head_dim^-1/2 when mscale_all_dim is unset or 0)."""
    scale = qk_head_dim**-0.5
    if mscale_all_dim:
        scale *= yarn_mscale(factor, mscale_all_dim) ** 2
    return scale


def _correction_dim(rotations: float, dim: int, theta: float, original_max_position: int) -> float:
    """The dimension whose wavelength turns `rotations` times over the trained context."""
    return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    original_max_position: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The dim/2 inverse frequencies of a rotary embedding of `dim` dimensions under YaRN: the dimensions turning more
    than `beta_fast` times over the trained context as trained (extrapolated), those turning fewer than `beta_slow`
    times divided by `factor` (interpolated), a linear ramp between. truncate: round the ramp's ends outwards to
    whole dimensions (DeepSeek-V3 and transformers' default)."""
    trained = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    low = _correction_dim(beta_fast, dim, theta, original_max_position)
    high = _correction_dim(beta_slow, dim, theta, original_max_position)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width 0 would divide by 0
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the dimension's trained frequency, 0: its interpolated one
    return trained / factor * (1 - kept) + trained * kept


def rotary_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, attention_factor: float = 1.0, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (batch, seq, 2 · len(inv_freq)) for `position_ids` (batch, seq), in the half-split layout of
    `layers.apply_rope`, multiplied by YaRN's `attention_factor`."""
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
    return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


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
    "rotary_cos_sin",
    "yarn_attention_factor",
    "yarn_inv_freq",
    "yarn_mscale",
    "yarn_softmax_scale",
]
