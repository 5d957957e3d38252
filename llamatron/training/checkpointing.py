"""A run's checkpoints (the format is checkpoint/'s): save under any tp/pp/vpp/dp, resume under any other.

`save_checkpoint` writes DIR/step-N: every rank its own pieces of the
weights, fp32 master weights (when separate from the weights), the optimizer's
state (the kinds it declares) and step counts, plus its RNG states; rank 0 adds meta.json (step,
consumed_samples, the resolved config, the layout) and index.json, renames
the directory into place and then points DIR/latest at it (writer.py; the
format is described in reader.py). It is `begin_save` then
`finish_pending_save`; with --async-save the `Checkpointing` of a run writes
in the background and publishes at the next save or when training ends.

`load_checkpoint` gives every rank exactly its shards: for each local
parameter and optimizer segment it computes the full-tensor boxes it holds
(pieces.py) and reads only the stored pieces overlapping them. Vocabulary
padding is never stored, so tp=2 loads at tp=4 or tp=1; the learning-rate
schedule is a function of the step, so restoring the step restores it.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..adapters.targets import adapter_shapes
from ..checkpoint.loading import check_architecture, read_into, read_weights
from ..checkpoint.reader import BASE_KEY, CheckpointReader, base_reference, rng_file, saved_lora_settings
from ..checkpoint.rng import restore_rng
from ..checkpoint.writer import PendingSave, engine_params, finish, start_save
from ..config.settings import RunConfig, TrainConfig
from ..errors import CheckpointError, TrainingAborted
from ..optim import lr_at
from .engine import Engine
from .faults import NO_FAULTS, FaultInjection

FORMAT_VERSION = 2


def _layout(engine: Engine) -> dict[str, Any]:
    m, p = engine.mesh.layout, engine.cfg.parallel
    return {
        "world_size": m.world_size,
        "tp": m.tp,
        "pp": m.pp,
        "vpp": len(engine.chunks),
        "dp": m.dp,
        "cp": m.cp,
        "distributed_optimizer": engine.optimizer.distributed,
        "sequence_parallel": p.sequence_parallel,
        "dtype": str(engine.dtype).removeprefix("torch."),
    }


def _meta(
    engine: Engine, step: int, consumed_samples: int, skipped_steps: int, inherited_meta: dict[str, Any]
) -> dict[str, Any]:
    cfg, o = engine.cfg, engine.cfg.optim
    scaler = engine.loss_scaler  # fp16: the same on every rank
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "consumed_samples": consumed_samples,
        "config": cfg.to_dict(),
        "model_config": engine.model_cfg.to_dict(),
        "layout": _layout(engine),
        "has_master_weights": not engine.optimizer.master_is_param,
        "lr_schedule": {
            "completed_steps": step,
            "next_lr": lr_at(step, o.lr, o.min_lr, o.warmup_steps, cfg.train.train_steps, o.lr_schedule),
        },
        "loss_scaler": None if scaler is None else scaler.state_dict(),
        "skipped_steps": skipped_steps,
        **({"chat_tuned": True} if cfg.data.sft_data else {}),  # export-hf ships the chat format (hf_io.py)
        **inherited_meta,
    }


def meta_to_inherit(meta: dict[str, Any], path: str | None = None, adapters: bool = False) -> dict[str, Any]:
    """What a loaded checkpoint's meta passes on to the run's saves: where the weights came from (Hugging Face
    config, tokenizer) and whether they were fine-tuned on conversations, which export-hf needs; and the base
    checkpoint that holds the frozen weights of a run that trains `adapters` (LoRA): the loaded checkpoint at
    `path` when it is a plain model's, else the base it names. The saves then hold only what trains."""
    out = {k: meta[k] for k in ("hf", "tokenizer", "chat_tuned", BASE_KEY) if k in meta}
    if adapters and path and not saved_lora_settings(meta).get("lora_rank"):
        out[BASE_KEY] = base_reference(path)
    return out


def begin_save(
    engine: Engine,
    root: str,
    step: int,
    consumed_samples: int,
    skipped_steps: int = 0,
    *,
    background: bool = False,
    keep_last: int = 0,
    inherited_meta: dict[str, Any] | None = None,
    fail: bool = False,
) -> PendingSave:
    """Write this rank's files of checkpoint `step` into `root` (in a thread with `background`);
    `finish_pending_save` publishes it.

    skipped_steps: non-finite steps skipped so far in the run, which a resumed run continues counting;
    keep_last: --keep-last; inherited_meta: `meta_to_inherit` of the loaded checkpoint; fail: an injected fault."""
    check_weights_finite(engine, step, root)
    meta = _meta(engine, step, consumed_samples, skipped_steps, inherited_meta or {})
    return start_save(engine, root, step, meta, background=background, keep_last=keep_last, fail=fail)


