"""What a model is made of, read from its layers built on the meta device: the one source of parameter counts,
FLOPs and layer features for training metrics, bench, the planner and the simulator.

Each decoder layer kind of a family (Family.layer_kind) is built once on meta (no memory); its parameters are
listed with their shape and how tensor parallelism splits them (the `tp_plan` of the block that holds them), and
the layer's features (which norm, which MLP) are read off its modules. Nothing here knows a family.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar, cast

import torch
from torch import nn

from .attention_counts import AttentionCounts
from .block_counts import BlockCounts, NormCounts
from .blocks import SwiGLU
from .config import ModelConfig, RopeScaling
from .families import family_of
from .layers import RMSNorm
from .moe import Experts, MoE


@dataclass(frozen=True)
class Weight:
    """One parameter of a decoder layer."""

    name: str  # within the layer, e.g. "attn.qkv.weight"
    shape: tuple[int, ...]
    # tensor parallelism's split (parallel/tensor.py): qkv, column, gate_up, row, replicated, replicated_partial,
    # or expert (a mixture's stacked experts: split over ep ranks and, along their ffn, over tp)
    split: str
    kind: str  # matmul (a linear's weight), expert, router, norm, bias

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Layer:
    """A decoder layer's parameters and the features the planner and the kernel settings read."""

    weights: tuple[Weight, ...]
    norm: str  # "rmsnorm" or "layernorm" (named in messages; which kernels run it: block.rmsnorm_kernel)
    mlp: str  # "swiglu" or "gelu" (a mixture of experts: its experts'; which kernels run it: block.swiglu_kernel)
    moe: bool
    qk_norm: bool
    # The attention's width in the FLOP formula: (query·key width + probability·value width) / 2 over all heads,
    # heads·head_dim for the shared attention; the layer's attention module says (`flops_width`)
    attention_width: float
    # What its attention module declares for the planner (`counts`: models/attention_counts.py): saved activations
    # by kind, the context-parallel gather, the kernel's widths and the decode cache per token
    attention: AttentionCounts
    # What the layer itself declares (`counts`: models/block_counts.py): its saved activations outside the
    # attention (norms, MLP) and which Triton kernels run its norms and MLP
    block: BlockCounts

    def params(self, kind: str | None = None) -> int:
        """All its parameters, or those of one kind (matmul, expert, router, norm, bias)."""
        return self._params[kind]

    @functools.cached_property
    def _params(self) -> dict[str | None, int]:
        out: dict[str | None, int] = {None: 0, "matmul": 0, "expert": 0, "router": 0, "norm": 0, "bias": 0}
        for w in self.weights:
            out[None] += w.numel
            out[w.kind] += w.numel
        return out


def _split_of(plan_style: str | None, leaf: str) -> str:
    if plan_style is None:
        return "replicated"
    if leaf == "bias" and plan_style == "row":
        return "replicated"  # a row-parallel layer adds its bias after the reduction
    return plan_style


def weight_kind(module: nn.Module, leaf: str, name: str) -> str:
    """What a layer's parameter `name.leaf` of `module` is: matmul (a linear's weight), expert, router, norm, bias."""
    if isinstance(module, Experts):
        return "expert"
    if isinstance(module, (RMSNorm, nn.LayerNorm)):
        return "norm"
    if leaf == "bias":
        return "bias"
    return "router" if name.endswith("router") else "matmul"


