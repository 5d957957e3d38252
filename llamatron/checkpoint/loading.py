"""A model's config and weights read from a checkpoint saved under any layout: what generation, export and a
training run's load (training/checkpointing.py) share. Each rank reads only the stored pieces overlapping the
boxes it holds (pieces.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch

from ..errors import CheckpointError
from ..models import ModelConfig, Transformer, build_model, config_from_dict
from ..parallel.param_spec import ParamSpec, ParamSpecs
from .pieces import Box, local_pieces
from .reader import CheckpointReader, read_meta, refuse_adapters


class BoxReader(Protocol):
    """What a load reads from: any box of a stored tensor, by kind and global name (CheckpointReader)."""

    def read(self, kind: str, name: str, box: Box | None = None) -> torch.Tensor: ...


class TensorsInMemory:
    """Full tensors held in memory, by global name, read as the weights (`model`) of a checkpoint: what a
    load of something small that is not a checkpoint (a PEFT adapter) reads through."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = dict(tensors)

    def read(self, kind: str, name: str, box: Box | None = None) -> torch.Tensor:
        t = self.tensors[name]
        return t if box is None else t[box.slices_within(Box.whole(tuple(t.shape)))]


def read_model_config(path: str) -> ModelConfig:
    meta = read_meta(path)  # outside the try: its own errors (no checkpoint there, say) say what is wrong
    try:
        return config_from_dict(meta["model_config"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: the model_config in its meta.json is not a model's ({err})") from None


def check_checkpoint_fits(
    path: str, model_cfg: ModelConfig, model_name: str, added: Mapping[str, tuple[int, ...]] | None = None
) -> None:
    """Before any memory is spent on the model: the checkpoint holds this model's weights, and every file its
    index lists is there (the index and shapes are read, no tensor). added: see check_architecture."""
    reader = CheckpointReader(path)
    check_architecture(reader, model_cfg, model_name, added)
    missing = sorted(
        {
            (t.owner or reader).step_dir / piece.file
            for kind in reader.tensors.values()
            for t in kind.values()
            for piece in t.pieces
            if not ((t.owner or reader).step_dir / piece.file).is_file()
        }
    )
    if missing:
        raise CheckpointError(
            f"{missing[0].parent} is incomplete: {', '.join(m.name for m in missing[:8])} "
            f"{'is' if len(missing) == 1 else 'are'} listed in its index but missing; copy the "
            "whole checkpoint directory again, or load an earlier step-N"
        )


def check_architecture(
    reader: CheckpointReader,
    model_cfg: ModelConfig,
    model_name: str,
    added: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """Every weight of the model in the checkpoint with its full shape, and nothing else; `added`: parameters the
    run adds to the model (LoRA's adapters), which the checkpoint may hold (a resume) or not (a base model)."""
    expected = {n: tuple(p.shape) for n, p in build_model(model_cfg, device="meta").named_parameters()}
    added = added or {}
    problems = []
    for name, shape in {**expected, **added}.items():
        if not reader.has("model", name):
            problems += [] if name in added else [f"missing {name}"]
        elif reader.stored("model", name).shape != shape:
            problems.append(f"{name}: checkpoint {reader.stored('model', name).shape} vs model {shape}")
    problems += [f"unexpected {n}" for n in sorted(reader.names("model") - set(expected) - set(added))]
    if problems:  # the problem and the fix first: a model of another size differs in every weight
        more = f"\n  ... {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise CheckpointError(
            f"checkpoint {reader.step_dir} does not fit this model ({model_name}), {len(problems)} weights differ; "
            "load a checkpoint of this model, or leave out --model: --load then takes the checkpoint's own "
            "architecture\n  " + "\n  ".join(problems[:_SHOWN]) + more
        )


_SHOWN = 5  # weights a mismatch lists


def read_into(reader: BoxReader, kind: str, spec: ParamSpec, dst: torch.Tensor, start: int) -> None:
    """Fill `dst`, the flat range [start, start + len(dst)) of the local tensor of `spec`, from the checkpoint."""
    for piece in local_pieces(spec, start, start + dst.numel(), owned_only=False):
        piece.view(dst).copy_(reader.read(kind, spec.global_name, piece.box))


@torch.no_grad()
def read_weights(reader: BoxReader, params: Iterable[tuple[torch.Tensor, ParamSpec]], kind: str = "model") -> None:
    """Each parameter's part of its full tensor (as its spec says: a tensor-parallel shard, or all of it)."""
    for p, spec in params:
        read_into(reader, kind, spec, p.detach().view(-1), 0)


def load_model_weights(reader: CheckpointReader, model: Transformer, specs: ParamSpecs) -> dict[str, Any]:
    """The weights `reader` holds (a checkpoint saved under any layout) into `model` (materialised; its
    parameters' specs by local name, e.g. tensor-parallel shards); returns its meta.json. For models built from
    the checkpoint's own config (`read_model_config`): generation. A LoRA checkpoint is refused unless `reader`
    merges its adapters (adapters/merge.py)."""
    refuse_adapters(reader)
    check_architecture(reader, model.cfg, "its own model_config")
    read_weights(reader, ((p, specs[name]) for name, p in model.named_parameters()))
    return reader.run_meta


__all__ = [
    "BoxReader",
    "TensorsInMemory",
    "check_architecture",
    "check_checkpoint_fits",
    "load_model_weights",
    "read_into",
    "read_model_config",
    "read_weights",
]
