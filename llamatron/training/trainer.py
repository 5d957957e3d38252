"""The training loop: build, step, evaluate, log, save."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..adapters.nf4 import check_nf4_saves, quantize_frozen
from ..adapters.targets import adapter_shapes
from ..checkpoint import check_checkpoint_fits, read_meta, read_model_config, step_dirs, step_number
from ..checkpoint.save_lock import SaveDirLock
from ..config.settings import Derived, RunConfig
from ..data import demo_corpus, samples
from ..data.batch_rampup import BatchSizes
from ..data.batches import Samples, micro_batches_for_rank, to_device
from ..data.boundaries import DocumentBoundaries
from ..data.mock import MockDataset
from ..data.preference_dataset import build_preference_datasets
from ..data.sft_dataset import build_sft_datasets
from ..data.tokenizer import load_tokenizer
from ..errors import ConfigError
from ..models import ModelConfig
from ..parallel.mesh import Mesh, build_mesh, init_distributed
from .checkpointing import Checkpointing, check_adapters, load_checkpoint, meta_to_inherit
from .engine import Engine, build_engine, train_step
from .evaluation import Evaluation
from .faults import NO_FAULTS, FaultGuard, FaultInjection, explain_collective_failure, restore_signal_handlers
from .logging_sinks import build_metric_sinks
from .metrics import MetricsLog
from .objective_hooks import StepRunner, before_training, runs_own_steps, step_runner
from .summary import startup_summary
from .validate import validate


@dataclass
class Datasets:
    train: Samples
    valid: Samples | None
    tokenizer_path: str | None = None


@dataclass(frozen=True)
class RunStart:
    """Where the run starts: 0 for a fresh run (also --finetune), the checkpoint's position on resume."""

    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0  # non-finite steps skipped by the run this one resumes


@dataclass
class TrainResult:
    steps: int
    consumed_samples: int
    losses: list[float] = field(default_factory=list)
    valid: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None
    stopped_early: str | None = None  # why the run stopped before --train-steps (a stop signal, a time limit)


def build_datasets(cfg: RunConfig, model_cfg: ModelConfig, mesh: Mesh) -> Datasets:
    d, t = cfg.data, cfg.train
    train_samples = max(1, BatchSizes.of(t.global_batch_size, t.rampup_batch_size).samples_for(t.train_steps))
    # Every evaluation reads the same first --eval-iters global batches (evaluation.evaluate starts at sample 0),
    # so the validation samples are a function of the data, split, seed, sequence length and these two flags
    # alone: evaluations of runs of any length on the same data are comparable.
    valid_samples = max(1, t.eval_iters * t.global_batch_size)
    if d.mock_data:
        return Datasets(
            MockDataset(model_cfg.vocab_size, d.seq_length, t.seed),
            MockDataset(model_cfg.vocab_size, d.seq_length, t.seed + 1),
        )
    if d.preference_data is not None or d.sft_data is not None:
        return _tuning_datasets(cfg, model_cfg, mesh, train_samples, valid_samples)
    prefix, tokenizer = d.data, d.tokenizer
    if prefix is None:  # the embedded demo corpus
        if mesh.rank == 0:
            info = demo_corpus.prepare_demo_data(demo_corpus.DEMO_DATA_DIR, say=demo_corpus.on_console)
        if dist.is_initialized():
            dist.barrier()
        info = demo_corpus.prepare_demo_data(demo_corpus.DEMO_DATA_DIR) if mesh.rank != 0 else info
        prefix, tokenizer = info["prefix"], os.path.abspath(info["tokenizer"])
        cfg.data.tokenizer = tokenizer  # recorded in checkpoints, so `generate` finds it from anywhere
    if tokenizer is not None:
        vocab = load_tokenizer(tokenizer).vocab_size
        if vocab > model_cfg.vocab_size:
            fix = (
                f"use the tokenizer {t.load} was trained with"
                if t.load and "model" not in cfg.explicit
                else "pick a model with a large enough vocabulary (or YAML model_overrides: vocab_size)"
            )
            raise ConfigError(
                f"tokenizer {tokenizer} has {vocab} tokens but {model_label(cfg)} only {model_cfg.vocab_size}; {fix}"
            )
    train, valid = _rank0_first(
        mesh,
        lambda: samples.build_datasets(
            prefix,
            d.split,
            d.seq_length,
            train_samples,
            valid_samples,
            t.seed,
            vocab_size=model_cfg.vocab_size,
            cache_path=d.data_cache_path,
        ),
    )
    if mesh.is_logging_rank:
        print(train.describe(), flush=True)
    if d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss:
        assert tokenizer is not None  # training.validate: the document-boundary flags need --tokenizer
        eod = load_tokenizer(tokenizer).eod_id
        if eod is None:
            raise ConfigError(f"tokenizer {tokenizer} has no end-of-document token; document-boundary flags need one")
        train, valid = (
            None
            if ds is None
            else DocumentBoundaries(ds, eod, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss)
            for ds in (train, valid)
        )
    return Datasets(train, valid, tokenizer)


