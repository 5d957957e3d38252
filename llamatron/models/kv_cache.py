"""The keys and values of the tokens a model has already run, so decoding runs one new token per step.

`Transformer.forward(inputs, cache=cache)` runs `inputs` as the tokens that follow the `cache.length` cached
ones: their positions start at `cache.length`, each attention layer appends its new keys and values to its
own part of the cache and attends to all of them (the cached tokens are a prefix every new query may see,
within a sliding window where there is one: models/attention.py), and the length then grows by the number
of inputs. A layer's buffers are allocated at its first append, for `max_length` tokens, with the shape of
that layer's keys: under tensor parallelism each rank holds the cache of its own KV heads.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """One attention layer's cached keys and values, (batch, kv heads, max_length, head_dim)."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' k/v (batch, kv heads, new, head_dim) after the cached ones; return all of them."""
        start = self.owner.length
        end = start + k.shape[2]
        if self.keys is None or self.values is None:
            shape = (k.shape[0], k.shape[1], self.owner.max_length, k.shape[3])
            self.keys, self.values = k.new_empty(shape), v.new_empty(shape)
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Every decoder layer's cached keys and values, for up to `max_length` tokens of one batch."""

    def __init__(self, max_length: int):
        if max_length < 1:
            raise ValueError(f"a KV cache of max_length={max_length}: must be >= 1")
        self.max_length = max_length
        self.length = 0  # tokens cached so far: the position of the next input
        self._layers: dict[str, LayerKVCache] = {}

    def layer(self, name: str) -> LayerKVCache:
        if name not in self._layers:
            self._layers[name] = LayerKVCache(self)
        return self._layers[name]

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.max_length:
            raise ValueError(
                f"KV cache full: {self.length} cached + {new_tokens} new tokens > max_length {self.max_length}"
            )

    def advance(self, new_tokens: int) -> None:
        """Count the tokens every layer has just appended (Transformer.forward, after its last layer)."""
        self.length += new_tokens

    def reset(self) -> None:
        """Forget every token (the buffers stay allocated): the next forward starts again at position 0."""
        self.length = 0