def _describe(layer: nn.Module, core: nn.Module | None = None) -> Layer:
    """`layer`'s weights; its features read off `core` (default: itself), the decoder layer an extra head wraps."""
    plans = {}
    for prefix, module in layer.named_modules():
        styles = {**getattr(type(module), "tp_plan", {}), **getattr(type(module), "tp_split", {})}
        for child, style in styles.items():
            plans[f"{prefix}.{child}" if prefix else child] = style
    modules = dict(layer.named_modules())
    weights = []
    for name, p in layer.named_parameters():
        owner, _, leaf = name.rpartition(".")
        kind = weight_kind(modules[owner], leaf, owner)
        split = "expert" if kind == "expert" else _split_of(plans.get(owner), leaf)
        weights.append(Weight(name, tuple(p.shape), split, kind))
    core = layer if core is None else core
    children = dict(core.named_children())
    attention = children.get("attn")
    residual_norms = [m for m in children.values() if isinstance(m, (RMSNorm, nn.LayerNorm))]
    mlp = children.get("mlp")
    return Layer(
        weights=tuple(weights),
        norm="layernorm" if any(isinstance(m, nn.LayerNorm) for m in residual_norms) else "rmsnorm",
        mlp="swiglu" if isinstance(mlp, (SwiGLU, MoE)) else "gelu",
        moe=isinstance(mlp, MoE),
        qk_norm=any(n.endswith(("q_norm", "k_norm")) for n in modules),
        attention_width=float(getattr(attention, "flops_width", 0)),
        attention=cast(AttentionCounts, _counts(core, attention, "its attention", "attention_counts")),
        block=cast(BlockCounts, _counts(core, core, "it", "block_counts")),
    )


def _counts(layer: nn.Module, module: nn.Module | None, what: str, where: str) -> object:
    counts = getattr(module, "counts", None)
    if counts is None:  # a programming error in a family's layer, not a user's input
        raise TypeError(f"{type(layer).__name__}: {what} declares no counts (models/{where}.py)")
    return counts


_FIELDS: dict[type, Callable[[ModelConfig], tuple]] = {}  # each config class's fields but rope_scaling, read at once
_SCALING_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(RopeScaling)))  # its fields are scalars
_CACHE: dict[
    tuple, tuple[tuple[Layer, ...], int, tuple[Layer, ...], NormCounts]
] = {}  # asked thousands of times a search


_UNCHANGED: dict[int, tuple[ModelConfig, tuple]] = {}  # id -> (config, key) inside unchanged_config


def config_key(cfg: ModelConfig) -> tuple:
    """A hashable value equal for equal configs (ModelConfig itself is mutable): what caches of it are keyed by."""
    known = _UNCHANGED.get(id(cfg))
    if known is not None and known[0] is cfg:
        return known[1]
    cls = type(cfg)
    if cls not in _FIELDS:
        _FIELDS[cls] = operator.attrgetter(*(f.name for f in dataclasses.fields(cls) if f.name != "rope_scaling"))
    scaling = cfg.rope_scaling
    rope = _SCALING_FIELDS(scaling) if isinstance(scaling, RopeScaling) else scaling
    return (cls, *_FIELDS[cls](cfg), rope)


@contextlib.contextmanager
def unchanged_config(cfg: ModelConfig) -> Iterator[ModelConfig]:
    """A block inside which `cfg` does not change: config_key remembers its key there. A planner search asks
    it of its model for every layout and pipeline rank it weighs; reading 40 fields each time was a third of
    the search."""
    before = _UNCHANGED.get(id(cfg))
    _UNCHANGED[id(cfg)] = cfg, config_key(cfg)
    try:
        yield cfg
    finally:
        if before is None:
            del _UNCHANGED[id(cfg)]
        else:
            _UNCHANGED[id(cfg)] = before


P = ParamSpec("P")
T = TypeVar("T")
_PER_CONFIG_SIZE = 1 << 16
_MISSING = object()


def per_config(fn: Callable[Concatenate[ModelConfig, P], T]) -> Callable[Concatenate[ModelConfig, P], T]:
    """Memoise a pure function of a config and hashable arguments, by config_key: the planner asks the same few
    questions of one model for each of the tens of thousands of layouts it weighs. What it returns is shared:
    only for immutable results."""
    memo: dict[tuple, object] = {}

    @functools.wraps(fn)
    def cached(cfg: ModelConfig, *args: P.args, **kwargs: P.kwargs) -> T:
        key = (config_key(cfg), args, tuple(kwargs.items()))
        if (value := memo.get(key, _MISSING)) is _MISSING:
            if len(memo) >= _PER_CONFIG_SIZE:
                memo.clear()
            value = memo[key] = fn(cfg, *args, **kwargs)
        return cast(T, value)

    return cached


