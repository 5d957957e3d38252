"""Multi-head latent attention (DeepSeek-V2/V3, MLA): keys and values made per head from one small latent per token.

    q            = q(x)                                   (q_lora_rank None: one projection)
                 | q_b(RMSNorm(q_a(x)))                   (low-rank: q_a to q_lora_rank, normalised, q_b per head)
    latent, k_pe = kv_a(x)                                (kv_lora_rank, and qk_rope_head_dim for the rotary key)
    k_nope, v    = kv_b(RMSNorm(latent)) per head         (qk_nope_head_dim, v_head_dim)
    k            = [k_nope; rope(k_pe)]                   the rotary key shared by every head
    q            = [q_nope; rope(q_pe)]                   per head
    out          = o(softmax(q·k · softmax_scale) v)

Training and a prefill build the keys and values per head and run `attend` (any mask, any kernel). The
decode cache (mla_cache.py) holds only the normalised latent and the rotated rotary key; after it, the up-projection
is absorbed: each head's query is carried into latent space by its key part of kv_b (q_nope · W_uk[h]), attends
over [latent; k_pe] as one shared key head (multi-query attention with keys of kv_lora_rank + qk_rope_head_dim and
values of kv_lora_rank), and its output leaves through the value part (· W_uv[h]ᵀ): full keys and values are never
built. The scores are the same numbers: q_nope·(W_uk latent) = (q_nopeᵀ W_uk)·latent.

The softmax scale is folded into the queries: attend scales by 1/sqrt(the query's width), so q is
multiplied by softmax_scale · sqrt(width) (1, and no multiply, when the scale is the default 1/sqrt(qk_head_dim)).
The values may be narrower than the keys (v_head_dim < qk_head_dim; the absorbed form's kv_lora_rank <
kv_lora_rank + qk_rope_head_dim): attend takes that under every kernel (models/attention.py's attention_core pads
for those that want one width).

Written for one device (docs/design.md, principle 1): the heads are reshaped with -1, so tensor parallelism's
local head counts need no attribute; `num_heads` keeps the count the layer was built with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ....errors import ConfigError
from ...attention import AttentionMask, attend, attention_mask
from ...attention_counts import LayerKernels
from ...layer_input import LayerInput
from ...layers import RMSNorm, apply_rope
from .mla_cache import MLACache
from .rope import halves_from_interleaved, interleaved_from_halves


@dataclass(frozen=True)
class MLAConfig:
    """The shape of one multi-head latent attention layer (transformers' DeepseekV3Config names in brackets).

    norm_eps: the latent norms' epsilon (transformers and DeepSeek's reference build them with 1e-6, whatever
    rms_norm_eps says). softmax_scale: None for 1/sqrt(qk_head_dim); YaRN's is rope.yarn_softmax_scale."""

    hidden_size: int
    num_heads: int  # [num_attention_heads]
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    norm_eps: float = 1e-6
    softmax_scale: float | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim**-0.5 if self.softmax_scale is None else self.softmax_scale

    def cache_bytes_per_token(self, element_size: int) -> int:
        """Bytes the compressed decode cache holds per token and layer: the latent and the rotary key."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * element_size

    def problems(self) -> list[str]:
        """Why this shape cannot be built (empty when it can)."""
        sizes = ["hidden_size", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"]
        out = [f"{n}={getattr(self, n)}: must be >= 1" for n in sizes if getattr(self, n) < 1]
        if self.qk_nope_head_dim < 0:
            out.append(f"qk_nope_head_dim={self.qk_nope_head_dim}: must be >= 0")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            out.append(f"q_lora_rank={self.q_lora_rank}: must be >= 1, or null for a full-rank query projection")
        if self.qk_rope_head_dim % 2:
            out.append(f"qk_rope_head_dim={self.qk_rope_head_dim}: must be even (the rotary embedding turns pairs)")
        if self.norm_eps <= 0 or (self.softmax_scale is not None and self.softmax_scale <= 0):
            out.append(f"norm_eps={self.norm_eps} and softmax_scale={self.softmax_scale}: must be > 0")
        return out


@dataclass(frozen=True)
class MLACounts:
    """What the planner reads of a latent attention layer (models/attention_counts.py's interface), as its forward
    saves for backward (tests/test_deepseek_v3_plan.py measures it): per token on one tp rank of nh heads,

      latent_norms   per RMSNorm (the low-rank query's, the latent's): torch its input in fp32 (4 per element;
                     the latent is a view of kv_a's output, so in fp32 that whole output), the normalised copy and
                     rsqrt 4; the Triton norm its input (the latent: kv_a's whole output) and rsqrt; and its output,
                     the up-projection's input
      qkv            the kernel's q and k a*nh*qk_head_dim each, and kv_b's output a*nh*(qk_nope + v) (v is a view)
      softmax_stats  logsumexp 4 per head
      kernel_output  the kernel's output a*nh*v_head_dim (selective recompute frees it, and softmax_stats)
      attn_output    the output projection's input a*nh*v_head_dim, a copy of it (the heads are contiguous)
    The rotated parts of q and k are concatenated into them (no rope term); the down-projections' input is the
    layer's norm output. Widths are for a kernel that takes v narrower than q/k as it is (cuDNN, memory-efficient;
    the flash kernels pad it)."""

    cfg: MLAConfig

    @property
    def rope_width(self) -> int:
        return self.cfg.qk_rope_head_dim

    @property
    def kernel_head_dim(self) -> int:
        return self.cfg.qk_head_dim

    @property
    def kernel_input_width(self) -> int:
        return self.cfg.num_heads * (2 * self.cfg.qk_head_dim + self.cfg.v_head_dim)

    @property
    def decode_cache_width(self) -> int:
        return self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim  # the compressed cache (mla_cache.py)

    @property
    def fused_rope(self) -> bool:
        return False  # its rotary embedding is on part of each head: the torch expression

    @property
    def recomputed(self) -> tuple[str, ...]:
        return ("softmax_stats", "kernel_output")

    def gathered_kv_width(self, tp: int) -> float:
        return float(self.cfg.num_heads // tp * (self.cfg.qk_head_dim + self.cfg.v_head_dim))

    def saved(self, act_bytes: int, tp: int, kernels: LayerKernels, cp: int) -> dict[str, float]:
        c, a = self.cfg, act_bytes
        nh = c.num_heads // tp
        fused = kernels.norms or kernels.compiled

        def norm(width: int, storage: int) -> float:  # storage: the elements of the tensor its input is a view of
            saved_input = a * storage if fused else 4 * (storage if a == 4 else width) + a * width
            return saved_input + 4 + a * width  # + rsqrt, + its output (the up-projection's input)

        latent_norms = norm(c.kv_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim)
        if c.q_lora_rank is not None:
            latent_norms += norm(c.q_lora_rank, c.q_lora_rank)
        qkv = a * nh * (2 * c.qk_head_dim + c.qk_nope_head_dim + c.v_head_dim)
        if cp > 1:  # the kernel holds the gathered K/V: of the local tensors only q stays
            qkv = a * nh * c.qk_head_dim
        return {
            "latent_norms": latent_norms,
            "qkv": qkv,
            "gathered_kv": cp * a * self.gathered_kv_width(tp) if cp > 1 else 0.0,
            "softmax_stats": 4 * nh,
            "kernel_output": a * nh * c.v_head_dim,
            "attn_output": a * nh * c.v_head_dim,
        }


_Pair = tuple[torch.Tensor, torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class MLAttention(nn.Module):
    """Multi-head latent attention, called as every attention layer is: (x, inputs), a LayerInput whose cos and sin
    are for qk_rope_head_dim (layers.rope_cos_sin: under YaRN its attention factor included)."""

    # How tensor parallelism splits it (parallel/tensor.py): the per-head projections by heads (q / q_b and kv_b
    # are laid out head after head, so a contiguous slice of their rows is a set of whole heads; o takes the
    # matching columns); the down-projections whole on every rank ("replicated"), their norms too. The rotary key
    # reaches every rank's heads through no column-parallel layer: `shared_key` is where tensor parallelism makes
    # it whole (a sequence all-gather under sequence parallelism; identity forward, all-reduced gradient without).
    tp_plan = {"q": "column", "q_b": "column", "kv_b": "column", "o": "row", "q_a": "replicated", "kv_a": "replicated"}
    tp_parallel_inputs = ("shared_key",)
    core: Callable[..., torch.Tensor]  # attend, or a wrapper of it
    cache_kind = MLACache  # the decode cache it keeps (the transformer makes one per layer)

    def __init__(self, cfg: MLAConfig):
        super().__init__()
        problems = cfg.problems()
        if problems:
            raise ConfigError("multi-head latent attention: " + "; ".join(problems))
        self.cfg = cfg
        self.num_heads = cfg.num_heads
        q_rows = cfg.num_heads * cfg.qk_head_dim
        low_rank = cfg.q_lora_rank is not None
        self.q = None if low_rank else nn.Linear(cfg.hidden_size, q_rows, bias=False)
        self.q_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False) if cfg.q_lora_rank else None
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps) if cfg.q_lora_rank else None
        self.q_b = nn.Linear(cfg.q_lora_rank, q_rows, bias=False) if cfg.q_lora_rank else None
        self.kv_a = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        kv_rows = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b = nn.Linear(cfg.kv_lora_rank, kv_rows, bias=False)
        self.o = nn.Linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden_size, bias=False)
        # The softmax scale folded into the queries (see the module docstring), as attend runs and absorbed.
        default = cfg.softmax_scale is None
        self.q_scale = 1.0 if default else cfg.scale * math.sqrt(cfg.qk_head_dim)
        self.absorbed_q_scale = cfg.scale * math.sqrt(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.shared_key: Callable[[torch.Tensor], torch.Tensor] = _identity  # tensor parallelism's (see tp_plan)
        self.core = attend  # replaceable: selective recompute and context parallelism wrap it
        self.backend = "auto"  # an ATTENTION_BACKENDS name: this model's choice (models/kernels.py)

    @property
    def flops_width(self) -> float:
        """Its width in the FLOP formula (models/inventory.py): the mean of the query·key width (heads x
        qk_head_dim) and the probability·value width (heads x v_head_dim)."""
        return self.num_heads * (self.cfg.qk_head_dim + self.cfg.v_head_dim) / 2

    @property
    def counts(self) -> MLACounts:
        """What the planner reads of it (models/attention_counts.py): saved activations, cache and widths."""
        return MLACounts(self.cfg)

    def forward(self, x: torch.Tensor, inputs: LayerInput) -> torch.Tensor:
        """x (batch, seq, hidden). inputs.cache: this layer's compressed cache (an MLACache); the new tokens'
        latents join it, and after cached tokens the queries attend in the absorbed form."""
        cos, sin, mask, cache = inputs.cos, inputs.sin, inputs.mask, inputs.cache
        q = self._queries(x, cos, sin)
        latent, k_pe = self.kv_a(x).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        # the rotary key: (batch, 1, seq, rope), one head for all
        kv = self.kv_norm(latent), apply_rope(self.shared_key(k_pe).unsqueeze(1), cos, sin)
        if cache is None or cache.first_fill():
            if cache is not None:  # a prefill: attends to itself only, as training does; the cache keeps its latents
                cache.append(kv[0].unsqueeze(1), kv[1])
            out = self._expanded(q, kv, mask)
        else:
            out = self._absorbed(q, kv, mask, cache)
        batch, seq = out.shape[0], out.shape[2]
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))

    def _queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> _Pair:
        """(q_nope, rotated q_pe), each (batch, heads, seq, dim)."""
        if self.q is not None:
            q = self.q(x)
        else:
            assert self.q_a is not None and self.q_norm is not None and self.q_b is not None
            q = self.q_b(self.q_norm(self.q_a(x)))
        batch, seq, _ = q.shape  # sequence parallelism: x is a sequence shard, q the whole sequence
        q = q.view(batch, seq, -1, self.cfg.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim], dim=-1)
        return q_nope, apply_rope(q_pe, cos, sin)

    def _expanded(self, q: _Pair, kv: _Pair, mask: AttentionMask | None) -> torch.Tensor:
        """Keys and values per head from the latents (training, a prefill): (batch, heads, seq, v_head_dim).
        q: (q_nope, rotated q_pe); kv: (normalised latent (batch, seq, rank), rotated k_pe (batch, 1, seq, rope))."""
        (q_nope, q_pe), (latent, k_pe) = q, kv
        kv_b = self.kv_b(latent)
        batch, seq, _ = kv_b.shape
        nope, dv = self.cfg.qk_nope_head_dim, self.cfg.v_head_dim
        k_nope, v = kv_b.view(batch, seq, -1, nope + dv).transpose(1, 2).split([nope, dv], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        queries = torch.cat([q_nope, q_pe], dim=-1)
        if self.q_scale != 1.0:
            queries = queries * self.q_scale
        return self.core(queries, k, v, mask, None, self.backend)

    def _absorbed(self, q: _Pair, kv: _Pair, mask: AttentionMask | None, cache: MLACache) -> torch.Tensor:
        """The queries after a cache, in latent space over the cached latents: (batch, heads, seq, v_head_dim)."""
        (q_nope, q_pe), (latent, k_pe) = q, kv
        offset = cache.length  # the tokens before these (aligned), read before the append
        keys, values = cache.append(latent.unsqueeze(1), k_pe)
        nope = self.cfg.qk_nope_head_dim
        # kv_b's rows, head after head: [key part (nope); value part (v_head_dim)] x kv_lora_rank
        w = self.kv_b.weight.view(-1, nope + self.cfg.v_head_dim, self.cfg.kv_lora_rank)
        q_latent = torch.einsum("bhsn,hnr->bhsr", q_nope, w[:, :nope])
        queries = torch.cat([q_latent, q_pe], dim=-1) * self.absorbed_q_scale
        if (mask is None or mask.rows is None) and cache.owner.per_row:
            raise ValueError("a per-row cache decodes under decode_mask's rows (models/attention.py), not None")
        if mask is None:  # the causal rule after `offset` cached tokens (attend's None is from key 0)
            mask = attention_mask(queries.shape[2], None, None, queries.device, offset=offset)
        # the keys and values are the whole cache already: attend is given none to append to
        out = self.core(queries, keys, values, mask, None, self.backend)
        return torch.einsum("bhsr,hvr->bhsv", out, w[:, nope:])


# ---- transformers' names (DeepseekV3Attention, under model.layers.N.self_attn) ---------------------------------

HF_NAMES = {
    "q": "q_proj",
    "q_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "q_b": "q_b_proj",
    "kv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "kv_b": "kv_b_proj",
    "o": "o_proj",
}


def rotary_block(child: str, cfg: MLAConfig) -> int | None:
    """The rows of `child`'s weight come in blocks of this many, each ending in qk_rope_head_dim rotary rows whose
    order import and export change (rope.py); None: no rotary rows."""
    return {"q": cfg.qk_head_dim, "q_b": cfg.qk_head_dim, "kv_a": cfg.kv_lora_rank + cfg.qk_rope_head_dim}.get(child)


def state_from_hf(hf: Mapping[str, torch.Tensor], cfg: MLAConfig, rope_interleave: bool) -> dict[str, torch.Tensor]:
    """This module's state dict from a DeepseekV3Attention's (names relative to self_attn). rope_interleave:
    transformers' flag (True in DeepSeek's published configs): the rotary rows are pairs, reordered to halves."""
    ours = {theirs: child for child, theirs in HF_NAMES.items()}
    return _renamed(hf, cfg, ours, ours, halves_from_interleaved if rope_interleave else None)


def state_to_hf(state: Mapping[str, torch.Tensor], cfg: MLAConfig, rope_interleave: bool) -> dict[str, torch.Tensor]:
    """The inverse of `state_from_hf`."""
    same = {child: child for child in HF_NAMES}
    return _renamed(state, cfg, HF_NAMES, same, interleaved_from_halves if rope_interleave else None)


def _renamed(
    state: Mapping[str, torch.Tensor],
    cfg: MLAConfig,
    rename: Mapping[str, str],
    ours: Mapping[str, str],
    reorder: Callable[[torch.Tensor, int, int], torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """Each tensor under its child's new name (`rename`), its rotary rows reordered where the child (by our name,
    `ours`) has them."""
    out = {}
    for key, t in state.items():
        child, leaf = key.split(".", 1)
        block = rotary_block(ours[child], cfg)
        moved = t if reorder is None or block is None else reorder(t, block, cfg.qk_rope_head_dim)
        out[f"{rename[child]}.{leaf}"] = moved
    return out


__all__ = ["HF_NAMES", "MLAConfig", "MLACounts", "MLAttention", "rotary_block", "state_from_hf", "state_to_hf"]
