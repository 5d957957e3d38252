"""The keys and values of the tokens a model has already run, so decoding runs one new token per step.

`Transformer.forward(inputs, cache=cache)` runs `inputs` as the tokens that follow the cached ones. A layer's
buffers are allocated at its first append, for `max_length` tokens, with the shape of that layer's keys (under
tensor parallelism each rank holds the cache of its own KV heads), and never move afterwards: their shapes and
addresses stay fixed, so a decoding step that reads and writes them can be captured once in a CUDA graph.

Two ways to fill it:

- aligned: every row holds `length` tokens; the inputs' positions start at `length`, each attention layer writes
  their keys and values after the cached ones and attends to all of them (the cached tokens are a prefix every new
  query may see, within a sliding window where there is one: models/attention.py), and the length then grows by
  the number of inputs. The prefill of a batch is this, from length 0.
- per row (`continue_rows`): after a prefill of right-padded prompts of different lengths, row b's next token is
  at its own position `positions[b]` (its prompt's length at first). A step then runs one token per row: each
  layer writes its key and value into slot positions[b] of row b, the query attends to the slots up to it (a
  per-row mask: the padding after a shorter prompt, which the row's later tokens overwrite, is never seen) and
  the positions advance on the device. Nothing is read on the host, so a CUDA graph replays the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class LayerKVCache:
    """One attention layer's cached keys and values, (batch, kv heads, max_length, head_dim)."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' k/v (batch, kv heads, new, head_dim) after the cached ones; return the keys and
        values the queries attend to: all cached ones (per row: every slot, the mask says which)."""
        keys, values = self.buffers_like(k, v)
        positions = self.owner.positions
        if self.owner.per_row and positions is not None:
            slot = positions.view(-1, 1, 1, 1).expand(k.shape)  # (batch, kv heads, 1, head_dim): slot b of row b
            keys.scatter_(2, slot, k)
            values.scatter_(2, slot, v)
            return keys, values
        start = self.owner.length
        end = start + k.shape[2]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        if start == 0:  # a prefill: the queries see these keys only, the very tensors the training path runs on
            return k, v
        return keys[:, :, :end], values[:, :, :end]

    def buffers_like(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole buffers (batch, kv heads, max_length, head_dim), allocated at the first call from the new
        tokens' k/v; a decoding step's kernel (kernels/decode_attention_op.py) writes its slot in them itself."""
        if self.keys is None or self.values is None:
            shape = (k.shape[0], k.shape[1], self.owner.max_length, k.shape[3])
            # zeros: a per-row step reads every slot (masked, times a zero weight), so none may hold NaN or inf
            self.keys, self.values = k.new_zeros(shape), v.new_zeros(shape)
        return self.keys, self.values


class KVCache:
    """Every decoder layer's cached keys and values, for up to `max_length` tokens of one batch."""

    def __init__(self, max_length: int):
        if max_length < 1:
            raise ValueError(f"a KV cache of max_length={max_length}: must be >= 1")
        self.max_length = max_length
        self.length = 0  # aligned: tokens cached so far in every row, the position of the next input
        self.per_row = False  # positions per row (continue_rows) instead of `length`
        self.positions: torch.Tensor | None = None  # per row: (batch,) each row's next position, on the device
        self._layers: dict[str, Any] = {}

    def layer(self, name: str, kind: Callable[[KVCache], Any] | None = None) -> Any:
        """Layer `name`'s cache, made at its first use by `kind` (a layer's attention may keep another form than
        keys and values: its `cache_kind`; default LayerKVCache)."""
        if name not in self._layers:
            self._layers[name] = (LayerKVCache if kind is None else kind)(self)
        return self._layers[name]

    def check_room(self, new_tokens: int) -> None:
        """Aligned only: per row, the positions live on the device and the caller bounds them (inference/decode.py)."""
        if not self.per_row and self.length + new_tokens > self.max_length:
            raise ValueError(
                f"KV cache full: {self.length} cached + {new_tokens} new tokens > max_length {self.max_length}"
            )

    def continue_rows(self, lengths: torch.Tensor) -> None:
        """From now on row b continues at position lengths[b] (after a right-padded prefill of prompts of those
        lengths), one token per row and step. The positions are copied into the same device tensor every time, so
        a captured step keeps reading them."""
        if self.positions is None or self.positions.shape != lengths.shape:
            self.positions = torch.empty_like(lengths, dtype=torch.long)
        self.positions.copy_(lengths)
        self.per_row = True
        self.length = 0  # unused per row (and not a value a compiled step should specialise on)

    def advance(self, new_tokens: int) -> None:
        """Count the tokens every layer has just appended (Transformer.forward, after its last layer)."""
        if self.per_row and self.positions is not None:
            self.positions.add_(new_tokens)  # on the device: a replayed graph advances them too
        else:
            self.length += new_tokens

    def reset(self) -> None:
        """Forget every token (the buffers stay allocated): the next forward starts again at position 0, aligned."""
        self.length = 0
        self.per_row = False
