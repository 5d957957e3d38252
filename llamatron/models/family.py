"""A model family as a plug-in: everything llamatron knows about one family, in one object.

A family lives in its own folder under models/families/ and is registered by one line in
models/families/__init__.py. It says how to build its decoder layers and final norm (from the shared blocks of
models/ or its own), which options of ModelConfig it has, its named shapes (presets), and how its Hugging Face
files map to llamatron's: config.json's keys and model_type(s), and the weights' names (models/hf_format.py).
Tensor parallelism reads each block's `tp_plan`; parameter and FLOP counts come from the layers themselves, built
on the meta device (models/inventory.py); the planner and the kernel settings read the layers' features from there.
No module outside models/families/ branches on a family's name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from .config import ModelConfig
from .hf_format import TensorRule
from .layer_input import LayerInput

C = TypeVar("C", bound=ModelConfig)


def no_problems(cfg: ModelConfig) -> list[str]:
    return []


@dataclass(frozen=True)
class ExtraHeadInputs:
    """What extra heads read from the model besides its hidden states and input ids: its embedding and head
    (logits of a hidden state), what its layers read (`layer`: the rotary tables and the attention mask of the whole
    sequence, no cache), which the heads' own layers read too, and under context parallelism the positions in the
    input ids (the whole sequence's) of the hidden states' tokens (None: all)."""

    embed: Callable[[torch.Tensor], torch.Tensor]
    head: Callable[[torch.Tensor], torch.Tensor]
    layer: LayerInput
    positions: torch.Tensor | None = None


class ExtraHeads(Protocol):
    """A family's predictions beyond the next token, built on the last stage (Family.extra_heads): from the final
    hidden states (before the norm) and the input ids, logits whose position i predicts label i + offsets[j]
    (label i: token i + 1); training adds their cross entropy times `loss_weight` (objectives/extra_heads.py)."""

    offsets: tuple[int, ...]
    loss_weight: float
    stat_name: str  # the logged field of their unweighted loss

    def __call__(self, hidden: torch.Tensor, tokens: torch.Tensor, inputs: ExtraHeadInputs) -> list[torch.Tensor]: ...


def no_extra_heads(cfg: ModelConfig) -> nn.Module | None:
    return None


def same_layers(cfg: ModelConfig, index: int) -> tuple:
    """Layers differ only where the config's per-layer options say (experts or not, width, rotary or not)."""
    return cfg.layer_variant(index)


@dataclass(frozen=True)
class HFAdapter(Generic[C]):
    """A family's Hugging Face format: the model_types of config.json it reads, and the conversions (typed by the
    family's config class C)."""

    model_types: tuple[str, ...]
    # config.json -> ModelConfig (HFConversionError for what the family cannot represent)
    config_from_hf: Callable[[Mapping[str, Any]], ModelConfig]
    # ModelConfig (and the config.json it came from, or {}) -> the family's own keys: model_type, architectures,
    # the shape in the family's names; the keys every family shares are written by interop/hf.py
    config_to_hf: Callable[[C, Mapping[str, Any]], dict[str, Any]]
    # (cfg, config.json, the Hugging Face tensor names at hand or ()) -> every llamatron tensor's rule, in order
    weight_rules: Callable[[C, Mapping[str, Any], Collection[str]], list[TensorRule]]
    # A multimodal config.json of one of model_types -> (its text model's config.json, the prefix of the text model's
    # tensors), which import-hf converts alone; None for a text model's config.json
    text_model: Callable[[Mapping[str, Any]], tuple[dict[str, Any], str] | None] = lambda hf: None


@dataclass(frozen=True)
class Family(Generic[C]):
    """A family, typed by its config class C (ModelConfig, or the subclass in its folder that adds its own fields)."""

    name: str
    description: str  # what it covers, for messages and docs ("Llama 1/2/3, Code Llama, Mistral, Mixtral")
    block: Callable[[C, int], nn.Module]  # decoder layer `index` of a model
    final_norm: Callable[[C], nn.Module]
    presets: Mapping[str, Callable[[], C]]
    hf: HFAdapter[C]
    # Its config: ModelConfig, or a subclass in its folder holding what only this family's modules read (its
    # checkpoints' and presets' configs are of this class: config_from_dict picks it by the family's name)
    config_class: type[C] = ModelConfig  # type: ignore[assignment]
    # The ModelConfig options (the fields after init_std) this family's layers have; the others keep their defaults.
    options: frozenset[str] = frozenset()
    problems: Callable[[C], list[str]] = no_problems  # the family's own rules on a config
    # Layers of equal kind have equal shapes: models/inventory.py builds one of each on meta.
    layer_kind: Callable[[C, int], Any] = same_layers
    # Extra prediction heads on the last stage (an ExtraHeads, or None): predictions
    # further ahead than the next token (DeepSeek-V3's multi-token prediction) that training adds to the loss
    extra_heads: Callable[[C], nn.Module | None] = no_extra_heads
    # Other checkpoint formats its models come in, read by interop/ into Hugging Face names: Meta's consolidated
    # files (interop/meta_consolidated.py), Megatron-LM runs (interop/megatron.py).
    meta_format: MetaFormat | None = None
    megatron_format: MegatronFormat | None = None


@dataclass(frozen=True)
class MetaFormat:
    """A family's models as Meta's original `consolidated.NN.pth` + `params.json` store them."""

    # Meta's name (after "layers.N." for layer_names) -> (Hugging Face name, the dim model parallelism split or None)
    layer_names: Mapping[str, tuple[str, int | None]]
    global_names: Mapping[str, tuple[str, int | None]]
    # params.json's fields that are missing, of the wrong type or out of range, before any weight is read
    field_problems: Callable[[Mapping[str, Any]], list[str]]
    # (params.json, vocabulary, ffn width, dtype name) -> the Hugging Face config.json of those weights
    hf_config: Callable[[Mapping[str, Any], int, int, str], dict[str, Any]]
    # params.json's problems given the weights' (vocabulary, ffn width): a params.json of another model
    params_problems: Callable[[Mapping[str, Any], int, int], list[str]]


@dataclass(frozen=True)
class MegatronFormat:
    """A family's models as Megatron-LM runs store them: what the run's `args` must say, and the Hugging Face
    config.json and tensor names the reader presents."""

    args_problems: Callable[[Any], list[str]]  # each names the Megatron flag the family cannot be trained with
    hf_config: Callable[[Any, int, str], dict[str, Any]]  # (args, vocabulary kept, Megatron flavour) -> config.json
    # Hugging Face name within layer g -> (part: attn_norm, qkv, proj, mlp_norm, fc1, fc2; index in its outputs)
    hf_layer_names: Mapping[str, tuple[str, int]]
    hf_global_names: Mapping[str, str]  # part (embed, final_norm, head) -> Hugging Face name


def megatron_arg(args: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` a Megatron-LM run's args set (not None), else `default`: the flavours spell a flag
    differently, and a run's pickle has only the flags its version knew."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return default


__all__ = [
    "ExtraHeadInputs",
    "ExtraHeads",
    "Family",
    "HFAdapter",
    "MegatronFormat",
    "MetaFormat",
    "megatron_arg",
    "no_extra_heads",
    "no_problems",
    "same_layers",
]
