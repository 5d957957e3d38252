"""Tensor-parallel building blocks: collectives with their autograd duals, shard layouts, sharded layers.

A column-parallel linear splits its output features over the tp ranks, a
row-parallel linear its input features; a column-parallel layer followed by a
row-parallel one needs one collective in forward and one in backward.

Between those pairs the hidden states (batch, seq, hidden) are either
replicated on every tp rank, or, with sequence parallelism, split along the
sequence (dim 1). The collectives and their backward duals:

    column input, replicated:    identity      / all-reduce      (copy_to_tp)
    row output,   replicated:    all-reduce    / identity        (reduce_from_tp)
    column input, sequence split: all-gather   / reduce-scatter  (gather_sequence)
    row output,   sequence split: reduce-scatter / all-gather    (reduce_scatter_sequence)

With `group=None` every collective is the identity, so the layers also run in
one process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from ..models.transformer import IGNORE_INDEX, VocabShard
from .mesh import all_gather_flat as _all_gather
from .mesh import all_reduce as _all_reduce
from .mesh import group_size as tp_size
from .mesh import reduce_scatter_flat as _reduce_scatter

SEQ_DIM = 1


def _gather_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate the ranks' sequence shards along dim 1 (collectives work on dim 0: transpose there)."""
    n = tp_size(group)
    if n == 1:
        return x
    shard = x.transpose(0, SEQ_DIM).contiguous()
    out = shard.new_empty((n * shard.shape[0], *shard.shape[1:]))
    _all_gather(out, shard, group=group)
    return out.transpose(0, SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the ranks, keep this rank's 1/tp of the sequence."""
    if group is None or tp_size(group) == 1:
        return x
    out, pending = _reduce_scatter_seq_async(x, group)
    pending.wait()
    return out


def _reduce_scatter_seq_async(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """_reduce_scatter_seq started without waiting: (this rank's shard, the handle to wait on)."""
    n = tp_size(group)
    full = x.transpose(0, SEQ_DIM).contiguous()
    if full.shape[0] % n:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by tp={n} (sequence parallelism)")
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    return out.transpose(0, SEQ_DIM), _reduce_scatter(out, full, group=group, async_op=True)


class _ColumnParallelMatmul(Function):
    """gather/copy -> x W^T + b, whose backward hides the input gradient's collective behind the weight gradient.

    Backward computes the input gradient first, starts its reduce-scatter (sequence parallel) or all-reduce,
    computes the weight and bias gradients while it runs, then waits. Same arithmetic as F.linear's backward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        x_full = _gather_seq(x, group) if sequence_parallel else x
        ctx.save_for_backward(x_full, weight)
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        return F.linear(x_full, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_full, weight = ctx.saved_tensors
        grad_x = pending = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ weight
            if ctx.sequence_parallel:
                grad_x, pending = _reduce_scatter_seq_async(grad_x, ctx.group)
            else:
                pending = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = grad_2d.t() @ x_full.reshape(-1, x_full.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if pending is not None:
            pending.wait()
        return grad_x, grad_w, grad_b, None, None


class _CopyToTP(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone(memory_format=torch.contiguous_format)
        return _all_reduce(out, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterSequence(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if tp_size(group) > 1 else x


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if tp_size(group) > 1 else x


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _GatherSequence.apply(x, group) if tp_size(group) > 1 else x


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _ReduceScatterSequence.apply(x, group) if tp_size(group) > 1 else x


def to_parallel_input(x: torch.Tensor, group: dist.ProcessGroup | None, sequence_parallel: bool) -> torch.Tensor:
    """The input of a column-parallel layer: the whole sequence, with gradients summed over the tp ranks."""
    return gather_sequence(x, group) if sequence_parallel else copy_to_tp(x, group)


def from_parallel_output(x: torch.Tensor, group: dist.ProcessGroup | None, sequence_parallel: bool) -> torch.Tensor:
    """The output of a row-parallel layer (partial sums): summed, and split along the sequence under SP."""
    return reduce_scatter_sequence(x, group) if sequence_parallel else reduce_from_tp(x, group)


# ---- which part of a full tensor each rank holds ---------------------------------------------------


class ShardLayout:
    """Along `dim`, local position i of rank r holds full index `indices[r][i]` (-1: padding, not in the full tensor).

    A full index may be held by several ranks (replicated KV heads); the first
    (lowest tp rank) holder is its owner, which counts it in the grad norm.
    """

    def __init__(
        self, dim: int, full_size: int, indices: list[torch.Tensor], tp_rank: int, group: dist.ProcessGroup | None
    ):
        self.dim, self.full_size, self.group, self.tp_rank = dim, full_size, group, tp_rank
        self.tp = len(indices)
        self.local_size = len(indices[0])
        if any(len(ix) != self.local_size for ix in indices):
            raise ValueError("every tp rank must hold the same number of rows")
        concat = torch.cat(indices)
        self.local_index = indices[tp_rank].long()
        real = self.local_index >= 0
        self.real_positions = real.nonzero().flatten()
        self.real_full_index = self.local_index[real]
        # Position in the rank-concatenated tensor of each full index's owner (the first holder).
        first = torch.full((full_size,), -1, dtype=torch.long)
        positions = torch.arange(len(concat))
        held = concat >= 0
        first.scatter_reduce_(0, concat[held], positions[held], reduce="amin", include_self=False)
        if (first < 0).any():
            raise ValueError("a shard layout must cover every full index")
        self.gather_index = first
        holders = torch.bincount(concat[held], minlength=full_size)
        replicated = holders > 1
        # Local positions whose row other ranks also hold, and their index among all replicated full rows.
        local_replicated = real.clone()
        local_replicated[real] = replicated[self.real_full_index]
        self.replicated_positions = local_replicated.nonzero().flatten()
        slot_of_full = torch.cumsum(replicated.long(), 0) - 1
        self.replicated_slots = slot_of_full[self.local_index[self.replicated_positions]]
        self.num_replicated = int(replicated.sum())
        owner = first // self.local_size
        self.not_owned_positions = self.replicated_positions[
            owner[self.local_index[self.replicated_positions]] != tp_rank
        ]

    def local_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.dim] = self.local_size
        return tuple(shape)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of `full` (padding positions zero)."""
        out = full.new_zeros(self.local_shape(full.shape))
        source = full.index_select(self.dim, self.real_full_index.to(full.device))
        return out.index_copy_(self.dim, self.real_positions.to(full.device), source)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's part (a collective over the tp group), padding stripped."""
        if tp_size(self.group) > 1:
            local = local.contiguous()
            parts = [torch.empty_like(local) for _ in range(self.tp)]
            dist.all_gather(parts, local, group=self.group)
            concat = torch.cat(parts, self.dim)
        elif self.tp == 1:
            concat = local
        else:
            raise RuntimeError("gathering a tensor-parallel shard needs the tp process group")
        return concat.index_select(self.dim, self.gather_index.to(local.device))

    def norm_exclude_ranges(self, full_shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """Flat element ranges of the local tensor that another rank counts in the grad norm."""
        if len(self.not_owned_positions) == 0:
            return []
        if self.dim != 0:
            raise ValueError("replicated rows are only supported along dim 0")
        row = 1
        for s in full_shape[1:]:
            row *= s
        ranges: list[tuple[int, int]] = []
        for pos in self.not_owned_positions.tolist():
            lo, hi = pos * row, (pos + 1) * row
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
        return ranges


def contiguous_layout(dim: int, full_size: int, tp: int, tp_rank: int, group: dist.ProcessGroup | None) -> ShardLayout:
    """Rank r holds the r-th 1/tp of the indices."""
    if full_size % tp:
        raise ValueError(f"{full_size} rows or columns cannot be split evenly over tp={tp}")
    n = full_size // tp
    return ShardLayout(dim, full_size, [torch.arange(r * n, (r + 1) * n) for r in range(tp)], tp_rank, group)


# ---- layers ------------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local, W_local = the rows of W this rank holds (`layout`, along dim 0)."""

    def __init__(
        self,
        in_features: int,
        layout: ShardLayout,
        bias: bool,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.in_features, self.layout = in_features, layout
        self.group, self.sequence_parallel = group, sequence_parallel
        self.overlap_backward = True  # False: plain gather/copy + F.linear (for A/B measurement)
        # (x, weight, bias) -> the output of the local shard; fp8.apply_fp8 installs FP8's
        self.linear: Callable[..., torch.Tensor] = F.linear
        self.weight = nn.Parameter(torch.empty(layout.local_size, in_features, device=device, dtype=dtype))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(layout.local_size, device=device, dtype=dtype))

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """The full shapes of the parameters `layout` splits (tensor.tensor_parallel_specs)."""
        shapes: dict[str, tuple[int, ...]] = {"weight": (self.layout.full_size, self.in_features)}
        if self.bias is not None:
            shapes["bias"] = (self.layout.full_size,)
        return shapes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size(self.group) == 1:
            return self.linear(x, self.weight, self.bias)
        if not self.overlap_backward or self.linear is not F.linear:
            # FP8's matmul has its own backward, so its input gradient's collective is not overlapped
            return self.linear(to_parallel_input(x, self.group, self.sequence_parallel), self.weight, self.bias)
        return _ColumnParallelMatmul.apply(x, self.weight, self.bias, self.group, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out_local={self.layout.local_size}, out_full={self.layout.full_size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_local W_local^T, + b (replicated, added once after the reduction)."""

    def __init__(
        self,
        out_features: int,
        layout: ShardLayout,
        bias: bool,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if layout.dim != 1:
            raise ValueError("a row-parallel linear splits its weight along dim 1 (input features)")
        self.out_features, self.layout = out_features, layout
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, layout.local_size, device=device, dtype=dtype))
        # Replicated; under sequence parallelism added on sequence shards (tensor_parallel_specs marks it).
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        # (x, weight) -> the partial output of the local shard; fp8.apply_fp8 installs FP8's
        self.linear: Callable[..., torch.Tensor] = F.linear

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """The full shapes of the parameters `layout` splits (the bias is replicated)."""
        return {"weight": (self.out_features, self.layout.full_size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = from_parallel_output(self.linear(x, self.weight), self.group, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_local={self.layout.local_size}, in_full={self.layout.full_size}, out={self.out_features}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous range of the (padded) vocabulary; other ids contribute zeros, summed over ranks."""

    def __init__(
        self,
        layout: ShardLayout,
        hidden_size: int,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.layout, self.group, self.sequence_parallel = layout, group, sequence_parallel
        self.vocab_start = layout.tp_rank * layout.local_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(layout.local_size, hidden_size, device=device, dtype=dtype))

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """The full shape of the vocabulary rows `layout` splits."""
        return {"weight": (self.layout.full_size, self.hidden_size)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.layout.local_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return from_parallel_output(out, self.group, self.sequence_parallel)


# ---- loss and prediction over vocabulary shards ------------------------------------------------


class _VocabParallelCrossEntropy(Function):
    """Per-token cross-entropy from logits split over the vocabulary; never builds the full logits."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, num_real, group):
        x = logits.float()
        if num_real < x.shape[-1]:  # padding columns: never predicted
            x = x.clone()
            x[..., num_real:] = float("-inf")
        row_max = x.max(dim=-1).values
        _all_reduce(row_max, group, dist.ReduceOp.MAX)
        shifted = x - row_max.unsqueeze(-1)
        local_label = labels - vocab_start
        here = (local_label >= 0) & (local_label < num_real)
        local_label = local_label.masked_fill(~here, 0)
        target = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        probs = shifted.exp_()  # shifted is a fresh tensor
        sum_exp = probs.sum(dim=-1)
        both = torch.stack([sum_exp, target])  # one collective for the two sums
        _all_reduce(both, group)
        sum_exp, target = both[0], both[1]
        valid = labels != IGNORE_INDEX
        loss = (sum_exp.log() - target).masked_fill(~valid, 0.0)
        probs.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, local_label, here & valid, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        probs, local_label, target_here, valid = ctx.saved_tensors
        grad = probs  # softmax - one_hot, in place: this graph node runs backward once
        grad.scatter_add_(-1, local_label.unsqueeze(-1), -target_here.unsqueeze(-1).to(grad.dtype))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


class VocabParallelCrossEntropy:
    """The per-token loss under tensor parallelism: (this rank's logits shard, full labels) -> fp32 loss per token
    (the language-model objective holds it)."""

    def __init__(self, shard: VocabShard):
        self.shard = shard

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = self.shard
        return _VocabParallelCrossEntropy.apply(logits, labels, s.start, s.num_real, s.group)


@torch.no_grad()
def vocab_argmax(logits: torch.Tensor, shard: VocabShard | None) -> torch.Tensor:
    """The argmax over the whole vocabulary, from this rank's logits shard under tensor parallelism (`shard`; ties:
    the lowest id), else from the whole logits."""
    if shard is None:
        return logits.argmax(-1)
    x = logits.float()
    if shard.num_real < x.shape[-1]:
        x = x.clone()
        x[..., shard.num_real :] = float("-inf")
    value, index = x.max(dim=-1)
    index = index + shard.start
    n = tp_size(shard.group)
    if n == 1:
        return index
    values = [torch.empty_like(value) for _ in range(n)]
    indices = [torch.empty_like(index) for _ in range(n)]
    dist.all_gather(values, value.contiguous(), group=shard.group)
    dist.all_gather(indices, index.contiguous(), group=shard.group)
    best = torch.stack(values, -1).argmax(-1, keepdim=True)  # first maximum: the lowest rank, lowest id
    return torch.stack(indices, -1).gather(-1, best).squeeze(-1)


@torch.no_grad()
def gather_vocab(logits: torch.Tensor, shard: VocabShard | None) -> torch.Tensor:
    """The logits of the whole (unpadded) vocabulary on every rank, from each rank's shard under tensor parallelism
    (generation samples from them; the ranks' shards are contiguous ranges, padding last)."""
    if shard is None:
        return logits
    n = tp_size(shard.group)
    if n > 1:
        parts = [torch.empty_like(logits) for _ in range(n)]
        dist.all_gather(parts, logits.contiguous(), group=shard.group)
        logits = torch.cat(parts, -1)
    return logits[..., : shard.vocab_size]