def _decoder_layer(module: nn.Module) -> nn.Module:
    """The decoder layer inside an extra head (the submodule holding an attention that declares its counts)."""
    return next(m for m in module.modules() if hasattr(getattr(m, "attn", None), "counts"))


def _built(cfg: ModelConfig) -> tuple[tuple[Layer, ...], int, tuple[Layer, ...], NormCounts]:
    """(every decoder layer, the final norm's parameters, each extra prediction head: its decoder layer's features
    and all its weights, what the final norm declares) of `cfg`, built once on meta per configuration."""
    key = config_key(cfg)
    if key not in _CACHE:
        family = family_of(cfg)
        kinds: dict[object, Layer] = {}
        out = []
        with torch.device("meta"):
            for i in range(cfg.num_layers):
                kind = family.layer_kind(cfg, i)
                if kind not in kinds:
                    kinds[kind] = _describe(family.block(cfg, i))
                out.append(kinds[kind])
            final_norm = family.final_norm(cfg)
            norm = sum(p.numel() for p in final_norm.parameters())
            norm_counts = cast(NormCounts, _counts(final_norm, final_norm, "it", "block_counts"))
            heads = family.extra_heads(cfg)
            extra = () if heads is None else tuple(_describe(m, _decoder_layer(m)) for m in heads.children())
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = (tuple(out), norm, extra, norm_counts)
    return _CACHE[key]


def layers(cfg: ModelConfig) -> tuple[Layer, ...]:
    """Every decoder layer of `cfg`, in order (layers of one kind are one object)."""
    return _built(cfg)[0]


def final_norm_params(cfg: ModelConfig) -> int:
    return _built(cfg)[1]


def final_norm_counts(cfg: ModelConfig) -> NormCounts:
    """What the final norm declares (models/block_counts.py): the bytes it saves standing alone."""
    return _built(cfg)[3]


def extra_head_layers(cfg: ModelConfig) -> tuple[Layer, ...]:
    """Each of the family's extra prediction heads (DeepSeek-V3's MTP modules): all its weights, its decoder
    layer's features; () without them. They run the model's output head once more each, on the last stage."""
    return _built(cfg)[2]


def input_embedding_params(cfg: ModelConfig) -> int:
    """The parameters of an input-embedding table of its own (untied): a lookup, no matmul, so no FLOPs. A tied
    table is the output head's weight too, and its matmul counts: 0 then."""
    return 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size


def _layer_params(cfg: ModelConfig, layer: Layer, active: bool) -> int:
    experts = layer.params("expert")
    taken = experts * cfg.experts_per_token // cfg.num_experts if active and layer.moe else experts
    return layer.params() - experts + taken


@per_config
def extra_head_params(cfg: ModelConfig, active: bool = False) -> int:
    """The extra prediction heads' parameters (the model's embedding and head they share not counted again); with
    `active`, experts_per_token experts in each MoE layer."""
    return sum(_layer_params(cfg, layer, active) for layer in extra_head_layers(cfg))


@per_config
def _params(cfg: ModelConfig, active: bool) -> int:
    total = sum(_layer_params(cfg, layer, active) for layer in layers(cfg))
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    return total + final_norm_params(cfg) + embed + extra_head_params(cfg, active)


def num_params(cfg: ModelConfig) -> int:
    """All parameters, embeddings included (a tied table once); every expert of a mixture of experts."""
    return _params(cfg, active=False)


def active_params(cfg: ModelConfig) -> int:
    """The parameters one token is computed with: num_params with experts_per_token experts per MoE layer (the
    router included). Equal to num_params for a dense model."""
    return _params(cfg, active=True)


def expert_params(cfg: ModelConfig) -> int:
    """The parameters of all experts of all layers (0 for a dense model): what expert parallelism splits."""
    return sum(layer.params("expert") for layer in layers(cfg))


def experts_taken(cfg: ModelConfig) -> float:
    """The experts a token's choices run through on average in a MoE layer: experts_per_token (dropless), or with
    a capacity factor the share an expert takes (ceil(factor x seq x k / experts) of a sequence's choices: with
    the even loads the planner and simulator assume, min(1, factor) of them; it caps them whatever the loads)."""
    share = 1.0 if cfg.moe_capacity_factor is None else min(1.0, cfg.moe_capacity_factor)
    return cfg.experts_per_token * share