def check_weights_finite(engine: Engine, step: int, root: str | Path) -> None:
    """Refuse to save weights with a NaN or an infinity (a corrupt load, a diverged step that was not skipped):
    such a checkpoint could only replace a good one. Every rank checks its own and learns of any other's."""
    bad = torch.zeros((), device=engine.device)
    for buf in engine.buffers:
        bad += (~torch.isfinite(buf.param_data)).any()
    if dist.is_initialized():
        dist.all_reduce(bad)
    if bad.item():
        raise TrainingAborted(
            f"the weights after step {step} hold NaN or infinite values: not saved, so {root}/latest still names "
            "the last good checkpoint; resume from it (a lower --lr, or check the data and the checkpoint loaded)"
        )


def finish_pending_save(engine: Engine, pending: PendingSave) -> str:
    """Wait for the save's writes on every rank, then publish it; returns its directory (collective: call it
    on every rank)."""
    return finish(engine, pending)


def save_checkpoint(engine: Engine, root: str, step: int, consumed_samples: int, skipped_steps: int = 0) -> str:
    """Save checkpoint `step` into `root` and publish it; returns its directory."""
    return finish_pending_save(engine, begin_save(engine, root, step, consumed_samples, skipped_steps))


def resume_problems(finetune: bool, load: str | None) -> list[str]:
    """--finetune starts from a checkpoint's weights: it needs one."""
    return ["--finetune needs --load CHECKPOINT"] if finetune and not load else []


class Checkpointing:
    """A run's saves: --save, --save-interval, --keep-last and --async-save; the save still being written in
    the background; and what the loaded checkpoint passes on to them (`meta_to_inherit`)."""

    def __init__(
        self, t: TrainConfig, inherited_meta: dict[str, Any] | None = None, faults: FaultInjection = NO_FAULTS
    ):
        self.root = t.save or ""  # "": no --save, nothing is saved
        self.interval, self.keep_last, self.background = t.save_interval, t.keep_last, t.async_save
        self.inherited_meta = inherited_meta or {}
        self.faults = faults
        self.pending: PendingSave | None = None

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        """Save after (1-based) `step`: every --save-interval steps, after the last one and before a stop."""
        return bool(self.root) and (bool(self.interval and step % self.interval == 0) or last or stopping)

    def save(self, engine: Engine, step: int, consumed_samples: int, skipped_steps: int) -> str:
        """Save checkpoint `step`; returns its directory (published already unless --async-save)."""
        self.finish(engine)  # one save at a time: the previous one is published before this one starts
        pending = begin_save(
            engine,
            self.root,
            step,
            consumed_samples,
            skipped_steps,
            background=self.background,
            keep_last=self.keep_last,
            inherited_meta=self.inherited_meta,
            fail=self.faults.fail_save == (step, engine.mesh.rank),
        )
        if pending.thread is None:  # written (or failed) already: publish it, or say why not, now
            return finish_pending_save(engine, pending)
        self.pending = pending
        return str(pending.final)

    def finish(self, engine: Engine) -> str | None:
        """Wait for an --async-save in progress and publish it (call on every rank: it is collective)."""
        pending, self.pending = self.pending, None
        return None if pending is None else finish_pending_save(engine, pending)


@torch.no_grad()
def _fill_master(reader: CheckpointReader, opt, i: int) -> None:
    """Separate fp32 master weights: the stored ones, else the weights (a checkpoint saved in fp32, or imported)."""
    seg = opt.segments[i]
    read_into(reader, "master" if reader.has("master") else "model", seg.spec, opt.master[i], seg.param_offset)


