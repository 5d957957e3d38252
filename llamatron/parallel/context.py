"""Context parallelism (--cp N): N ranks share the weights and split every sequence.

Split: the sequence is cut into 2N chunks and rank r holds chunks r and 2N-1-r (models/attention.py's
`load_balanced_index`), so under a causal mask every rank has the same attention work. Rotary positions stay the
global ones (the split takes them along, or the model derives them from the same index), and document ids are
kept whole: they say which keys each query may see.

Attention: every layer all-gathers K and V over the cp ranks (backward: a reduce-scatter of their gradients)
and attends this rank's queries to the whole sequence's keys, with the mask of its query positions. Why an
all-gather and not a ring: it is what Llama 3 was trained with (its paper, section 3.3.2). Every mask kind
(causal, document masks, sliding windows, any combination) is one mask over the whole key sequence, run by the
same kernels as without cp (flex attention skips the blocks a mask removes), where a ring needs its own
partial-softmax merge for each kind and each step's visible blocks. With GQA, K and V are num_kv_heads /
num_heads of Q's size, so the gather moves little next to the attention work. It does not overlap the gather
with the local block's attention; a measured comparison with a ring needs several GPUs (the multi-GPU issues).

Everything else sees a sequence of seq/cp tokens: sequence parallelism shards that further over tp, pipeline
stages send (micro-batch, seq/cp/tp-shards, hidden) activations, the loss sums this rank's tokens (divided by
the global batch's token count), and gradients are reduced over dp x cp (mesh.replica_group).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..models.attention import AttentionMask, load_balanced_index
from ..models.kv_cache import LayerKVCache
from ..models.transformer import Transformer
from .mesh import Mesh
from .tensor_layers import gather_sequence


def context_problems(seq_length: int, cp: int, sequence_shards: int = 1) -> list[str]:
    """Why sequences of `seq_length` cannot be split over `cp` ranks, each part further into `sequence_shards`
    (sequence parallelism's tp); empty when they can."""
    if cp < 1:
        return ["--cp must be >= 1"]
    if cp > 1 and seq_length % (2 * cp):
        return [
            f"--seq-length {seq_length} must be divisible by 2*cp = {2 * cp} (each context-parallel rank holds "
            "two chunks of every sequence)"
        ]
    if (seq_length // cp) % sequence_shards:
        part = "" if cp == 1 else f" / cp = {seq_length // cp} tokens per context-parallel rank"
        return [f"--seq-length {seq_length}{part} must be divisible by tp={sequence_shards} with --sequence-parallel"]
    return []


def split_for_context(mb: dict[str, torch.Tensor], cp: int, cp_rank: int) -> dict[str, torch.Tensor]:
    """This rank's part of micro-batch `mb`: its tokens, labels and rotary positions; document ids stay whole, and
    the whole sequence's tokens and labels are kept beside them (`whole_input_ids`, `whole_labels`: a family's
    extra heads read the tokens and labels k places ahead, which may lie on another rank)."""
    if cp == 1:
        return mb
    batch, seq = mb["input_ids"].shape
    index = load_balanced_index(seq, cp, cp_rank)
    out: dict[str, torch.Tensor] = {k: mb[k][:, index] for k in ("input_ids", "labels", "position_ids") if k in mb}
    out.setdefault("position_ids", index.expand(batch, -1).contiguous())
    out.update({f"whole_{k}": mb[k] for k in ("input_ids", "labels") if k in mb})
    for key in ("document_ids", "ref_logps"):  # whole: the documents' ids, a sequence's reference log-prob (DPO)
        if key in mb:
            out[key] = mb[key]
    return out


def gather_keys(t: torch.Tensor, group: dist.ProcessGroup | None, cp: int) -> torch.Tensor:
    """(batch, heads, seq/cp, dim) keys or values of this rank -> the whole sequence's, in sequence order.
    Backward sums the ranks' gradients into each rank's own part (gather_sequence's reduce-scatter)."""
    gathered = gather_sequence(t.transpose(1, 2), group).transpose(1, 2)  # rank r's chunks r and 2cp-1-r, by rank
    chunks = gathered.chunk(2 * cp, dim=2)  # rank r's two chunks are 2r and 2r+1
    order = [2 * c for c in range(cp)] + [2 * (cp - 1 - j) + 1 for j in range(cp)]
    return torch.cat([chunks[i] for i in order], dim=2)


class ContextParallelCore:
    """An attention core that sees the whole sequence's keys: installed as `Attention.core`, around the core
    it replaces (so selective recompute, applied after, recomputes the gather too and keeps only local K/V)."""

    def __init__(self, inner: Callable[..., torch.Tensor], group: dist.ProcessGroup | None, cp: int):
        self.inner, self.group, self.cp = inner, group, cp

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: AttentionMask | None,
        cache: LayerKVCache | None,
        backend: str,
    ) -> torch.Tensor:
        k, v = gather_keys(k, self.group, self.cp), gather_keys(v, self.group, self.cp)
        return self.inner(q, k, v, mask, cache, backend)


def apply_context_parallel(model: Transformer, mesh: Mesh) -> None:
    """Make `model` (a Transformer or a pipeline chunk) run this rank's part of every sequence."""
    if mesh.layout.cp == 1:
        return
    model.parallel.context = (mesh.layout.cp, mesh.cp_rank)
    for module in model.modules():
        # Every attention layer, the shared one or a family's own (latent attention), keeps its kernel in a
        # replaceable `core` called with (q, k, v, mask, cache, backend); values narrower than keys gather as they are.
        core = getattr(module, "core", None)
        if callable(core):
            module.core = ContextParallelCore(core, mesh.cp_group, mesh.layout.cp)  # type: ignore[assignment]
