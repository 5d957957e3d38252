"""The training loop: build, step, evaluate, log, save."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from . import demo
from .checkpoint import (check_checkpoint_fits, finish_pending_save, load_checkpoint, read_model_config,
                         save_checkpoint, step_dirs, step_number)
from .config import RunConfig, validate
from .data import samples
from .data.batches import micro_batches_for_step, to_device
from .data.boundaries import DocumentBoundaries
from .data.mock import MockDataset
from .data.sft_dataset import build_sft_datasets
from .data.tokenizer import load_tokenizer
from .engine import Engine, build_engine, train_step
from .evaluation import evaluate, format_metrics
from .errors import ConfigError
from .faults import FaultGuard, explain_collective_failure, restore_signal_handlers
from .logging_sinks import build_metric_sinks
from .metrics import MetricsSink, Timer, peak_memory_gib, peak_tflops, throughput
from .models import ModelConfig
from .parallel.mesh import Mesh, build_mesh, init_distributed, sum_from_last_stage

@dataclass
class Datasets:
    train: Sequence
    valid: Sequence | None
    tokenizer_path: str | None = None


@dataclass
class TrainResult:
    steps: int
    consumed_samples: int
    losses: list[float] = field(default_factory=list)
    valid: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None


def build_datasets(cfg: RunConfig, model_cfg: ModelConfig, mesh: Mesh) -> Datasets:
    d, t = cfg.data, cfg.train
    n_evals = (t.train_steps // t.eval_interval if t.eval_interval else 0) + 1
    train_samples = max(1, t.train_steps * t.global_batch_size)
    valid_samples = max(1, n_evals * t.eval_iters * t.global_batch_size)
    if d.mock_data:
        return Datasets(MockDataset(model_cfg.vocab_size, d.seq_length, t.seed),
                        MockDataset(model_cfg.vocab_size, d.seq_length, t.seed + 1))
    if d.sft_data is not None:
        train, valid = _rank0_first(mesh, lambda: build_sft_datasets(
            d.sft_data, d.split, d.seq_length, train_samples, valid_samples, t.seed, d.pack, model_cfg.vocab_size))
        if mesh.is_logging_rank:
            print(train.describe(), flush=True)
            for warning in (ds.warning() for ds in (train, valid) if ds is not None):
                if warning:
                    print(warning, file=sys.stderr, flush=True)
        return Datasets(train, valid, d.tokenizer)
    prefix, tokenizer = d.data, d.tokenizer
    if prefix is None:  # the embedded demo corpus
        if mesh.rank == 0:
            info = demo.prepare_demo_data(demo.DEMO_DATA_DIR)
        if dist.is_initialized():
            dist.barrier()
        info = demo.prepare_demo_data(demo.DEMO_DATA_DIR) if mesh.rank != 0 else info
        prefix, tokenizer = info["prefix"], os.path.abspath(info["tokenizer"])
        cfg.data.tokenizer = tokenizer  # recorded in checkpoints, so `generate` finds it from anywhere
    if tokenizer is not None:
        vocab = load_tokenizer(tokenizer).vocab_size
        if vocab > model_cfg.vocab_size:
            fix = (f"use the tokenizer {t.load} was trained with" if t.load and "model" not in cfg.explicit
                   else "pick a model with a large enough vocabulary (or YAML model_overrides: vocab_size)")
            raise ConfigError(f"tokenizer {tokenizer} has {vocab} tokens but {model_label(cfg)} only "
                              f"{model_cfg.vocab_size}; {fix}")
    train, valid = _rank0_first(mesh, lambda: samples.build_datasets(
        prefix, d.split, d.seq_length, train_samples, valid_samples, t.seed, vocab_size=model_cfg.vocab_size))
    if mesh.is_logging_rank:
        print(train.describe(), flush=True)
    if d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss:
        eod = load_tokenizer(tokenizer).eod_id
        if eod is None:
            raise ConfigError(f"tokenizer {tokenizer} has no end-of-document token; document-boundary flags need one")
        train, valid = (None if ds is None else DocumentBoundaries(ds, eod, d.reset_position_ids,
                        d.reset_attention_mask, d.eod_mask_loss) for ds in (train, valid))
    return Datasets(train, valid, tokenizer)


def _rank0_first(mesh: Mesh, build):
    """Rank 0 builds the index files (cached next to the data) first; the other ranks then load them.

    When rank 0 fails (a bad data file), the others learn it instead of waiting in a collective until rank 0's
    exit breaks it: rank 0 reports the error and exits; they wait for the launcher to stop them (so that the
    first failure, and the job's exit code, is rank 0's), or exit 2 quietly after a minute.
    """
    failure = None
    if mesh.rank == 0:
        try:
            result = build()
        except Exception as e:
            failure = e
    if dist.is_initialized():
        said = [f"{type(failure).__name__}: {failure}" if failure is not None else None]
        dist.broadcast_object_list(said, src=0)
        if said[0] is not None and mesh.rank != 0:
            time.sleep(60)
            raise SystemExit(2)
    if failure is not None:
        raise failure
    return result if mesh.rank == 0 else build()


def model_label(cfg: RunConfig) -> str:
    """The model as the user named it: --model, or the checkpoint whose architecture was taken."""
    t = cfg.train
    return t.model if "model" in cfg.explicit or not t.load else f"the model of checkpoint {t.load}"


def run_training(cfg: RunConfig, replace_save: bool = False) -> TrainResult:
    """Train as configured. replace_save: the caller has cleared --save (the demo's own directory)."""
    t = cfg.train
    if cfg.data.tokenizer and os.path.exists(cfg.data.tokenizer):
        cfg.data.tokenizer = os.path.abspath(cfg.data.tokenizer)  # checkpoints must name it from anywhere
    model_cfg = cfg.model_config()
    if t.load and "model" not in cfg.explicit:
        # The architecture comes from the checkpoint unless --model is given (then they must match).
        model_cfg = read_model_config(t.load)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    derived = validate(cfg, world_size, torch.cuda.is_available(), model_cfg)  # before any memory is touched
    if t.load:
        check_checkpoint_fits(t.load, model_cfg, model_label(cfg))
    if not replace_save:
        check_save_dir(cfg)
    init_distributed(derived.device, t.dist_timeout)
    try:
        return _train_on_this_rank(cfg, derived, model_cfg)
    finally:  # also after an error: a process group left alive aborts the exit (gloo's threads)
        restore_signal_handlers()
        if dist.is_initialized():
            dist.destroy_process_group()


def _train_on_this_rank(cfg: RunConfig, derived, model_cfg: ModelConfig) -> TrainResult:
    t = cfg.train
    mesh = build_mesh(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp_comm_max_ctas)
    if mesh.rank == 0:
        _warn_if_metrics_file_has_another_run(cfg)
        _warn_if_beyond_trained_context(cfg, model_cfg)
    datasets = build_datasets(cfg, model_cfg, mesh)
    # TensorBoard / W&B start before the model is built: a W&B login failure costs no memory or time.
    sinks = build_metric_sinks(cfg) if mesh.is_logging_rank else []
    torch.manual_seed(t.seed)
    engine = build_engine(cfg, derived, mesh, model_cfg)
    start_step, consumed, skipped_before = 0, 0, 0
    if t.load:
        state = load_checkpoint(engine, t.load, weights_only=t.finetune)
        if not t.finetune:
            start_step, consumed = state["step"], state["consumed_samples"]
            skipped_before = state.get("skipped_steps", 0)
        if mesh.rank == 0:
            print(f"loaded weights of step {state['step']} from {t.load} (--finetune: fresh optimizer, step 0)"
                  if t.finetune else f"resumed from {t.load} at step {start_step} ({consumed} samples consumed)",
                  flush=True)
            if not t.finetune:
                _say_what_changed_on_resume(cfg, state, start_step)
    try:
        return train_loop(engine, datasets, start_step, consumed, skipped_before, sinks)
    except RuntimeError as e:  # a collective that timed out or lost a peer: name the ranks that went silent
        failure = explain_collective_failure(e, t.dist_timeout)
        if failure is None:
            raise
        raise failure from e


def train_loop(engine: Engine, datasets: Datasets, start_step: int, consumed: int,
               skipped_before: int = 0, extra_sinks: list | None = None) -> TrainResult:
    """The training steps; extra_sinks (TensorBoard, W&B; logging rank only) get every record."""
    cfg, mesh = engine.cfg, engine.mesh
    t = cfg.train
    logging_rank = mesh.is_logging_rank
    sink = MetricsSink(t.metrics_file if logging_rank else None, extra_sinks)
    result = TrainResult(steps=start_step, consumed_samples=consumed)
    flops_per_token = engine.model_cfg.flops_per_token(cfg.data.seq_length)
    peak = peak_tflops(engine.device)
    tokens_per_step = t.global_batch_size * cfg.data.seq_length
    progress = _progress_bar(t.train_steps, start_step) if (logging_rank and t.progress) else None
    timer = Timer(engine.device)
    train_seconds = 0.0  # training time of the pending steps before the timer's last reset (an eval or a save)
    pending: list[tuple[int, dict]] = []
    guard = FaultGuard(engine, echo=lambda m: _print(progress, m) if logging_rank else None)
    guard.skipped_total = skipped_before  # skipped steps of the run this one resumes
    stop: str | None = None
    if datasets.valid is not None and start_step == 0 and t.eval_interval:
        _evaluate_and_record(engine, datasets, 0, consumed, result, sink, progress)
        timer.reset()  # the first step's speed is training only
    for step in range(start_step, t.train_steps):
        mbs = micro_batches_for_step(datasets.train, consumed, t.global_batch_size, t.micro_batch_size, mesh.dp, mesh.dp_rank)
        guard.start_step(step + 1)
        out = train_step(engine, to_device(mbs, engine.device), step)
        consumed += t.global_batch_size
        pending.append((step + 1, out))
        stop = guard.stop_reason()  # a pre-emption signal or --exit-duration-mins, agreed by all ranks
        if (step + 1) % t.log_interval == 0 or step + 1 == t.train_steps or stop:
            train_seconds += timer.elapsed()
            losses = _reduce_step_losses(engine, [o["loss"] for _, o in pending])
            speed = throughput(tokens_per_step * len(pending), train_seconds, flops_per_token, mesh.world_size, peak)
            for (s, o), loss in zip(pending, losses):  # every step counts for the skipped-step checks
                guard.count({"step": s, "loss": loss, "grad_norm": float(o["grad_norm"]),
                             "skipped": bool(o["found_inf"] > 0), **_loss_scale(o),
                             "consumed_samples": consumed - (pending[-1][0] - s) * t.global_batch_size})
                result.losses.append(loss)
            record = _interval_record(pending, losses, speed, guard.skipped_total, consumed, engine)
            sink.write(record)
            if progress is not None:
                progress.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{pending[-1][1]['lr']:.2e}",
                                     tok_s=f"{speed['tokens_per_sec']:.0f}",
                                     mfu="n/a" if speed["mfu"] is None else f"{speed['mfu']:.1%}")
                progress.update(len(pending))
            elif logging_rank:  # --no-progress (batch logs): one plain line per logged step
                mfu = "" if speed["mfu"] is None else f", mfu {speed['mfu']:.1%}"
                _print(None, f"step {pending[-1][0]}: loss {record['loss']:.4f}, lr {pending[-1][1]['lr']:.2e}, "
                             f"grad norm {float(pending[-1][1]['grad_norm']):.3f}, "
                             f"{speed['tokens_per_sec']:.0f} tokens/s{mfu}")
            pending, train_seconds = [], 0.0
            timer.reset()
            guard.check_skipped(on_abort=sink.close)
        last = step + 1 == t.train_steps
        if datasets.valid is not None and ((t.eval_interval and (step + 1) % t.eval_interval == 0) or last):
            train_seconds += timer.elapsed()
            _evaluate_and_record(engine, datasets, step + 1, consumed, result, sink, progress)
            timer.reset()
        if t.save and ((t.save_interval and (step + 1) % t.save_interval == 0) or last or stop):
            # Steps skipped so far, also those not yet logged: a resumed run continues the count.
            train_seconds += timer.elapsed()
            skipped = guard.skipped_total + sum(bool(o["found_inf"] > 0) for _, o in pending)
            result.checkpoint = save_checkpoint(engine, t.save, step + 1, consumed, skipped)
            if logging_rank:
                _print(progress, f"step {step + 1}: saved {result.checkpoint}"
                                 + (" (writing in the background)" if t.async_save else ""))
            timer.reset()
        if stop:
            guard.echo(guard.stop_message(step + 1, stop, result.checkpoint if t.save else None, t.save))
            break
    for buf in engine.buffers:  # no collective may be left in flight
        buf.finish_param_gather()
    if t.save:  # an --async-save still writing: wait for it and publish it (collective)
        finish_pending_save(engine)
    if progress is not None:
        progress.close()
    sink.close()
    result.steps, result.consumed_samples = (step + 1 if stop else t.train_steps), consumed
    return result


