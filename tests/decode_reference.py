"""The torch ops a decoding step's attention kernel replaces (kernels/decode_attention_op.py), the reference its
CPU (interpreted) and GPU tests compare it with."""

from __future__ import annotations

import torch

from llamatron.kernels.decode_attention_op import decode_attention
from llamatron.models.attention import DecodeRows


def torch_step(q, k_new, v_new, keys, values, positions, window, chunk):
    """(output in fp32, keys, values after the step): the new k/v scattered into each row's slot (copies), then
    softmax attention over the slots the rows see."""
    keys, values = keys.clone(), values.clone()
    slot = positions.view(-1, 1, 1, 1).expand(k_new.shape)
    keys.scatter_(2, slot, k_new)
    values.scatter_(2, slot, v_new)
    bias = DecodeRows(positions, keys.shape[2], window, chunk, torch.float32).bias()
    return decode_attention(q.float(), keys.float(), values.float(), bias), keys, values
