"""Tensor and sequence parallelism, applied to the plain model (docs/design.md, principle 1).

`apply_tensor_parallel` runs on the meta model, before anything is allocated,
and swaps layers for their parallel versions (tensor_layers.py) as each block
declares in its `tp_plan` (child -> style; models/layers.py, blocks.py, a
family's own blocks):

    qkv                 column-parallel: this rank's query heads and the KV heads they use (the module's
                        num_heads / num_kv_heads become the local counts)
    column              column-parallel: a contiguous slice of the outputs
    gate_up             column-parallel: the same slice of gate and of up, kept [gate; up] locally
    row                 row-parallel
    replicated_partial  kept whole; each rank's gradient is a partial sum (q/k norms: each rank's heads)
    replicated          kept whole, on whatever its module gives it (a sequence shard under sequence
                        parallelism: then, like a norm, its gradient is a partial sum); its output must reach
                        every rank's heads through a column-parallel layer or a declared parallel input
    embed               vocabulary-parallel embedding
    lm_head             column-parallel over the vocabulary; tied: the embedding shard is the head
    parallel.vocab      the rank's vocabulary shard, which the loss (VocabParallelCrossEntropy), the argmax
                        and generation's gather read: full logits never exist on a rank

A block may also declare `tp_parallel_inputs`: names of its attributes (tensor -> tensor, identity on one
device) that tensor parallelism sets to `to_parallel_input`, for a tensor every rank's heads read outside any
column-parallel layer (latent attention's shared rotary key): the whole sequence under sequence parallelism,
its gradient summed over the tp group.

It returns the chunk's parameter specs (param_spec.py): each sharded
parameter's spec holds its `tp_layout` and `full_shape` (the unpadded shape of
the single-device model); `spec.shard(full) -> local` serves init and
checkpoint load, `spec.gather(local) -> full` is a collective over the tp
group (every tp rank must call it in the same order).

Vocabulary padding. The embedding and head hold a vocabulary padded to a
multiple of 128 x tp (rank r: ids [r*V/tp, (r+1)*V/tp) of the padded range).
`ModelConfig.vocab_size` stays the real vocabulary: padding exists only in the
local shards. `shard` appends zero rows, `gather` strips them, so init,
checkpoints and exports see the unpadded tensors. Padding rows are never looked
up (ids < vocab_size), their logits are -inf in the loss and argmax, so their
gradient is zero and they stay zero.

KV heads when tp > num_kv_heads. Rank r holds KV head r // (tp / num_kv_heads):
a replica of the head its query heads use. Each replica's gradient covers only
its rank's query heads, so `sync_tensor_parallel_grads` sums it over the ranks
that hold it; the grad norm counts it on the lowest of them only
(`ParamSpec.norm_exclude`, read by the optimizer).

Sequence parallelism. Hidden states between layers are split along the
sequence (dim 1); norms run on shards; the embedding output is reduce-scattered;
column-parallel layers all-gather their input, row-parallel ones
reduce-scatter their output; the final norm's output is all-gathered before
the head. Replicated parameters used on shards (norm weights and biases,
row-parallel biases) get specs with `partial_grad`, as do replicated_partial
ones under any tensor parallelism: their per-rank
gradients are partial sums, added over the tp group by
`sync_tensor_parallel_grads`. The engine calls it after
`GradBuffer.finish_grad_sync()`, on the buffers' gradients (data-parallel and
tensor sums commute; one coalesced all-reduce per step instead of one per
parameter per micro-batch in a hook). With the distributed optimizer the parts
of a gradient this data-parallel rank does not own hold unreduced values;
summing them too is harmless, as nothing reads them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from functools import partial as partial_fn

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..models.config import ModelConfig
from ..models.moe import MoE
from ..models.transformer import Transformer, VocabShard
from .layout import divisors
from .mesh import Mesh
from .param_spec import ParamSpec, ParamSpecs, param_specs
from .tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardLayout,
    VocabParallelEmbedding,
    contiguous_layout,
    to_parallel_input,
    tp_size,
)

VOCAB_MULTIPLE = 128  # per tp rank: the vocabulary is padded to a multiple of 128 * tp


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    multiple = VOCAB_MULTIPLE * tp
    return -(-vocab_size // multiple) * multiple


def shard_numel(split: str, shape: tuple[int, ...], cfg: ModelConfig, tp: int) -> int:
    """Elements one tensor-parallel rank holds of a parameter of `shape` split as `split` (a block's tp_plan style,
    models/inventory.py's Weight.split): what apply_tensor_parallel leaves on each rank."""
    rest = 1
    for d in shape[1:]:
        rest *= d
    if split == "qkv":
        rows = (cfg.num_heads // tp + 2 * local_kv_heads(cfg.num_kv_heads, tp)) * cfg.head_dim
        return rows * rest
    if split in ("column", "gate_up"):
        return shape[0] // tp * rest
    if split == "row":
        return shape[0] * rest // tp
    if split == "expert":  # every expert's ffn split over tp (parallel/expert.py)
        return shape[0] * rest // tp
    return shape[0] * rest  # replicated


def tensor_parallel_problems(cfg: ModelConfig, tp: int, sequence_parallel: bool = False) -> list[str]:
    """Why `cfg` cannot be split over `tp` ranks, each with the sizes that would work (empty when it can)."""
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    out = ["--sequence-parallel needs --tp > 1"] if sequence_parallel and tp == 1 else []
    if heads % tp:
        out.append(f"num_attention_heads={heads} is not divisible by tp={tp}; use tp in {divisors(heads)}")
    if kv % tp and tp % kv:
        ok = [x for x in divisors(heads) if kv % x == 0 or x % kv == 0]
        out.append(f"num_kv_heads={kv} and tp={tp}: one must divide the other (tp in {ok})")
    if cfg.ffn_hidden_size % tp:
        out.append(f"ffn_hidden_size={cfg.ffn_hidden_size} is not divisible by tp={tp}")
    for name in ("dense_ffn_hidden_size", "shared_expert_ffn"):
        if getattr(cfg, name) % tp:
            out.append(f"{name}={getattr(cfg, name)} is not divisible by tp={tp}")
    return out


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    problems = tensor_parallel_problems(cfg, tp)
    if problems:
        raise ConfigError("; ".join(problems))


# ---- layouts -----------------------------------------------------------------------------------


def vocab_layout(vocab_size: int, tp: int, tp_rank: int, group: dist.ProcessGroup | None) -> ShardLayout:
    """Rows of the embedding / head: contiguous ranges of the padded vocabulary, ids >= vocab_size are padding."""
    per_rank = padded_vocab_size(vocab_size, tp) // tp
    indices = []
    for r in range(tp):
        ids = torch.arange(r * per_rank, (r + 1) * per_rank)
        indices.append(torch.where(ids < vocab_size, ids, torch.full_like(ids, -1)))
    return ShardLayout(0, vocab_size, indices, tp_rank, group)


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    return max(num_kv_heads // tp, 1)


def qkv_layout(cfg: ModelConfig, tp: int, tp_rank: int, group: dist.ProcessGroup | None) -> ShardLayout:
    """Rows of the fused [Q heads; K heads; V heads]: each rank keeps [its Q; its K; its V] in that order."""
    d, nh, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q_local, kv_local = nh // tp, local_kv_heads(kv, tp)

    def rows(heads: range, offset: int) -> torch.Tensor:
        return torch.cat([torch.arange(offset + h * d, offset + (h + 1) * d) for h in heads])

    indices = []
    for r in range(tp):
        first_kv = r * kv // tp  # tp > kv: r // (tp / kv), the head of this rank's query heads
        kv_heads = range(first_kv, first_kv + kv_local)
        indices.append(
            torch.cat(
                [rows(range(r * q_local, (r + 1) * q_local), 0), rows(kv_heads, nh * d), rows(kv_heads, (nh + kv) * d)]
            )
        )
    return ShardLayout(0, (nh + 2 * kv) * d, indices, tp_rank, group)


def gate_up_layout(ffn: int, tp: int, tp_rank: int, group: dist.ProcessGroup | None, dim: int = 0) -> ShardLayout:
    """Rows of the fused [gate; up]: each rank keeps [gate slice; up slice] so SwiGLU's chunk(2) still splits them.
    dim: where the rows are (1 for the experts' stacked gate_up)."""
    n = ffn // tp
    indices = [
        torch.cat([torch.arange(r * n, (r + 1) * n), torch.arange(ffn + r * n, ffn + (r + 1) * n)]) for r in range(tp)
    ]
    return ShardLayout(dim, 2 * ffn, indices, tp_rank, group)


# ---- applying it to the model ------------------------------------------------------------------


def apply_tensor_parallel(
    model: Transformer,
    mesh: Mesh,
    sequence_parallel: bool = False,
    comm_overlap: bool = True,
    specs: ParamSpecs | None = None,
) -> ParamSpecs:
    """Shard `model` (on meta, before materialize) over the tensor-parallel group of `mesh`, in place.

    Returns the parameter specs: `specs` (default: the plain ones) with the shards' layouts and the
    sequence-parallel replicas marked. comm_overlap: column-parallel backward hides its input-gradient
    collective behind the weight gradient.
    """
    specs = param_specs(model) if specs is None else specs
    cfg, tp, rank, group = model.cfg, mesh.layout.tp, mesh.tp_rank, mesh.tp_group
    check_tensor_parallel(cfg, tp)
    sp = sequence_parallel
    partial: list[nn.Module] = []
    kept: list[nn.Module] = []
    _apply_plans(model, cfg, mesh, sequence_parallel, partial, kept)
    vocab = vocab_layout(cfg.vocab_size, tp, rank, group)
    for name in ("embed", "extra_embed"):  # the extra heads' copy of the embedding on a later stage
        if getattr(model, name) is not None:
            weight = getattr(model, name).weight
            setattr(model, name, VocabParallelEmbedding(vocab, cfg.hidden_size, group, sp, weight.device, weight.dtype))
    if model.lm_head is not None:
        model.lm_head = _column(model.lm_head, vocab, group, sp)
    if model.norm is not None:
        # The head (F.linear in Transformer.logits) is column-parallel: give it the whole sequence.
        model.norm.register_forward_hook(lambda _m, _args, out: to_parallel_input(out, group, sp))
    num_real = int((vocab.local_index >= 0).sum())
    model.parallel.vocab = VocabShard(rank * vocab.local_size, num_real, cfg.vocab_size, group)
    if sp:
        model.parallel.sequence_shards = tp
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            module.overlap_backward = comm_overlap
    _check_all_sharded(model, partial + kept)
    out = tensor_parallel_specs(model, sequence_parallel, specs)
    names = {id(m): n for n, m in model.named_modules()}
    for m in partial:
        for leaf, _ in m.named_parameters():
            name = f"{names[id(m)]}.{leaf}"
            out[name] = replace(out[name], partial_grad=True)
    return out


def _apply_plans(
    model: nn.Module, cfg: ModelConfig, mesh: Mesh, sp: bool, partial: list[nn.Module], kept: list[nn.Module]
) -> None:
    """Split every child a block's `tp_plan` names (see the module docstring); the replicated_partial ones are
    collected in `partial`, the replicated ones in `kept`; set the blocks' `tp_parallel_inputs`. Layouts are built
    once per style and size: every layer is split alike."""
    tp, rank, group = mesh.layout.tp, mesh.tp_rank, mesh.tp_group
    layouts: dict[tuple[str, int], ShardLayout] = {}

    def layout(style: str, size: int) -> ShardLayout:
        if (style, size) not in layouts:
            layouts[(style, size)] = {
                "qkv": lambda: qkv_layout(cfg, tp, rank, group),
                "column": lambda: contiguous_layout(0, size, tp, rank, group),
                "gate_up": lambda: gate_up_layout(size // 2, tp, rank, group),
                "row": lambda: contiguous_layout(1, size, tp, rank, group),
            }[style]()
        return layouts[(style, size)]

    for module in list(model.modules()):
        for name in getattr(type(module), "tp_parallel_inputs", ()):
            setattr(module, name, partial_fn(to_parallel_input, group=group, sequence_parallel=sp))
        for child, style in getattr(type(module), "tp_plan", {}).items():
            sub = getattr(module, child)
            if sub is None:  # an optional part this model does not have (q/k norms)
                continue
            if style == "replicated_partial":
                partial.append(sub)
            elif style == "replicated":
                kept.append(sub)
            elif style == "row":
                setattr(module, child, _row(sub, layout(style, sub.in_features), group, sp))
            elif style in ("qkv", "column", "gate_up"):
                setattr(module, child, _column(sub, layout(style, sub.out_features), group, sp))
            else:
                raise ValueError(f"{type(module).__name__}.tp_plan: unknown style {style!r} for {child}")
            if style == "qkv":
                module.num_heads = cfg.num_heads // tp
                module.num_kv_heads = local_kv_heads(cfg.num_kv_heads, tp)


def tensor_parallel_specs(module: nn.Module, sequence_parallel: bool, specs: ParamSpecs | None = None) -> ParamSpecs:
    """The specs of the parameters of `module` (holding parallel layers), from `specs` (default: the plain ones).

    A parameter a parallel layer splits gets its layout and full shape; under sequence parallelism every
    replicated one (norms, row-parallel biases) is used on sequence shards, so its gradient is a partial sum.
    """
    out = dict(param_specs(module) if specs is None else specs)
    names = {name for name, _ in module.named_parameters()}
    if set(out) != names:  # the swaps keep every parameter's name
        raise ValueError(f"parameter specs {sorted(set(out) ^ names)[:5]} do not match the module's parameters")
    for prefix, m in module.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            for leaf, full_shape in m.full_shapes().items():
                name = f"{prefix}.{leaf}" if prefix else leaf
                out[name] = out[name].sharded(m.layout, full_shape)
    if sequence_parallel:
        out = {n: s if s.tensor_parallel else replace(s, partial_grad=True) for n, s in out.items()}
    return out


def _column(linear: nn.Linear, layout: ShardLayout, group, sp: bool) -> ColumnParallelLinear:
    if layout.full_size != linear.out_features:
        raise ValueError(f"layout of {layout.full_size} rows for a linear with {linear.out_features} outputs")
    return ColumnParallelLinear(
        linear.in_features, layout, linear.bias is not None, group, sp, linear.weight.device, linear.weight.dtype
    )


def _row(linear: nn.Linear, layout: ShardLayout, group, sp: bool) -> RowParallelLinear:
    if layout.full_size != linear.in_features:
        raise ValueError(f"layout of {layout.full_size} columns for a linear with {linear.in_features} inputs")
    return RowParallelLinear(
        linear.out_features, layout, linear.bias is not None, group, sp, linear.weight.device, linear.weight.dtype
    )


def _check_all_sharded(model: nn.Module, kept: list[nn.Module]) -> None:
    """A plain Linear/Embedding left behind would silently be replicated: fail instead. A MoE layer's linears (its
    router, replicated on purpose; a shared expert) are parallel/expert.py's to split; `kept`: a plan's replicated
    children."""
    moe = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, MoE))
    kinds, whole = (nn.Linear, nn.Embedding), {id(m) for m in kept}
    left = [
        name
        for name, m in model.named_modules()
        if type(m) in kinds and not name.startswith(moe) and id(m) not in whole
    ]
    if left:
        raise ValueError(f"tensor parallelism does not know how to split {left}")


# ---- gradients that each rank holds only part of -----------------------------------------------


def sync_tensor_parallel_grads(
    grads: Iterable[tuple[torch.Tensor, ParamSpec]], group: dist.ProcessGroup | None
) -> None:
    """Sum over the tp group the gradients of sequence-parallel replicated parameters and of replicated KV rows.

    `grads`: (gradient, spec) of the parameters whose spec has `tp_partial_grad` (others are skipped;
    GradBuffer.tp_partial_grads lists them). Call on every tp rank after backward (after `finish_grad_sync`
    with gradient buffers): one all-reduce.
    """
    whole: list[torch.Tensor] = []
    replicas: list[tuple[torch.Tensor, ShardLayout]] = []
    for grad, spec in grads:
        if spec.partial_grad:
            whole.append(grad)
        layout = spec.tp_layout
        if layout is not None and layout.num_replicated:
            replicas.append((grad, layout))
    if tp_size(group) == 1 or not (whole or replicas):
        return
    pieces = [g.reshape(-1) for g in whole]
    for grad, layout in replicas:
        # Every replicated row has a slot; each rank fills the slots of the rows it holds; the sum adds the replicas.
        slots = grad.new_zeros((layout.num_replicated, *grad.shape[1:]))
        slots.index_copy_(
            0,
            layout.replicated_slots.to(grad.device),
            grad.index_select(0, layout.replicated_positions.to(grad.device)),
        )
        pieces.append(slots.reshape(-1))
    flat = torch.cat(pieces)
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in whole:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    for grad, layout in replicas:
        n = layout.num_replicated * grad[0].numel()
        slots = flat[offset : offset + n].view(layout.num_replicated, *grad.shape[1:])
        offset += n
        grad.index_copy_(
            0,
            layout.replicated_positions.to(grad.device),
            slots.index_select(0, layout.replicated_slots.to(grad.device)),
        )