def check_save_dir(cfg: RunConfig) -> None:
    """Before anything runs: --save can be written, and it holds no checkpoints this run did not write.

    Saving into another run's directory would overwrite its step-N checkpoints and move its `latest`, and
    --keep-last would delete the rest. Resuming (--load of this directory or one of its step-N) continues the
    run that wrote them; fine-tuning starts again at step 0, so it too must save elsewhere.
    """
    save, load = cfg.train.save, cfg.train.load
    if not save:
        return
    if os.path.exists(save) and not os.path.isdir(save):
        raise ConfigError(f"--save {save} is a file, not a directory: give a directory for the checkpoints")
    try:
        os.makedirs(save, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--save {save}: cannot create the directory ({e.strerror}); give a writable "
                          "directory") from None
    if not os.access(save, os.W_OK | os.X_OK):
        raise ConfigError(f"--save {save} is not writable by this user: give a writable directory")
    steps = step_dirs(save)
    if not steps:
        return
    latest_file = os.path.join(save, "latest")
    latest = open(latest_file).read().strip() if os.path.isfile(latest_file) else steps[-1][1].name
    if load and _checkpoint_root(load) == os.path.realpath(save) and not cfg.train.finetune:
        return  # resuming the run that wrote them
    held = f"{len(steps)} checkpoint{'s' if len(steps) > 1 else ''}, the latest {latest}"
    if load and cfg.train.finetune and _checkpoint_root(load) == os.path.realpath(save):
        raise ConfigError(f"--save {save} is the directory --load reads ({held}); fine-tuning starts again at "
                          "step 0, so its saves would overwrite those checkpoints (and --keep-last would delete "
                          "them). Save the fine-tuned model to a new directory.")
    raise ConfigError(f"--save {save} already holds another run's checkpoints ({held}); this run's saves would "
                      "overwrite them (and --keep-last would delete them). Resume that run with --load "
                      f"{save}, save to a new directory, or delete {save} first.")