def mean_mlp_width(cfg: ModelConfig) -> float:
    """The MLP width one token runs through, averaged over the layers: the mean of layer_ffn(i), times
    experts_taken in a MoE layer (is_moe_layer). A dense layer is dense_ffn_hidden_size wide when that is set, in
    a model without experts too."""
    moe = cfg.num_moe_layers  # layer_ffn's widths summed in closed form (the planner asks per layout and rank)
    if moe == cfg.num_layers:  # every layer has experts
        return float(cfg.ffn_hidden_size * experts_taken(cfg))
    dense = cfg.dense_ffn_hidden_size or cfg.ffn_hidden_size
    return (moe * cfg.ffn_hidden_size * experts_taken(cfg) + (cfg.num_layers - moe) * dense) / cfg.num_layers


def moe_layer_share(cfg: ModelConfig) -> float:
    """The fraction of decoder layers with experts (num_moe_layers: a family's dense first layers count out)."""
    return cfg.num_moe_layers / cfg.num_layers if cfg.is_moe else 0.0


def _layer_keys(cfg: ModelConfig, index: int, seq_length: int) -> int:
    """The keys layer `index`'s queries span: the sequence, the window or its attention chunk where shorter."""
    span = seq_length
    for limit in (cfg.sliding_window, cfg.layer_attention_chunk(index)):
        span = min(span, limit) if limit is not None else span
    return span


@per_config
def attention_flops(cfg: ModelConfig, seq_length: int) -> float:
    """Σ over layers of attention width x keys: the score and value products' share of the FLOP formula, / 12.
    An extra head's decoder layer attends over the whole sequence (numbered after the model's layers)."""
    extra = [(cfg.num_layers + j, layer) for j, layer in enumerate(extra_head_layers(cfg))]
    every = [*enumerate(layers(cfg)), *extra]
    return float(sum(layer.attention_width * _layer_keys(cfg, i, seq_length) for i, layer in every))


def decode_cache_bytes_per_token(cfg: ModelConfig, element_size: int) -> int:
    """Bytes a decode cache holds per token over all layers (one device): each layer's attention declares its
    width (keys and values for the shared attention, MLA's latent and rotary key)."""
    return sum(layer.attention.decode_cache_width for layer in layers(cfg)) * element_size


@per_config
def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Model FLOPs per trained token, the one formula every TFLOP/s and MFU figure uses (metrics, bench, plan):
    6·(N - input-embedding params) + 12·Σ_layers w·S, as PaLM and torchtitan count them (docs/design.md), w the
    layer's attention width (heads·head_dim, which is hidden_size unless head_dim says otherwise; a family's own
    attention declares its `flops_width`). S is the keys a query attends to: the sequence length, or the sliding
    window (or the layer's attention chunk) when it is shorter (else windowed models report MFU above 100%). N of a
    mixture of experts is its active parameters (experts_per_token experts per layer, as Megatron-core and
    torchtitan count MoE FLOPs). N includes the extra prediction heads' parameters, and each of them runs the output
    head once more (vocab_size x hidden_size), as Megatron-LM counts its MTP layers."""
    head_again = len(extra_head_layers(cfg)) * cfg.vocab_size * cfg.hidden_size
    matmul_params = active_params(cfg) - input_embedding_params(cfg) + head_again
    return 6.0 * matmul_params + 12.0 * attention_flops(cfg, seq_length)


__all__ = [
    "Layer",
    "Weight",
    "active_params",
    "attention_flops",
    "config_key",
    "decode_cache_bytes_per_token",
    "expert_params",
    "extra_head_layers",
    "extra_head_params",
    "final_norm_counts",
    "final_norm_params",
    "flops_per_token",
    "input_embedding_params",
    "layers",
    "experts_taken",
    "mean_mlp_width",
    "moe_layer_share",
    "num_params",
    "per_config",
    "unchanged_config",
]
