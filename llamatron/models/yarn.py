"""YaRN (Peng et al. 2023), the rotary scaling of DeepSeek-V3, gpt-oss and long-context Qwen: its inverse
frequencies and the attention factor cos and sin are multiplied by (`RopeScaling` kind "yarn", read by
layers.rope_cos_sin).

YaRN keeps the high-frequency dimensions of the rotary embedding as trained, slows the low-frequency ones by
`factor` and blends the band between them, which `beta_fast` and `beta_slow` bound in rotations over the trained
context. transformers multiplies cos and sin by an attention factor: mscale(factor, mscale) / mscale(factor,
mscale_all_dim) when both are given (1 for DeepSeek-V3, whose two are equal), else mscale(factor).
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


__all__ = ["yarn_attention_factor", "yarn_inv_freq", "yarn_mscale"]