def _checkpoint_root(load: str) -> str:
    """The directory holding the checkpoint --load names (DIR, or DIR for DIR/step-N)."""
    path = os.path.realpath(load)
    return os.path.dirname(path) if step_number(os.path.basename(path)) is not None else path


# Settings whose change on resume alters the run: the learning-rate schedule, or which samples come next
# (consumed_samples counts samples of the settings the checkpoint was trained with).
_SCHEDULE_SETTINGS = ("train_steps", "lr", "min_lr", "lr_schedule", "warmup_steps", "weight_decay", "clip_grad",
                      "adam_beta1", "adam_beta2")
_DATA_SETTINGS = ("seq_length", "global_batch_size", "seed", "data", "sft_data", "split")


def _say_what_changed_on_resume(cfg: RunConfig, meta: dict, start_step: int) -> None:
    """Resuming is exact only with the checkpoint's settings: name each one that differs, and a run with
    nothing left to train."""
    saved = {k: v for section in (meta.get("config") or {}).values() if isinstance(section, dict)
             for k, v in section.items()}
    now = cfg.flat()
    changed = [k for k in (*_SCHEDULE_SETTINGS, *_DATA_SETTINGS) if k in saved and saved[k] != now.get(k)]
    if changed:
        parts = ", ".join(f"--{k.replace('_', '-')} {saved[k]} -> {now[k]}" for k in changed)
        data = [k for k in changed if k in _DATA_SETTINGS]
        why = (" The data position is counted in samples of the old settings, so the samples that follow are not "
               "the ones the original run would have seen." if data else "")
        print(f"note: resuming with settings that differ from the checkpoint's run: {parts}.{why}", flush=True)
    if start_step >= cfg.train.train_steps:
        print(f"note: nothing to train: the checkpoint is at step {start_step} and --train-steps is "
              f"{cfg.train.train_steps}; give a larger --train-steps to continue", flush=True)


