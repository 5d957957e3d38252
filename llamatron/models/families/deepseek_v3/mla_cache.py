"""The decode cache of multi-head latent attention, kept compressed: per token and layer only the normalised latent
(kv_lora_rank) and the rotated rotary key (qk_rope_head_dim), whatever the number of heads. DeepSeek-V3: 512 + 64
values a token and layer, where full keys and values would take 128 heads x (192 + 128).

It mirrors models/kv_cache.py's LayerKVCache (same owner, `KVCache`, with its length, per-row positions and
max_length; the same two ways to fill it, aligned and per row), so a model's KVCache can hand it to the MLA layers:
`append` stores the new tokens and returns what the queries attend to, here the absorbed form (mla.py) — the keys
[latent; rotary key] and the values, the latent, both views of the one buffer (batch, 1, max_length, kv_lora_rank +
qk_rope_head_dim), allocated at the first append and never moved (a captured decoding step keeps its addresses).
"""

from __future__ import annotations

import torch

from ...kv_cache import KVCache


class MLACache:
    """One MLA layer's cached latents and rotary keys."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.buffer: torch.Tensor | None = None  # (batch, 1, max_length, kv_lora_rank + qk_rope_head_dim)

    @property
    def length(self) -> int:
        """Tokens cached before the next input (aligned; per row each row has its own, `owner.positions`)."""
        return self.owner.length

    def first_fill(self) -> bool:
        """The next append is a prefill: no token before it (aligned, empty)."""
        return not self.owner.per_row and self.owner.length == 0

    def append(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' latent (batch, 1, new, kv_lora_rank) and rotated rotary key (batch, 1, new,
        qk_rope_head_dim) after the cached ones; return the keys (batch, 1, tokens, kv_lora_rank + qk_rope_head_dim)
        and values (batch, 1, tokens, kv_lora_rank) of every cached token (per row: every slot, the mask says which)."""
        new = torch.cat([latent, k_pe], dim=-1)
        buffer = self._buffer_like(new)
        rank = latent.shape[-1]
        positions = self.owner.positions
        if self.owner.per_row and positions is not None:
            slot = positions.view(-1, 1, 1, 1).expand(new.shape)  # one token per row, at that row's position
            buffer.scatter_(2, slot, new)
            return buffer, buffer[..., :rank]
        start = self.owner.length
        end = start + new.shape[2]
        buffer[:, :, start:end] = new
        return buffer[:, :, :end], buffer[:, :, :end, :rank]

    def _buffer_like(self, new: torch.Tensor) -> torch.Tensor:
        if self.buffer is None:
            # zeros: a per-row step reads every slot (masked), so none may hold NaN or inf
            self.buffer = new.new_zeros((new.shape[0], 1, self.owner.max_length, new.shape[-1]))
        return self.buffer


__all__ = ["MLACache"]