def _tuning_datasets(
    cfg: RunConfig, model_cfg: ModelConfig, mesh: Mesh, train_samples: int, valid_samples: int
) -> Datasets:
    """--preference-data's or --sft-data's train and validation sets."""
    d, t = cfg.data, cfg.train
    if d.preference_data is not None:
        train, valid = _rank0_first(
            mesh,
            lambda: build_preference_datasets(
                d.preference_data,
                d.split,
                d.seq_length,
                train_samples,
                valid_samples,
                t.seed,
                model_cfg.vocab_size,
                d.data_cache_path,
            ),
        )
        _describe(mesh, train, valid)
        return Datasets(train, valid, d.tokenizer)
    assert d.sft_data is not None
    train, valid = _rank0_first(
        mesh,
        lambda: build_sft_datasets(
            d.sft_data,
            d.split,
            d.seq_length,
            train_samples,
            valid_samples,
            t.seed,
            d.pack,
            model_cfg.vocab_size,
            d.data_cache_path,
        ),
    )
    _describe(mesh, train, valid)
    return Datasets(train, valid, d.tokenizer)


def _describe(mesh: Mesh, train, valid) -> None:
    """The data line, and the datasets' warnings (samples that train on nothing), from the logging rank."""
    if mesh.is_logging_rank:
        print(train.describe(), flush=True)
        for warning in (ds.warning() for ds in (train, valid) if ds is not None):
            if warning:
                print(warning, file=sys.stderr, flush=True)


def _rank0_first(mesh: Mesh, build):
    """Rank 0 builds the index files (cached beside the data or in --data-cache-path) first; the others load them.

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


def model_to_train(cfg: RunConfig) -> ModelConfig:
    """The architecture the run trains: the checkpoint's with --load (unless --model is given: then they must
    match), else --model's. Every check of the run is made against this one."""
    if cfg.train.load and "model" not in cfg.explicit:
        return read_model_config(cfg.train.load)
    return cfg.model_config()


def run_training(
    cfg: RunConfig, on_checked: Callable[[], None] | None = None, faults: FaultInjection = NO_FAULTS
) -> TrainResult:
    """Train as configured. on_checked: called once the settings are checked (the demo's note of where it saves,
    which a refused run does not print); faults: what a test injects (none in a real run)."""
    t = cfg.train
    if cfg.data.tokenizer and os.path.exists(cfg.data.tokenizer):
        cfg.data.tokenizer = os.path.abspath(cfg.data.tokenizer)  # checkpoints must name it from anywhere
    model_cfg = model_to_train(cfg)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    derived = validate(cfg, world_size, torch.cuda.is_available(), model_cfg)  # before any memory is touched
    if t.load:
        check_adapters(read_meta(t.load), cfg)
        added = adapter_shapes(model_cfg, cfg.lora.lora_rank, cfg.lora.lora_targets)
        check_checkpoint_fits(t.load, model_cfg, model_label(cfg), added)
    check_save_dir(cfg)  # last: a refused run leaves the directory exactly as it was, no lock file either
    if on_checked is not None:
        on_checked()
    lock = _lock_save_dir(cfg)
    try:
        init_distributed(derived.device, t.dist_timeout)
        return _train_on_this_rank(cfg, derived, model_cfg, faults)
    finally:  # also after an error: a process group left alive aborts the exit (gloo's threads)
        restore_signal_handlers()
        if dist.is_initialized():
            dist.destroy_process_group()
        lock.release()


