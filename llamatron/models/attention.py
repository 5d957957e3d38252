"""The attention core and its masks: which keys each query sees, built once per forward and shared by all layers.

One rule says what a query sees (`_keep`): keys at or before it, in its document when document ids are given,
within the sliding window when there is one, and in its own chunk of `chunk` tokens when the layer attends in
chunks (Llama 4's chunked local attention: positions [c·chunk, (c+1)·chunk) see only each other). It is applied
three ways:

- no mask at all for plain causal attention over the local sequence (the fastest kernels: cuDNN, FA4);
- on CUDA a flex-attention BlockMask, whose kernel skips the blocks the rule masks out; without document ids it
  depends only on the shape, so it is cached across steps (FA4 runs a plain window natively instead, when chosen);
- off CUDA a dense boolean mask for scaled_dot_product_attention: the reference the GPU paths are tested against;
- a slice of the keys for one query decoding after a KV cache (models/kv_cache.py): it sees a contiguous range;
- a range of slots of a static KV cache for batched decoding, one query per row at that row's own position
  (`decode_mask`; the attention in kernels/decode_attention_op.py, through `attend`): rows of different lengths, the
  step's shapes fixed (a CUDA graph replays it).

Context parallelism (parallel/context.py) gives each rank two chunks of every sequence (`load_balanced_index`)
and the whole sequence's keys; the rule then reads each query's index in the whole sequence. Queries after a KV cache
of `offset` tokens are at positions offset, offset + 1, ... and see the cached keys as a prefix, read the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from ..kernels.choices import SDPA_KERNELS
from ..kernels.decode_attention_op import decode_attention, decode_step_attention
from ..kernels.flash4_op import SUPPORTED_HEAD_DIMS, fa4_causal_attention
from .kv_cache import LayerKVCache

# --attention-backend's forced SDPA kernels (kernels/choices.py's SDPA_KERNELS, in that order).
_SDPA_BACKENDS = dict(
    zip(
        SDPA_KERNELS,
        (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
        strict=True,
    )
)
_ONE_WIDTH_BACKENDS = ("flash", "fa4")  # kernels whose queries, keys and values must be equally wide


def load_balanced_index(seq_len: int, size: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Indices in the whole sequence of the tokens context-parallel rank `rank` of `size` holds, in its order.

    The sequence is cut into 2*size chunks and rank r holds chunks r and 2*size-1-r: under a causal mask an early
    chunk has little to attend to and a late one much, so each rank gets the same attention work."""
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, last])


@dataclass(frozen=True)
class AttentionMask:
    """Which keys each query sees, in the form the kernel of this device runs: `block` (flex attention) on CUDA,
    `dense` (a boolean (batch or 1, 1, queries, keys) tensor) elsewhere. `window` is set when the mask is nothing
    but a sliding window over the local sequence, which FA4 runs without either. `first_key` is set for a single
    query (decoding after a KV cache), which sees the keys from that index on: a slice, no mask."""

    block: BlockMask | None = None
    dense: torch.Tensor | None = None
    window: int | None = None
    first_key: int | None = None
    rows: DecodeRows | None = None  # one query per row over a static KV cache (decode_mask)


