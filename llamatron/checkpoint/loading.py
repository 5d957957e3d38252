"""A model's config and weights read from a checkpoint saved under any layout: what generation, export and a
training run's load (training/checkpointing.py) share. Each rank reads only the stored pieces overlapping the
boxes it holds (pieces.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import CheckpointError
from ..models import ModelConfig, Transformer, build_model
from ..parallel.param_spec import ParamSpec, ParamSpecs
from .pieces import local_pieces
from .reader import CheckpointReader, read_meta, refuse_adapters


def read_model_config(path: str) -> ModelConfig:
    meta = read_meta(path)  # outside the try: its own errors (no checkpoint there, say) say what is wrong
    try:
        return ModelConfig.from_dict(meta["model_config"])
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
            piece.file
            for kind in reader.tensors.values()
            for t in kind.values()
            for piece in t.pieces
            if not (reader.step_dir / piece.file).is_file()
        }
    )
    if missing:
        raise CheckpointError(
            f"{reader.step_dir} is incomplete: {', '.join(missing[:8])} "
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
    problems += [f"unexpected {n}" for n in sorted(reader.names("model") - set(expected) - set(added))[:10]]
    if problems:
        raise CheckpointError(
            f"checkpoint {reader.step_dir} does not fit this model ({model_name}):\n  "
            + "\n  ".join(problems[:40])
            + "\nload a checkpoint of this model, or leave out "
            "--model: --load then takes the checkpoint's own architecture"
        )


def read_into(reader: CheckpointReader, kind: str, spec: ParamSpec, dst: torch.Tensor, start: int) -> None:
    """Fill `dst`, the flat range [start, start + len(dst)) of the local tensor of `spec`, from the checkpoint."""
    for piece in local_pieces(spec, start, start + dst.numel(), owned_only=False):
        piece.view(dst).copy_(reader.read(kind, spec.global_name, piece.box))


@torch.no_grad()
def read_weights(
    reader: CheckpointReader, params: Iterable[tuple[torch.Tensor, ParamSpec]], kind: str = "model"
) -> None:
    """Each parameter's part of its full tensor (as its spec says: a tensor-parallel shard, or all of it)."""
    for p, spec in params:
        read_into(reader, kind, spec, p.detach().view(-1), 0)


def load_model_weights(path: str, model: Transformer, specs: ParamSpecs) -> dict[str, Any]:
    """The weights of the checkpoint at `path`, saved under any layout, into `model` (materialised; its
    parameters' specs by local name, e.g. tensor-parallel shards); returns its meta.json. For models built from
    the checkpoint's own config (`read_model_config`): generation."""
    reader = CheckpointReader(path)
    refuse_adapters(reader)
    check_architecture(reader, model.cfg, "its own model_config")
    read_weights(reader, ((p, specs[name]) for name, p in model.named_parameters()))
    return reader.run_meta


__all__ = [
    "check_architecture",
    "check_checkpoint_fits",
    "load_model_weights",
    "read_into",
    "read_model_config",
    "read_weights",
]