def _lock_save_dir(cfg: RunConfig) -> SaveDirLock:
    """The run's lock on --save (taken by global rank 0: the ranks of one run are one holder)."""
    save = cfg.train.save
    if not save or int(os.environ.get("RANK", "0")) != 0:
        return SaveDirLock(None)
    os.makedirs(save, exist_ok=True)  # check_save_dir made it; again in case it went meanwhile
    return SaveDirLock.acquire(save)


def _train_on_this_rank(
    cfg: RunConfig, derived: Derived, model_cfg: ModelConfig, faults: FaultInjection
) -> TrainResult:
    t = cfg.train
    mesh = build_mesh(cfg.parallel, cfg.parallel.dp_comm_max_ctas)
    if mesh.rank == 0:
        print("\n".join(startup_summary(cfg, derived, model_cfg, model_label(cfg))), flush=True)
        _warn_if_metrics_file_has_another_run(cfg)
        _warn_if_beyond_trained_context(cfg, model_cfg)
    own_steps = runs_own_steps(cfg.objective.objective)  # its rollouts are its data
    datasets = Datasets([], None, cfg.data.tokenizer) if own_steps else build_datasets(cfg, model_cfg, mesh)
    # TensorBoard / W&B start before the model is built: a W&B login failure costs no memory or time.
    sinks = build_metric_sinks(cfg) if mesh.is_logging_rank else []
    torch.manual_seed(t.seed)
    engine = build_engine(cfg, derived, mesh, model_cfg)
    start, inherited, state = RunStart(), {}, {}
    if t.load:
        state = load_checkpoint(engine, t.load, weights_only=t.finetune)
        inherited = meta_to_inherit(state, t.load, cfg.lora.lora_rank > 0)
        if not t.finetune:
            start = RunStart(state["step"], state["consumed_samples"], state.get("skipped_steps", 0))
        if mesh.rank == 0:
            print(
                f"loaded weights of step {state['step']} from {t.load} (--finetune: fresh optimizer, step 0)"
                if t.finetune
                else f"resumed from {t.load} at step {start.step} ({start.consumed_samples} samples consumed)",
                flush=True,
            )
            if not t.finetune:
                _say_what_changed_on_resume(cfg, state, start.step)
    check_nf4_saves(cfg.lora.base_precision, t.save, inherited)  # --base-precision nf4: before any step
    quantize_frozen(cfg.lora.base_precision, engine.chunks, model_cfg, engine.frozen)  # after the load: frees the base
    inherited.update(before_training(engine, [datasets.train, datasets.valid], state))
    try:
        trainer = Trainer(engine, datasets, start, Checkpointing(t, inherited, faults), faults, sinks)
        trainer.step_runner = step_runner(engine)
        return trainer.run()
    except RuntimeError as e:  # a collective that timed out or lost a peer: name the ranks that went silent
        failure = explain_collective_failure(e, t.dist_timeout)
        if failure is None:
            raise
        raise failure from e