def _keep(
    query_index: torch.Tensor | None, documents: torch.Tensor | None, window: int | None, chunk: int | None = None
) -> Callable:
    """The rule as a flex-attention mask_mod: does query q (of batch row b) see key kv?"""

    def keep(b, h, q, kv):
        qi = q if query_index is None else query_index[q]
        out = kv <= qi
        if documents is not None:
            out = out & (documents[b, qi] == documents[b, kv])
        if window is not None:
            out = out & (qi - kv < window)
        if chunk is not None:
            out = out & (qi // chunk == kv // chunk)
        return out

    return keep


def dense_mask(rule: Callable, batch: int, queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """flex_attention.create_mask(rule, batch, 1, queries, keys): the (batch, 1, queries, keys) boolean mask, from
    the rule applied once to broadcast index tensors instead of through vmap, whose import of torch._dynamo cost
    1.5 s of CPU in every process that built a mask on CPU."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(queries, device=device).view(1, 1, -1, 1)
    kv = torch.arange(keys, device=device).view(1, 1, 1, -1)
    return rule(b, h, q, kv).expand(batch, 1, queries, keys).contiguous()


_CACHE: dict[tuple, AttentionMask] = {}  # masks without document ids: they depend on the shape alone
_CACHE_SIZE = 16


def attention_mask(
    seq_len: int,
    window: int | None,
    document_ids: torch.Tensor | None,
    device: torch.device,
    context: tuple[int, int] = (1, 0),
    flex: bool | None = None,
    offset: int = 0,
    chunk: int | None = None,
) -> AttentionMask | None:
    """The mask of one forward over `seq_len` local queries (None: plain causal attention, no mask needed).

    document_ids: (batch, whole sequence) ids, equal within a document; under context parallelism they cover the
    whole sequence (the keys), not only this rank's queries. context: (cp size, cp rank). flex: build a BlockMask
    (default: on CUDA), else a dense mask. offset: tokens in a KV cache before these queries (none with document
    ids or context parallelism). chunk: attend within chunks of this many tokens (None: no chunks)."""
    if offset:
        if document_ids is not None or context != (1, 0):
            raise ValueError("a KV cache offset works without document ids and context parallelism only")
        return _mask_after_cache(seq_len, offset, window, device, flex, chunk)
    size, rank = context
    keys = seq_len * size
    if window is not None and window >= keys:
        window = None  # a window as long as the sequence is plain causal attention
    if chunk is not None and chunk >= keys:
        chunk = None  # one chunk: plain causal attention
    if document_ids is None and size == 1 and window is None and chunk is None:
        return None
    flex = device.type == "cuda" if flex is None else flex
    key = (seq_len, window, chunk, str(device), size, rank, flex)
    if document_ids is None and key in _CACHE:
        return _CACHE[key]
    query_index = load_balanced_index(keys, size, rank, device) if size > 1 else None
    rule = _keep(query_index, document_ids, window, chunk)
    batch = None if document_ids is None else document_ids.shape[0]
    if flex:
        # _compile builds the block structure without materialising a (queries, keys) mask.
        block = create_block_mask(rule, batch, None, seq_len, keys, device=device, _compile=device.type == "cuda")
        mask = AttentionMask(block=block)
    else:
        mask = AttentionMask(dense=dense_mask(rule, batch or 1, seq_len, keys, device))
    if document_ids is None and size == 1 and chunk is None:
        mask = AttentionMask(mask.block, mask.dense, window)
    if document_ids is None:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = mask
    return mask


def _mask_after_cache(
    seq_len: int, offset: int, window: int | None, device: torch.device, flex: bool | None, chunk: int | None
) -> AttentionMask:
    """Queries at positions [offset, offset + seq_len) over the keys [0, offset + seq_len)."""
    keys = offset + seq_len
    if seq_len == 1:  # the rule for one query: every key up to it, within the window or its chunk
        first = 0 if window is None else max(0, keys - window)
        return AttentionMask(first_key=first if chunk is None else (keys - 1) // chunk * chunk)
    rule = _keep(torch.arange(offset, keys, device=device), None, window, chunk)
    if device.type == "cuda" if flex is None else flex:
        return AttentionMask(block=create_block_mask(rule, None, None, seq_len, keys, device=device))
    return AttentionMask(dense=dense_mask(rule, 1, seq_len, keys, device))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, **kwargs: Any) -> torch.Tensor:
    """scaled_dot_product_attention, restricted to a forced kernel for this call only. torch.compile traces
    sdpa_kernel into the layer's graph (no graph break), so a compiled graph, and its cache key, hold the kernel
    it runs. auto takes no context manager: SDPA's own pick, as fast as a bare call."""
    if backend not in _SDPA_BACKENDS:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(_SDPA_BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


_compiled_flex_attention = None


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, gqa: bool) -> torch.Tensor:
    """flex_attention compiled once on CUDA (eager flex attention materialises the full score matrix)."""
    global _compiled_flex_attention
    from torch.nn.attention.flex_attention import flex_attention as flex

    if not q.is_cuda or torch.compiler.is_compiling():
        # CPU: the eager reference implementation (tests, tiny shapes); inside a compiled layer the
        # layer's own compilation turns it into a fused kernel.
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex, dynamic=False)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def _fa4_runs(q: torch.Tensor, backend: str) -> bool:
    half = q.dtype in (torch.bfloat16, torch.float16)
    return backend == "fa4" and q.is_cuda and half and q.shape[-1] in SUPPORTED_HEAD_DIMS


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask | None = None,
    cache: LayerKVCache | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The attention every attention module calls (as its replaceable `core`: selective recompute and context
    parallelism wrap it), whatever kernel runs: q (batch, heads, queries, dk), k (batch, kv heads, keys, dk), v
    (batch, kv heads, keys, dv) -> (batch, heads, queries, dv). cache: the layer's KV cache, which k/v join first.

    Which kernel runs is the mask's, the cache's and the backend's (one of ATTENTION_BACKENDS) to say, not the
    module's: a decoding step over a static cache's rows (`decode_mask`) runs kernels/decode_attention_op.py (its
    Triton kernel on CUDA, which writes the new key and value into `cache` itself; without a cache k/v are the whole
    cache already); every other mask `attention_core` (FA4, flex, SDPA's kernels)."""
    if mask is not None and mask.rows is not None:
        if cache is None:
            return decode_attention(q, k, v, mask.rows.bias())
        return decode_step_attention(q, k, v, cache, mask.rows)
    if cache is not None:
        k, v = cache.append(k, v)
    return attention_core(q, k, v, mask, backend)


def attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Attention over (batch, heads, queries, head_dim) with the keys `mask` allows (None: causal); k/v may have
    fewer heads (GQA/MQA) and, under context parallelism or after a KV cache, more positions than q; v may be
    narrower or wider than q/k (multi-head latent attention): under the kernels that want one width (SDPA's flash,
    FA4) the narrower side is zero-padded (zero columns change no score and no output) and the output cut back.
    backend: one of ATTENTION_BACKENDS (the layer's choice)."""
    if mask is not None and mask.rows is not None:
        raise ValueError("a decoding step's attention runs in models/attention.py's attend, with its KV cache")
    dq, dv = q.shape[-1], v.shape[-1]
    if dq == dv or backend not in _ONE_WIDTH_BACKENDS:
        return _kernel(q, k, v, mask, backend)
    d = max(dq, dv)
    if d > dq:  # wider values: zero query/key columns add nothing; the kernel's 1/sqrt(d) is undone on q
        q, k = F.pad(q, (0, d - dq)) * math.sqrt(d / dq), F.pad(k, (0, d - dq))
    return _kernel(q, k, F.pad(v, (0, d - dv)), mask, backend)[..., :dv]


def _kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None, backend: str
) -> torch.Tensor:
    """attention_core once q, k and v are as wide as the backend needs."""
    gqa = q.shape[1] != k.shape[1]
    if gqa and backend == "efficient":  # the memory-efficient kernel has no grouped-query (GQA) support
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        gqa = False
    if mask is not None and mask.first_key is not None:
        return _sdpa(q, k[:, :, mask.first_key :], v[:, :, mask.first_key :], backend, enable_gqa=gqa)
    if mask is None or (mask.window is not None and _fa4_runs(q, backend)):
        if _fa4_runs(q, backend):
            # FA4 works on (batch, seq, heads, dim): the transposes below are views of the projection's layout.
            window = None if mask is None else mask.window
            out = fa4_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window)
            return out.transpose(1, 2)
        return _sdpa(q, k, v, backend, is_causal=True, enable_gqa=gqa)
    if mask.block is not None:
        return flex_attention(q, k, v, mask.block, gqa)
    return _sdpa(q, k, v, backend, attn_mask=mask.dense, enable_gqa=gqa)


def decode_mask(
    positions: torch.Tensor, keys: int, window: int | None, dtype: torch.dtype, chunk: int | None = None
) -> AttentionMask:
    """One query per batch row, at that row's own position `positions[b]`, over a static KV cache of `keys` slots
    (batched decoding of prompts of different lengths). Device ops only, no host read: a CUDA graph replays it
    with new positions."""
    return AttentionMask(rows=DecodeRows(positions, keys, window, chunk, dtype))


class DecodeRows:
    """The keys each row's one query sees over a static KV cache, by the same rule as every mask (`_keep`): a
    contiguous range of slots, [lo, positions[b]] (kernels/decode_attention_op.py's kernel reads it so), or as the
    additive bias (batch, 1, keys) of 0 and -inf the torch path adds to the scores (built at its first use)."""

    def __init__(self, positions: torch.Tensor, keys: int, window: int | None, chunk: int | None, dtype: torch.dtype):
        self.positions, self.keys, self.window, self.chunk, self.dtype = positions, keys, window, chunk, dtype
        self._bias: torch.Tensor | None = None

    def bias(self) -> torch.Tensor:
        if self._bias is None:
            key_index = torch.arange(self.keys, device=self.positions.device)
            seen = _keep(None, None, self.window, self.chunk)(None, None, self.positions[:, None], key_index)
            bias = torch.zeros(seen.shape, dtype=self.dtype, device=self.positions.device)
            self._bias = bias.masked_fill(~seen, float("-inf"))[:, None, :]
        return self._bias
