"""Checkpoints that do not depend on the layout: save under any tp/pp/vpp/dp, resume under any other.

`save_checkpoint` writes DIR/step-N: every rank its own pieces of the
weights, fp32 master weights (when separate from the weights), AdamW moments
and step counts, plus its RNG states; rank 0 adds meta.json (step,
consumed_samples, the resolved config, the layout) and index.json, renames
the directory into place and then points DIR/latest at it (writer.py; the
format is described in reader.py). With --async-save the writing runs in the
background and is published at the next save or when training ends
(`finish_pending_save`).

`load_checkpoint` gives every rank exactly its shards: for each local
parameter and optimizer segment it computes the full-tensor boxes it holds
(pieces.py) and reads only the stored pieces overlapping them. Vocabulary
padding is never stored, so tp=2 loads at tp=4 or tp=1; the learning-rate
schedule is a function of the step, so restoring the step restores it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..models import ModelConfig, build_model
from ..parallel.optimizer import lr_at
from ..parallel.param_spec import ParamSpec
from ..errors import CheckpointError
from .pieces import local_pieces
from .reader import CheckpointReader, read_meta, rng_file
from .writer import PendingSave, engine_params, finish, set_rng_state, start_save

FORMAT_VERSION = 2


def _layout(engine) -> dict[str, Any]:
    m, p = engine.mesh, engine.cfg.parallel
    return {"world_size": m.world_size, "tp": m.tp, "pp": m.pp, "vpp": len(engine.chunks), "dp": m.dp,
            "distributed_optimizer": engine.optimizer.distributed, "sequence_parallel": p.sequence_parallel,
            "dtype": str(engine.dtype).removeprefix("torch.")}


def _meta(engine, step: int, consumed_samples: int, skipped_steps: int) -> dict[str, Any]:
    cfg, o = engine.cfg, engine.cfg.optim
    scaler = getattr(engine, "loss_scaler", None)  # fp16: the same on every rank
    return {"format_version": FORMAT_VERSION, "step": step, "consumed_samples": consumed_samples,
            "config": cfg.to_dict(), "model_config": engine.model_cfg.to_dict(), "layout": _layout(engine),
            "has_master_weights": not engine.optimizer.master_is_param,
            "lr_schedule": {"completed_steps": step, "next_lr": lr_at(step, o.lr, o.min_lr, o.warmup_steps,
                                                                       cfg.train.train_steps, o.lr_schedule)},
            "loss_scaler": None if scaler is None else scaler.state_dict(),
            "skipped_steps": skipped_steps, **getattr(engine, "inherited_meta", {})}


def save_checkpoint(engine, root: str, step: int, consumed_samples: int, skipped_steps: int = 0) -> str:
    """Save checkpoint `step` into `root`; returns its directory (published already unless --async-save).

    skipped_steps: non-finite steps skipped so far in the run, which a resumed run continues counting."""
    finish_pending_save(engine)  # one save at a time: the previous one is published before this one starts
    pending = start_save(engine, root, step, _meta(engine, step, consumed_samples, skipped_steps),
                         background=engine.cfg.train.async_save)
    if pending.thread is None:
        return finish(engine, pending)
    engine.pending_save = pending
    return str(pending.final)


def finish_pending_save(engine) -> str | None:
    """Wait for an --async-save in progress and publish it (call on every rank: it is collective)."""
    pending: PendingSave | None = getattr(engine, "pending_save", None)
    if pending is None:
        return None
    engine.pending_save = None
    return finish(engine, pending)


def read_model_config(path: str) -> ModelConfig:
    return ModelConfig.from_dict(read_meta(path)["model_config"])


def check_checkpoint_fits(path: str, model_cfg: ModelConfig, model_name: str) -> None:
    """Before any memory is spent on the model: the checkpoint holds this model's weights, and every file its
    index lists is there (the index and shapes are read, no tensor)."""
    reader = CheckpointReader(path)
    _check_architecture(reader, model_cfg, model_name)
    missing = sorted({piece.file for kind in reader.tensors.values() for t in kind.values() for piece in t.pieces
                      if not (reader.step_dir / piece.file).is_file()})
    if missing:
        raise CheckpointError(f"{reader.step_dir} is incomplete: {', '.join(missing[:8])} "
                              f"{'is' if len(missing) == 1 else 'are'} listed in its index but missing; copy the "
                              "whole checkpoint directory again, or load an earlier step-N")


def _check_architecture(reader: CheckpointReader, model_cfg: ModelConfig, model_name: str) -> None:
    """Every weight of the model in the checkpoint with its full shape, and nothing else."""
    expected = {n: tuple(p.shape) for n, p in build_model(model_cfg, device="meta").named_parameters()}
    problems = []
    for name, shape in expected.items():
        if not reader.has("model", name):
            problems.append(f"missing {name}")
        elif reader.stored("model", name).shape != shape:
            problems.append(f"{name}: checkpoint {reader.stored('model', name).shape} vs model {shape}")
    problems += [f"unexpected {n}" for n in sorted(reader.names("model") - set(expected))[:10]]
    if problems:
        raise CheckpointError(f"checkpoint {reader.step_dir} does not fit this model ({model_name}):\n  "
                              + "\n  ".join(problems[:40]) + "\nload a checkpoint of this model, or leave out "
                              "--model: --load then takes the checkpoint's own architecture")


def _read_into(reader: CheckpointReader, kind: str, spec: ParamSpec, dst: torch.Tensor, start: int) -> None:
    """Fill `dst`, the flat range [start, start + len(dst)) of the local tensor of `spec`, from the checkpoint."""
    for piece in local_pieces(spec, start, start + dst.numel(), owned_only=False):
        piece.view(dst).copy_(reader.read(kind, spec.global_name, piece.box))


@torch.no_grad()
def _fill_master(reader: CheckpointReader, opt, i: int) -> None:
    """Separate fp32 master weights: the stored ones, else the weights (a checkpoint saved in fp32, or imported)."""
    seg = opt.segments[i]
    _read_into(reader, "master" if reader.has("master") else "model", seg.spec, opt.master[i], seg.param_offset)


def load_checkpoint(engine, path: str, weights_only: bool = False) -> dict[str, Any]:
    reader = CheckpointReader(path)
    meta = reader.run_meta
    if meta.get("weights_only") and not weights_only:  # e.g. from `llamatron import-hf`: no optimizer state
        raise CheckpointError(f"weights-only checkpoint: add --finetune to train from {reader.step_dir} "
                              f"(it has no optimizer state or step to resume)")
    # Where the weights came from (Hugging Face config, tokenizer) is kept by later saves, for export-hf.
    engine.inherited_meta = {k: meta[k] for k in ("hf", "tokenizer") if k in meta}
    _check_architecture(reader, engine.model_cfg, engine.cfg.train.model)
    opt = engine.optimizer
    # An fp32 run resuming a bf16 one takes the fp32 master weights, not their bf16 rounding.
    weights_kind = "master" if opt.master_is_param and reader.has("master") else "model"
    with torch.no_grad():
        for p, spec in engine_params(engine):
            _read_into(reader, weights_kind, spec, p.detach().view(-1), 0)
    if weights_only:
        if not opt.master_is_param:  # a fresh optimizer, whose master weights start from the loaded ones
            for i in range(len(opt.segments)):
                _fill_master(reader, opt, i)
        return meta
    if not all(reader.has(kind) for kind in ("exp_avg", "exp_avg_sq", "step")):
        raise CheckpointError(f"{reader.step_dir} has no optimizer state; resume it with --finetune")
    with torch.no_grad():
        for i, seg in enumerate(opt.segments):
            spec, start = seg.spec, seg.param_offset
            _read_into(reader, "exp_avg", spec, opt.exp_avg[i], start)
            _read_into(reader, "exp_avg_sq", spec, opt.exp_avg_sq[i], start)
            if not opt.master_is_param:
                _fill_master(reader, opt, i)
            opt.steps[i].fill_(reader.read("step", spec.global_name).item())
    scaler = getattr(engine, "loss_scaler", None)
    if scaler is not None and meta.get("loss_scaler"):  # else (from bf16/fp32) the initial scale, as at the start
        scaler.load_state_dict(meta["loss_scaler"])
    _restore_rng(reader, engine)
    return meta


def _restore_rng(reader: CheckpointReader, engine) -> None:
    """Each rank's RNG states, when the layout is the one that saved them (otherwise rank r's state means nothing)."""
    saved = reader.run_meta.get("layout", {})
    now = _layout(engine)
    if any(saved.get(k) != now[k] for k in ("world_size", "tp", "pp", "vpp", "dp")):
        return
    path = reader.step_dir / rng_file(engine.mesh.rank)
    if path.is_file():
        set_rng_state(torch.load(path, weights_only=False))


__all__ = ["check_checkpoint_fits", "finish_pending_save", "load_checkpoint", "read_model_config", "save_checkpoint"]