class Trainer:
    """The training loop. It runs the steps and asks its components when to act, each owning its flags and
    cadence: metrics and console logging (`MetricsLog`), the fault guard (`FaultGuard`: skipped steps, stop
    requests, injected faults), evaluation (`Evaluation`) and checkpointing (`Checkpointing`)."""

    def __init__(
        self,
        engine: Engine,
        datasets: Datasets,
        start: RunStart,
        saves: Checkpointing,
        faults: FaultInjection = NO_FAULTS,
        extra_sinks: list | None = None,
    ):
        """extra_sinks: TensorBoard, W&B (logging rank only), given every record."""
        self.engine, self.train_data, self.saves = engine, datasets.train, saves
        self.start_step, self.consumed = start.step, start.consumed_samples
        t = engine.cfg.train
        self.batch_sizes = BatchSizes.of(t.global_batch_size, t.rampup_batch_size)
        self.result = TrainResult(steps=start.step, consumed_samples=start.consumed_samples)
        self.log = MetricsLog(engine, start.step, extra_sinks)
        self.guard = FaultGuard(engine, faults, echo=self.log.echo)
        self.guard.skipped_total = start.skipped_steps  # skipped steps of the run this one resumes
        self.evaluation = Evaluation(engine, datasets.valid)
        self.step_runner: StepRunner | None = None  # an objective's own steps (training/objective_hooks.py)

    def run(self) -> TrainResult:
        t = self.engine.cfg.train
        if self.evaluation.at_start(self.start_step):
            self._evaluate(0)
        self.log.start_clock()  # the first step's speed is training only
        step, stop = self.start_step, None
        for step in range(self.start_step + 1, t.train_steps + 1):  # 1-based: the step just trained
            self._train(step)
            stop = self.guard.stop_reason()  # a pre-emption signal or --exit-duration-mins, agreed by all ranks
            last = step == t.train_steps
            if self.log.due(step, stop is not None):
                self._log()
            if self.evaluation.due(step, last):
                self._evaluate(step)
            if self.saves.due(step, last, stop is not None):
                self._save(step)
            if stop:
                self.guard.echo(self.guard.stop_message(step, stop, self.result.checkpoint, t.save))
                break
        self._finish()
        self.result.steps, self.result.consumed_samples = (step if stop else t.train_steps), self.consumed
        self.result.stopped_early = stop
        return self.result

    def _train(self, step: int) -> None:
        t, mesh = self.engine.cfg.train, self.engine.mesh
        size = self.batch_sizes.at(self.consumed)
        self.guard.start_step(step)
        if self.step_runner is not None:
            out = self.step_runner(step, size)
        else:
            mbs = micro_batches_for_rank(self.train_data, self.consumed, size, t.micro_batch_size, mesh)
            out = train_step(self.engine, to_device(mbs, self.engine.device), step - 1)
        self.consumed += size
        self.log.add_step(step, out, size)

    def _log(self) -> None:
        steps = self.log.step_records(self.consumed)
        for record in steps:  # every step counts for the skipped-step checks
            self.guard.count(record)
            self.result.losses.append(record["loss"])
        self.log.write_steps(steps, self.guard.skipped_total, self.consumed)
        self.guard.check_skipped(on_abort=self.log.close)

    def _evaluate(self, step: int) -> None:
        with self.log.paused():
            self.result.valid.append(self.log.write_evaluation(step, self.evaluation.run(), self.consumed))

    def _save(self, step: int) -> None:
        with self.log.paused():
            # Steps skipped so far, also those not yet logged: a resumed run continues the count.
            skipped = self.guard.skipped_total + self.log.pending_skipped()
            self.result.checkpoint = self.saves.save(self.engine, step, self.consumed, skipped)
            self.log.echo(
                f"step {step}: saved {self.result.checkpoint}"
                + (" (writing in the background)" if self.saves.background else "")
            )

    def _finish(self) -> None:
        for buf in self.engine.buffers:  # no collective may be left in flight
            buf.finish_param_gather()
        self.saves.finish(self.engine)  # an --async-save still writing: wait for it and publish it (collective)
        self.log.close()


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
        raise ConfigError(
            f"--save {save}: cannot create the directory ({e.strerror}); give a writable directory"
        ) from None
    if not os.access(save, os.W_OK | os.X_OK):
        raise ConfigError(f"--save {save} is not writable by this user: give a writable directory")
    steps = step_dirs(save)
    if not steps:
        return
    latest_file = os.path.join(save, "latest")
    latest = open(latest_file).read().strip() if os.path.isfile(latest_file) else steps[-1][1].name
    if load and checkpoint_root(load) == os.path.realpath(save) and not cfg.train.finetune:
        return  # resuming the run that wrote them
    held = f"{len(steps)} checkpoint{'s' if len(steps) > 1 else ''}, the latest {latest}"
    if load and cfg.train.finetune and checkpoint_root(load) == os.path.realpath(save):
        raise ConfigError(
            f"--save {save} is the directory --load reads ({held}); fine-tuning starts again at "
            "step 0, so its saves would overwrite those checkpoints (and --keep-last would delete "
            "them). Save the fine-tuned model to a new directory."
        )
    raise ConfigError(
        f"--save {save} already holds another run's checkpoints ({held}); this run's saves would "
        "overwrite them (and --keep-last would delete them). Resume that run with --load "
        f"{save}, save to a new directory, or delete {save} first."
    )