def _warn_if_metrics_file_has_another_run(cfg: RunConfig) -> None:
    """Records are appended (a resumed run continues its file): say so when a fresh run would mix two runs."""
    path, load = cfg.train.metrics_file, cfg.train.load
    if not path or load or not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    print(f"warning: --metrics-file {path} already holds records of an earlier run; this run's records are "
          f"appended after them. Use another --metrics-file to keep the runs apart.", file=sys.stderr, flush=True)


def _warn_if_beyond_trained_context(cfg: RunConfig, model_cfg) -> None:
    """Longer sequences than the model's context train, but pretrained weights need rope scaling for them."""
    seq, limit = cfg.data.seq_length, model_cfg.max_seq_length
    if seq > limit and model_cfg.rope_scaling is None:
        print(f"warning: --seq-length {seq} is beyond {model_label(cfg)}'s context of {limit} tokens and no rope "
              f"scaling is set; for pretrained weights set one in YAML (model_overrides: rope_scaling: "
              f"{{kind: linear, factor: {seq / limit:g}}}) or use --seq-length <= {limit}.", file=sys.stderr, flush=True)


def _loss_scale(step_out: dict) -> dict:
    scale = step_out.get("loss_scale")
    return {} if scale is None else {"loss_scale": float(scale)}


def _evaluate_and_record(engine: Engine, datasets: Datasets, step: int, consumed: int, result: TrainResult,
                         sink: MetricsSink, progress) -> None:
    metrics = evaluate(engine, datasets.valid, engine.cfg.train.eval_iters)
    record = {"step": step, "split": "valid", **metrics, "consumed_samples": consumed}
    result.valid.append(record)
    sink.write(record)
    if engine.mesh.is_logging_rank:  # also with --no-progress: batch logs want the evaluations
        _print(progress, f"step {step}: valid {format_metrics(metrics)}")