def load_checkpoint(engine: Engine, path: str, weights_only: bool = False) -> dict[str, Any]:
    """Restore the checkpoint into the engine (weights only with `weights_only`); returns its meta.json."""
    reader = CheckpointReader(path)
    meta = reader.run_meta
    if meta.get("weights_only") and not weights_only:  # e.g. from `llamatron import-hf`: no optimizer state
        raise CheckpointError(
            f"weights-only checkpoint: add --finetune to train from {reader.step_dir} "
            f"(it has no optimizer state or step to resume)"
        )
    check_adapters(meta, engine.cfg)
    lo = engine.cfg.lora
    added = adapter_shapes(engine.model_cfg, lo.lora_rank, lo.lora_targets)  # the whole model's, on any stage
    check_architecture(reader, engine.model_cfg, engine.cfg.train.model, added)
    opt = engine.optimizer
    # An fp32 run resuming a bf16 one takes the fp32 master weights, not their bf16 rounding.
    weights_kind = "master" if opt.master_is_param and reader.has("master") else "model"
    # --finetune from a checkpoint of the plain model: parameters added to it (LoRA's adapters) keep their init.
    fresh = set(added) - reader.names("model") if weights_only else set()
    kept = [(p, spec) for p, spec in engine_params(engine) if spec.global_name not in fresh]
    if all(buf.holds_full_params for buf in engine.buffers):
        read_weights(reader, kept, weights_kind)
    else:  # --fsdp: each rank reads only its shard of each parameter (its optimizer segments)
        with torch.no_grad():
            for seg in opt.segments:
                shard = seg.buffer.param_data[seg.buffer.local(seg.start, seg.end)]
                read_into(reader, weights_kind, seg.spec, shard, seg.param_offset)
    if weights_only:
        if not opt.master_is_param:  # a fresh optimizer, whose master weights start from the loaded ones
            for i, seg in enumerate(opt.segments):
                if seg.spec.global_name not in fresh:
                    _fill_master(reader, opt, i)
        return meta
    _check_optimizer_state(reader, engine)
    with torch.no_grad():
        for i, seg in enumerate(opt.segments):
            spec, start = seg.spec, seg.param_offset
            for kind, state in opt.state(i).items():  # the kinds the optimizer declares (llamatron/optim/)
                read_into(reader, kind, spec, state, start)
            if not opt.master_is_param:
                _fill_master(reader, opt, i)
            opt.steps[i].fill_(reader.read("step", spec.global_name).item())
    scaler = engine.loss_scaler
    if scaler is not None and meta.get("loss_scaler"):  # else (from bf16/fp32) the initial scale, as at the start
        scaler.load_state_dict(meta["loss_scaler"])
    _restore_rng(reader, engine)
    return meta


def _check_optimizer_state(reader: CheckpointReader, engine: Engine) -> None:
    """The checkpoint holds the state this run's optimizer keeps, for every tensor this rank updates."""
    saved = (reader.run_meta.get("config") or {}).get("optim", {}).get("optimizer", "adamw")
    now = engine.cfg.optim.optimizer
    if saved != now:
        raise CheckpointError(
            f"{reader.step_dir} was trained with --optimizer {saved}, this run uses --optimizer {now}: resume it "
            f"with --optimizer {saved}, or start from its weights with --finetune"
        )
    opt = engine.optimizer
    for i, seg in enumerate(opt.segments):
        for kind in (*opt.state(i), "step"):
            if not reader.has(kind, seg.spec.global_name):
                raise CheckpointError(f"{reader.step_dir} has no optimizer state; resume it with --finetune")


def check_adapters(meta: dict[str, Any], cfg: RunConfig) -> None:
    """A LoRA checkpoint is resumed (or fine-tuned further) with the adapters it was trained with."""
    saved = saved_lora_settings(meta)
    if not saved.get("lora_rank"):
        return
    if cfg.lora.lora_init_from:
        raise CheckpointError(
            f"the checkpoint holds LoRA adapters, which would replace --lora-init-from {cfg.lora.lora_init_from}: "
            "drop one of the two"
        )
    now = asdict(cfg.lora)
    if any(saved.get(k) != now[k] for k in ("lora_rank", "lora_alpha", "lora_targets")):
        flags = " ".join(
            f"--lora-{k[5:]} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in saved.items()
            if k in ("lora_rank", "lora_alpha", "lora_targets")
        )
        raise CheckpointError(f"the checkpoint holds LoRA adapters trained with {flags}: load it with those flags")


def _restore_rng(reader: CheckpointReader, engine: Engine) -> None:
    """Each rank's RNG states, when the layout is the one that saved them (otherwise rank r's state means nothing)."""
    saved = reader.run_meta.get("layout", {})
    now = _layout(engine)
    if any(saved.get(k, 1 if k == "cp" else None) != now[k] for k in ("world_size", "tp", "pp", "vpp", "dp", "cp")):
        return
    restore_rng(reader.step_dir / rng_file(engine.mesh.rank))


__all__ = [
    "Checkpointing",
    "begin_save",
    "check_adapters",
    "finish_pending_save",
    "load_checkpoint",
    "meta_to_inherit",
    "save_checkpoint",
]