def checkpoint_root(load: str) -> str:
    """The directory holding the checkpoint --load names (DIR, or DIR for DIR/step-N)."""
    path = os.path.realpath(load)
    return os.path.dirname(path) if step_number(os.path.basename(path)) is not None else path


# Settings whose change on resume alters the run: the learning-rate schedule, or which samples come next
# (consumed_samples counts samples of the settings the checkpoint was trained with).
_SCHEDULE_SETTINGS = (
    "train_steps",
    "lr",
    "min_lr",
    "lr_schedule",
    "warmup_steps",
    "weight_decay",
    "clip_grad",
    "adam_beta1",
    "adam_beta2",
)
_DATA_SETTINGS = (
    "seq_length",
    "global_batch_size",
    "rampup_batch_size",
    "seed",
    "data",
    "sft_data",
    "preference_data",
    "split",
)


def _say_what_changed_on_resume(cfg: RunConfig, meta: dict, start_step: int) -> None:
    """Resuming is exact only with the checkpoint's settings: name each one that differs, and a run with
    nothing left to train."""
    saved = {
        k: v for section in (meta.get("config") or {}).values() if isinstance(section, dict) for k, v in section.items()
    }
    now = cfg.flat()
    changed = [k for k in (*_SCHEDULE_SETTINGS, *_DATA_SETTINGS) if k in saved and saved[k] != now.get(k)]
    if changed:
        parts = ", ".join(f"--{k.replace('_', '-')} {saved[k]} -> {now[k]}" for k in changed)
        data = [k for k in changed if k in _DATA_SETTINGS]
        why = (
            " The data position is counted in samples of the old settings, so the samples that follow are not "
            "the ones the original run would have seen."
            if data
            else ""
        )
        print(f"note: resuming with settings that differ from the checkpoint's run: {parts}.{why}", flush=True)
    if start_step >= cfg.train.train_steps:
        print(
            f"note: nothing to train: the checkpoint is at step {start_step} and --train-steps is "
            f"{cfg.train.train_steps}; give a larger --train-steps to continue",
            flush=True,
        )


def _warn_if_metrics_file_has_another_run(cfg: RunConfig) -> None:
    """Records are appended (a resumed run continues its file): say so when a fresh run would mix two runs."""
    path, load = cfg.train.metrics_file, cfg.train.load
    if not path or load or not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    print(
        f"warning: --metrics-file {path} already holds records of an earlier run; this run's records are "
        f"appended after them. Use another --metrics-file to keep the runs apart.",
        file=sys.stderr,
        flush=True,
    )


def _warn_if_beyond_trained_context(cfg: RunConfig, model_cfg) -> None:
    """Longer sequences than the model's context train, but pretrained weights need rope scaling for them. Said
    only of a --seq-length the user gave: the default (512) is beyond only the tiny test models' contexts."""
    seq, limit = cfg.data.seq_length, model_cfg.max_seq_length
    if seq > limit and model_cfg.rope_scaling is None and "seq_length" in cfg.explicit:
        print(
            f"warning: --seq-length {seq} is beyond {model_label(cfg)}'s context of {limit} tokens and no rope "
            f"scaling is set; for pretrained weights set one in YAML (model_overrides: rope_scaling: "
            f"{{kind: linear, factor: {seq / limit:g}}}) or use --seq-length <= {limit}.",
            file=sys.stderr,
            flush=True,
        )