def _interval_record(pending: list[tuple[int, dict]], losses: list[float], speed: dict, skipped_total: int,
                     consumed: int, engine: Engine) -> dict:
    """The metric record of a logged step: the loss averaged over the steps since the last record (their
    number in `steps_in_record`, skipped ones left out), the rest as of the logged step."""
    step, last = pending[-1]
    applied = [loss for (_, o), loss in zip(pending, losses) if not o["found_inf"] > 0]
    return {"step": step, "loss": sum(applied) / len(applied) if applied else losses[-1], "lr": last["lr"],
            "grad_norm": float(last["grad_norm"]), "skipped": bool(last["found_inf"] > 0),
            "skipped_steps": skipped_total, "steps_in_record": len(pending), **_loss_scale(last), **speed,
            "peak_mem_gib": peak_memory_gib(engine.device), "consumed_samples": consumed}


def _reduce_step_losses(engine: Engine, losses: list[torch.Tensor]) -> list[float]:
    """Per-step global losses: summed over data-parallel ranks, sent from the last pipeline stage to all."""
    return sum_from_last_stage(torch.stack(losses).float(), engine.mesh).tolist()


def _progress_bar(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


def _print(progress, message: str) -> None:
    if progress is not None:
        progress.write(message)
    else:
        print(message, flush=True)
