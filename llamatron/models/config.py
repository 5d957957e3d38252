"""The architecture of one model, independent of how it is trained or laid out."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

# how a mixture of experts balances its experts' loads (models/moe.py): every family with experts has them
BALANCING_SETTINGS = (
    "router_aux_loss_scope",
    "router_expert_bias",
    "router_bias_update_rate",
    "moe_capacity_factor",
    "moe_token_drop_policy",
)
# a mixture of experts' settings: options only of a model with experts (a family lists those it can change)
MOE_SETTINGS = (
    "experts_per_token",
    "router_aux_loss_coef",
    "router_z_loss_coef",
    "moe_renormalize",
    "shared_expert_ffn",
    "moe_layer_step",
    "dense_ffn_hidden_size",
    "router_score",
    *BALANCING_SETTINGS,
)
ROUTER_SCORES = ("softmax", "sigmoid")
AUX_LOSS_SCOPES = ("sequence", "global_batch")  # over what the load-balancing loss's expert loads are counted
DROP_POLICIES = ("probs", "position")  # which of an over-full expert's assignments are kept (models/moe.py)


@dataclass
class RopeScaling:
    """Rotary-embedding scaling for long context.

    kind: "linear" (positions divided by factor), "dynamic" (NTK-aware base
    growth past original_max_position), "llama3" (Llama 3.1's
    frequency-dependent scheme) or "yarn" (models/yarn.py: beta_fast, beta_slow,
    mscale, mscale_all_dim, truncate).
    """

    kind: str
    factor: float
    original_max_position: int = 8192
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


MAX_SIZE = 2**31 - 1  # any size of a model (an int32 index is what kernels take)


@dataclass
class ModelConfig:
    """One architecture: its family (a plug-in of models/families/, which builds its layers, converts its Hugging
    Face files and says which of the options below it has) and its shape: the common decoder config.

    The fields after `init_std` are options of the shared building blocks (models/layers.py, blocks.py, moe.py); a
    family lists the ones it uses (`Family.options`), and the others must keep their defaults. What only one
    family's own modules read lives in that family's config, a subclass in its folder (`Family.config_class`),
    which also overrides the per-layer hooks (`layer_has_rope`, `layer_attention_chunk`) where its layers differ."""

    # The mixture-of-experts settings of this config class: MOE_SETTINGS and those a family's config adds (Qwen-MoE's
    # shared expert gate); a dense model keeps them at their defaults
    moe_settings: ClassVar[tuple[str, ...]] = MOE_SETTINGS

    family: str  # a name in models/families/ (registry: models/families/__init__.py)
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    # None: multi-head (__post_init__ sets num_heads, so every reader sees an int); 1: multi-query
    num_kv_heads: int = None  # type: ignore[assignment]
    ffn_hidden_size: int = 11008
    max_seq_length: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Options (each family lists those it has in Family.options)
    # The width of each attention head; None: hidden_size / num_heads (__post_init__ sets it). Qwen3 gives it.
    head_dim: int = None  # type: ignore[assignment]
    sliding_window: int | None = None  # attend to at most this many past tokens (Mistral)
    bias: bool = False  # biases on every linear layer
    # Mixture of experts (models/moe.py): 0 for a dense MLP, else each layer's MLP is this many SwiGLU
    # experts of ffn_hidden_size, of which a router picks experts_per_token for each token
    num_experts: int = 0
    experts_per_token: int = 2
    router_aux_loss_coef: float = 0.02  # weight of the load-balancing loss (Mixtral's 0.02)
    router_z_loss_coef: float = 0.0  # weight of the router z-loss (ST-MoE); 0: off
    # the chosen experts' softmax weights renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob); False:
    # the softmax over all experts as it is (Qwen2-MoE)
    moe_renormalize: bool = True
    # a shared expert (Qwen2-MoE, Llama 4, DeepSeek-V3): a SwiGLU of this width every token goes through beside
    # its routed experts (0: none)
    shared_expert_ffn: int = 0
    # Layer i has experts when (i + 1) % moe_layer_step == 0 (Llama 4's interleave_moe_layer_step, Qwen's
    # decoder_sparse_step); the others are dense SwiGLUs dense_ffn_hidden_size wide (0: ffn_hidden_size)
    moe_layer_step: int = 1
    dense_ffn_hidden_size: int = 0
    # The chosen experts' weights: softmax over all experts (Mixtral, Qwen) or the sigmoid of each chosen logit
    # (Llama 4, DeepSeek-V3)
    router_score: str = "softmax"
    # Balancing (models/moe.py says how each works): the load-balancing loss's expert loads counted per sequence or
    # over the whole global batch (Qwen3's global-batch balancing); DeepSeek-V3's auxiliary-loss-free balancing, a
    # per-expert bias added to the scores for the top-k choice only, moved by router_bias_update_rate after each
    # step towards the mean load; a capacity factor (None: dropless), each expert taking at most
    # ceil(factor * seq * k / experts) of a sequence's assignments, kept by routing weight (probs) or by position
    router_aux_loss_scope: str = "sequence"
    router_expert_bias: bool = False
    router_bias_update_rate: float = 1e-3
    moe_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if (
            self.head_dim is None
            and isinstance(self.hidden_size, int)
            and isinstance(self.num_heads, int)
            and self.num_heads > 0
        ):
            self.head_dim = self.hidden_size // self.num_heads
        if isinstance(self.rope_scaling, dict) and _rope_scaling_keys_problem(self.rope_scaling) is None:
            self.rope_scaling = RopeScaling(**self.rope_scaling)  # else it stays a dict: problems() says why

    def problems(self) -> list[str]:
        """What makes this shape unbuildable or wrong to train (empty when it is sound)."""
        # Values of the wrong type (YAML model_overrides, a checkpoint's or HF config) first: the rules below
        # compare and divide them.
        out = type_problems(self)
        if isinstance(self.rope_scaling, RopeScaling):
            out += type_problems(self.rope_scaling, "rope_scaling ")
        elif self.rope_scaling is not None:
            out.append(_rope_scaling_keys_problem(self.rope_scaling) or "rope_scaling: set without __post_init__")
        if out:
            return out
        if not self.init_std >= 0:
            out.append(f"init_std {self.init_std} must be >= 0")
        out += self._moe_problems()
        out += [
            f"{name} {getattr(self, name)} must be >= 1"
            for name in (
                "vocab_size",
                "hidden_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "ffn_hidden_size",
                "max_seq_length",
            )
            if not getattr(self, name) >= 1
        ]
        out += [
            f"{f.name} {getattr(self, f.name)} is out of range: at most {MAX_SIZE}"
            for f in fields(self)
            if field_kinds(type(self))[f.name][0] is int and (getattr(self, f.name) or 0) > MAX_SIZE
        ]
        if out:
            return out
        if self.head_dim % 2:
            given = "head_dim" if self.head_dim != self.hidden_size // self.num_heads else "head dim"
            why = "" if given == "head_dim" else " (hidden_size / num_heads)"
            out.append(f"{given} {self.head_dim}{why} must be even: RoPE rotates pairs")
        if self.hidden_size % self.num_heads and self.head_dim == self.hidden_size // self.num_heads:
            out.append(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; change them, or "
                "give head_dim"
            )
        if self.num_heads % self.num_kv_heads:
            out.append(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.sliding_window is not None and not self.sliding_window >= 1:
            out.append(f"sliding_window {self.sliding_window} must be >= 1 (or null: full causal attention)")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            out.append("rope_theta and norm_eps must be > 0")
        r = self.rope_scaling
        if r is not None:
            if r.kind not in ("linear", "dynamic", "llama3", "yarn"):
                out.append(f"rope_scaling kind {r.kind!r} must be linear, dynamic, llama3 or yarn")
            if not (r.factor > 0 and r.factor < float("inf")):
                out.append(f"rope_scaling factor {r.factor} must be a positive number")
            if r.kind == "llama3" and not 0 < r.low_freq_factor <= r.high_freq_factor:
                out.append("rope_scaling llama3 needs 0 < low_freq_factor <= high_freq_factor")
            if r.kind == "yarn" and not 0 < r.beta_slow <= r.beta_fast:
                out.append("rope_scaling yarn needs 0 < beta_slow <= beta_fast")
        return out

    def _moe_problems(self) -> list[str]:
        if self.num_experts == 0:  # a dense model: a mixture's settings given anyway would do nothing
            defaults = {f.name: f.default for f in fields(self)}
            return [
                f"{name} {getattr(self, name)} is a mixture-of-experts setting, but this model is dense "
                "(num_experts 0): remove it, or give the model experts"
                for name in self.moe_settings
                if getattr(self, name) != defaults[name]
            ]
        out = []
        if self.num_experts < 0:
            out.append(f"num_experts {self.num_experts} must be >= 0 (0: a dense MLP)")
        elif not 1 <= self.experts_per_token <= self.num_experts:
            out.append(f"experts_per_token {self.experts_per_token} must be in 1..num_experts ({self.num_experts})")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "shared_expert_ffn"):
            if not getattr(self, name) >= 0:
                out.append(f"{name} {getattr(self, name)} must be >= 0")
        if not self.moe_layer_step >= 1:
            out.append(f"moe_layer_step {self.moe_layer_step} must be >= 1 (1: experts in every layer)")
        elif self.moe_layer_step > self.num_layers:
            out.append(f"moe_layer_step {self.moe_layer_step} > num_layers {self.num_layers}: no layer has experts")
        if not self.dense_ffn_hidden_size >= 0:
            out.append(f"dense_ffn_hidden_size {self.dense_ffn_hidden_size} must be >= 0 (0: ffn_hidden_size)")
        if self.router_score not in ROUTER_SCORES:
            out.append(f"router_score {self.router_score!r} must be one of {', '.join(ROUTER_SCORES)}")
        return out + self._balancing_problems()

    def _balancing_problems(self) -> list[str]:
        out = []
        if self.router_aux_loss_scope not in AUX_LOSS_SCOPES:
            out.append(
                f"router_aux_loss_scope {self.router_aux_loss_scope!r} must be one of {', '.join(AUX_LOSS_SCOPES)}"
            )
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            out.append(
                f"moe_capacity_factor {self.moe_capacity_factor} must be > 0 (e.g. 1.25), or null for dropless routing"
            )
        elif self.moe_capacity_factor is not None and not self.moe_capacity_factor <= self.num_experts:
            # at num_experts an expert already takes every token of a sequence: above it, nothing changes but the
            # capacity's arithmetic, which overflows (1e308)
            out.append(
                f"moe_capacity_factor {self.moe_capacity_factor} must be at most num_experts ({self.num_experts}), "
                "where no token is dropped any more; or null for dropless routing"
            )
        if self.moe_token_drop_policy not in DROP_POLICIES:
            policy = self.moe_token_drop_policy
            out.append(f"moe_token_drop_policy {policy!r} must be one of {', '.join(DROP_POLICIES)}")
        elif self.moe_token_drop_policy != "probs" and self.moe_capacity_factor is None:
            out.append("moe_token_drop_policy needs a capacity: give moe_capacity_factor (dropless drops nothing)")
        if not self.router_bias_update_rate > 0:
            out.append(f"router_bias_update_rate {self.router_bias_update_rate} must be > 0 (e.g. 0.001)")
        elif self.router_bias_update_rate != 1e-3 and not self.router_expert_bias:
            out.append("router_bias_update_rate needs router_expert_bias: true (the bias it moves)")
        return out

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has experts (else a dense SwiGLU)."""
        return self.is_moe and (index + 1) % self.moe_layer_step == 0

    @property
    def num_moe_layers(self) -> int:
        """The layers i with (i + 1) % moe_layer_step == 0 (is_moe_layer), counted without visiting each."""
        return self.num_layers // self.moe_layer_step if self.is_moe else 0

    def layer_ffn(self, index: int) -> int:
        """The width of layer `index`'s SwiGLU (of each expert in a MoE layer)."""
        if self.is_moe_layer(index) or not self.dense_ffn_hidden_size:
            return self.ffn_hidden_size
        return self.dense_ffn_hidden_size

    @property
    def rope_head_dim(self) -> int:
        """The dimensions of a head the rotary embedding turns (the tables' width): head_dim, unless a family's
        attention rotates only part of each head (its config overrides this)."""
        return self.head_dim

    # Per-layer hooks: a family's config (a subclass in its folder) overrides them where its layers differ.
    def layer_has_rope(self, index: int) -> bool:
        """Whether layer `index` rotates its queries and keys (every layer of the shared blocks does)."""
        return True

    def layer_attention_chunk(self, index: int) -> int | None:
        """The chunk of tokens layer `index` attends within (None: the whole causal context, or the window)."""
        return None

    def layer_variant(self, index: int) -> tuple:
        """What sets layer `index`'s shape and attention apart from the others (equal for layers built alike)."""
        return (self.is_moe_layer(index), self.layer_ffn(index), self.layer_has_rope(index))

    def without_extra_heads(self) -> ModelConfig:
        """This model without its family's extra prediction heads (models/family.py ExtraHeads; export-hf
        --drop-mtp): itself where it has none."""
        return self

    def layout_problems(self, tp: int, pp: int, cp: int) -> list[str]:
        """Why this model cannot be trained split tp x pp x cp ways (a family's modules may not be; empty: it can)."""
        return []

    def seq_length_problems(self, seq_length: int, name: str) -> list[str]:
        """Why `seq_length` is no length to train or plan this model at (empty when it is): a sanity bound of 64×
        its context, past which rotary positions, even scaled, are not what the model learned."""
        longest = 64 * self.max_seq_length
        if 1 <= seq_length <= longest:
            return []
        return [
            f"--seq-length {seq_length} is out of range for {name}: give 1 to {longest} "
            f"(64 x its context of {self.max_seq_length} tokens)"
        ]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def changed_options(self) -> list[str]:
        """The shared blocks' options (ModelConfig's fields after init_std) not at their defaults: what a family
        must have to build this. A family config's own fields (a subclass's) are its family's alone."""
        names = [f.name for f in fields(ModelConfig)]
        out = []
        for f in fields(ModelConfig)[names.index("init_std") + 1 :]:
            value = getattr(self, f.name)
            if f.name == "head_dim":
                if value != self.hidden_size // max(self.num_heads, 1):
                    out.append(f.name)
            elif f.name in MOE_SETTINGS:
                if self.num_experts and value != f.default:
                    out.append(f.name)
            elif value != f.default:
                out.append(f.name)
        return out

    @classmethod
    def own_fields(cls) -> tuple[str, ...]:
        """The fields this config class adds to ModelConfig's (a family's own; none for ModelConfig)."""
        base = {f.name for f in fields(ModelConfig)}
        return tuple(f.name for f in fields(cls) if f.name not in base)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """A config of this class from its fields (a family's config class: models/families' config_from_dict
        picks it by the family name)."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config keys {sorted(unknown)}; known: {sorted(known)}")
        if "family" not in d:
            raise ValueError("a model config needs its family (models/families/)")
        return cls(**d)

    def with_changes(self, changes: dict[str, Any]) -> ModelConfig:
        """This config with `changes` to its fields (YAML model_overrides); a head_dim that followed hidden_size /
        num_heads follows their new values unless `changes` gives it, and a mixture of experts made dense
        (num_experts 0) drops its MoE settings (a dense model's must be left at their defaults)."""
        d = self.to_dict()
        derived = self.head_dim == self.hidden_size // max(self.num_heads, 1)
        if changes.get("num_experts") == 0 and self.num_experts:  # made dense: the preset's MoE settings go too
            d.update({f.name: f.default for f in fields(self) if f.name in self.moe_settings})
        d.update(changes)
        if derived and "head_dim" not in changes:
            d["head_dim"] = None
        return type(self)(**d)


def _field_kinds(cls: type) -> dict[str, tuple[type, bool]]:
    """(type, may be None) of each field of a config dataclass, from its annotations."""
    kinds = {}
    names = {f.name for f in fields(cls)}  # not the class variables (moe_settings)
    for name, hint in typing.get_type_hints(cls).items():
        if name not in names:
            continue
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        kind = next(a for a in args if a is not type(None))
        kinds[name] = (typing.get_origin(kind) or kind, type(None) in args)  # tuple[int, ...]: a tuple
    return kinds


_FIELD_KINDS: dict[type, dict[str, tuple[type, bool]]] = {}


def field_kinds(cls: type) -> dict[str, tuple[type, bool]]:
    """(type, may be None) of each field of config class `cls` (ModelConfig, a family's subclass, RopeScaling)."""
    if cls not in _FIELD_KINDS:
        _FIELD_KINDS[cls] = _field_kinds(cls)
    return _FIELD_KINDS[cls]


_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


def _is_kind(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):  # YAML `true` is no number
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def _type_problem(cls: type[ModelConfig] | type[RopeScaling], name: str, value: Any) -> str | None:
    """Why `value` is not of field `name`'s declared type (None when it is; a nested RopeScaling is not checked)."""
    kind, optional = field_kinds(cls)[name]
    if kind is RopeScaling or (value is None and optional) or _is_kind(value, kind):
        return None
    return f"{name} {value!r} must be {_KIND_WORDS.get(kind, kind.__name__)}"


def type_problems(cfg: ModelConfig | RopeScaling, prefix: str = "") -> list[str]:
    """Each field of `cfg` (a ModelConfig or RopeScaling) whose value is not of its declared type; the nested
    rope_scaling is left to the caller. A float field takes an integer (YAML's `rope_theta: 500000`)."""
    problems = (_type_problem(type(cfg), name, getattr(cfg, name)) for name in field_kinds(type(cfg)))
    return [prefix + p for p in problems if p is not None]


def field_value_problem(name: str, value: Any, cls: type[ModelConfig] = ModelConfig) -> str | None:
    """Why `value` cannot be given to field `name` of config class `cls` (ModelConfig or a family's), by its type;
    None when it can. None is taken where the field's default is None (num_kv_heads, head_dim: derived from the
    others)."""
    if value is None and cls.__dataclass_fields__[name].default is None:
        return None
    if name == "rope_scaling":
        return None if value is None else _rope_scaling_keys_problem(value)
    return _type_problem(cls, name, value)


def _rope_scaling_keys_problem(value: Any) -> str | None:
    """Why `value` (YAML or JSON) cannot be a RopeScaling (None when it can)."""
    known = [f.name for f in fields(RopeScaling)]
    form = f"a mapping of {', '.join(known)} (kind and factor required), or null for none"
    if not isinstance(value, dict):
        return f"rope_scaling {value!r} must be {form}"
    missing = [k for k in ("kind", "factor") if k not in value]
    unknown = sorted(str(k) for k in value if k not in known)
    parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
        [f"unknown {', '.join(unknown)}"] if unknown else []
    )
    return f"rope_scaling {value!r}: {'; '.join(parts)}; it must be {form}" if parts else None


__all__ = ["ModelConfig", "RopeScaling", "field_kinds", "field_value_problem", "type_problems"]
