"""Throughput, FLOPs, MFU, memory, and the sinks metric records go to (console, JSON lines)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..models.inventory import flops_per_token
from ..parallel.mesh import sum_from_last_stage
from .engine import Engine
from .evaluation import format_metrics

# Dense bf16 peak per GPU, by name fragment (datasheet figures, as docs/design.md specifies).
_PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0}


def peak_tflops(device: torch.device | str) -> float | None:
    """Datasheet dense bf16 peak of this GPU, or None when unknown (MFU is then reported as null)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in _PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def peak_memory_gib(device: torch.device | str) -> float:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB
    except ImportError:  # pragma: no cover - non-POSIX
        return float("nan")


def throughput(
    tokens: int, seconds: float, flops_per_token: float, num_gpus: int, peak: float | None
) -> dict[str, Any]:
    """tokens/s per GPU, TFLOP/s per GPU and MFU for `tokens` trained by `num_gpus` in `seconds`."""
    tps = tokens / seconds / num_gpus
    tflops = tps * flops_per_token / 1e12
    return {"tokens_per_sec": tps, "tflops_per_gpu": tflops, "mfu": (tflops / peak) if peak else None}


def finite_or_null(value: Any) -> Any:
    """`value` with every NaN and infinity (a skipped step's loss and gradient norm) replaced by None: JSON has
    no such numbers, and strict parsers reject the bare `NaN` Python writes. The record's `skipped` flag says
    why a value is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


class MetricsSink:
    """Writes each record to the JSON-lines file and any other registered sink."""

    def __init__(self, path: str | None, extra_sinks: list | None = None):
        self.file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)
        self.extra_sinks = extra_sinks or []

    def write(self, record: dict[str, Any]) -> None:
        clean = finite_or_null(record)
        if self.file is not None:  # allow_nan=False: a NaN that got past finite_or_null is a bug, not a record
            self.file.write(json.dumps(clean, allow_nan=False) + "\n")
        for sink in self.extra_sinks:
            sink(clean)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        for sink in self.extra_sinks:  # TensorBoard / W&B flush and finish their runs
            close = getattr(sink, "close", None)
            if close is not None:
                close()


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (host clocks around GPU work need it); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    def __init__(self, device: torch.device):
        self.device = device
        self.start = time.perf_counter()

    def elapsed(self, sync: bool = True) -> float:
        if sync:
            sync_device(self.device)
        return time.perf_counter() - self.start

    def reset(self) -> None:
        self.start = time.perf_counter()


class MetricsLog:
    """A run's metric records and console lines.

    One step record per --log-interval steps (and after the last step, and before a stop): the loss averaged
    over its steps, the speed over their training time only (evaluations and saves are left out, `paused`);
    the evaluation records; each also as a progress-bar update or, with --no-progress, one plain line. Records
    go to --metrics-file and the TensorBoard / W&B sinks, from the logging rank only.
    """

    def __init__(self, engine: Engine, start_step: int, extra_sinks: list | None = None):
        cfg, t = engine.cfg, engine.cfg.train
        self.engine, self.interval, self.total_steps = engine, t.log_interval, t.train_steps
        self.logging_rank = engine.mesh.is_logging_rank
        self.sink = MetricsSink(t.metrics_file if self.logging_rank else None, extra_sinks)
        # A bar only on a terminal: redirected to a file (batch jobs, CI) it would be a stream of \r-updates.
        on_terminal = sys.stdout.isatty() and sys.stderr.isatty()
        bar = self.logging_rank and t.progress and on_terminal
        self.progress = _progress_bar(t.train_steps, start_step) if bar else None
        self.flops_per_token = flops_per_token(engine.model_cfg, cfg.data.seq_length)
        self.peak = peak_tflops(engine.device)
        self.timer = Timer(engine.device)
        self.train_seconds = 0.0  # training time of the pending steps before the timer's last reset
        self.seq_length = cfg.data.seq_length
        self.pending: list[tuple[int, dict, int]] = []  # (1-based step, train_step's output, samples) not logged
        self.start_step, self.began = start_step, time.monotonic()

    def start_clock(self) -> None:
        """Training starts now: the first record's speed counts from here."""
        self.timer.reset()
        self.train_seconds = 0.0
        self.began = time.monotonic()

    def add_step(self, step: int, out: dict, samples: int) -> None:
        """A step's output and its global batch size (--rampup-batch-size varies it)."""
        self.pending.append((step, out, samples))

    def due(self, step: int, stopping: bool) -> bool:
        return step % self.interval == 0 or step == self.total_steps or stopping

    def pending_skipped(self) -> int:
        """Skipped steps among those not yet logged."""
        return sum(bool(o["found_inf"] > 0) for _, o, _ in self.pending)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (an evaluation, a save) is not training time."""
        self.train_seconds += self.timer.elapsed()
        yield
        self.timer.reset()

    def step_records(self, consumed: int) -> list[dict]:
        """A record of each step since the last log, with its global loss (a collective: every rank calls it)."""
        self.train_seconds += self.timer.elapsed()
        losses = sum_from_last_stage(torch.stack([o["loss"] for _, o, _ in self.pending]).float(), self.engine.mesh)
        after = [consumed - sum(n for *_, n in self.pending[i + 1 :]) for i in range(len(self.pending))]
        last = len(self.pending) - 1
        return [
            {
                "step": s,
                "loss": loss,
                "lr": o["lr"],
                "grad_norm": float(o["grad_norm"]),
                "skipped": bool(o["found_inf"] > 0),
                **_loss_scale(o),
                # the objective's statistics are reduced over the ranks for the logged step only
                "stats": objective_fields(self.engine, o) if i == last else {},
                "consumed_samples": done,
                "samples": n,
                "extra": o.get("extra", {}),  # an objective's own step fields (GRPO's rollouts)
            }
            for i, ((s, o, n), loss, done) in enumerate(zip(self.pending, losses.tolist(), after))
        ]

    def write_steps(self, steps: list[dict], skipped_total: int, consumed: int) -> None:
        """The record of the logged step, steps[-1]: the loss averaged over `steps` (their number in
        `steps_in_record`, skipped ones left out), the rest as of the logged step; then a new interval."""
        speed = throughput(
            self.seq_length * sum(r["samples"] for r in steps),
            self.train_seconds,
            self.flops_per_token,
            self.engine.mesh.world_size,
            self.peak,
        )
        last = steps[-1]
        applied = [r["loss"] for r in steps if not r["skipped"]]
        record = {
            "step": last["step"],
            "loss": sum(applied) / len(applied) if applied else last["loss"],
            "lr": last["lr"],
            "grad_norm": last["grad_norm"],
            "skipped": last["skipped"],
            "skipped_steps": skipped_total,
            "steps_in_record": len(steps),
            **_loss_scale(last),
            **last["stats"],  # the objective's statistics of the logged step
            **last["extra"],
            **speed,
            "peak_mem_gib": peak_memory_gib(self.engine.device),
            "global_batch_size": last["samples"],  # the logged step's (--rampup-batch-size grows it)
            "consumed_samples": consumed,
        }
        self.sink.write(record)
        self._show(record, speed)
        self.pending, self.train_seconds = [], 0.0
        self.timer.reset()

    def _show(self, record: dict, speed: dict) -> None:
        if self.progress is not None:
            self.progress.set_postfix(
                loss=f"{record['loss']:.3f}",
                lr=f"{record['lr']:.2e}",
                tok_s=f"{speed['tokens_per_sec']:.0f}",
                mfu="n/a" if speed["mfu"] is None else f"{speed['mfu']:.1%}",
                **({"reward": f"{record['reward']:.3f}"} if "reward" in record else {}),
            )
            self.progress.update(record["steps_in_record"])
        elif self.logging_rank:  # --no-progress (batch logs): one plain line per logged step
            mfu = "" if speed["mfu"] is None else f", mfu {speed['mfu']:.1%}"
            reward = f", reward {record['reward']:.3f}" if "reward" in record else ""  # GRPO's rollouts
            self.echo(
                f"step {record['step']}: loss {record['loss']:.4f}{reward}, lr {record['lr']:.2e}, "
                f"grad norm {record['grad_norm']:.3f}, {speed['tokens_per_sec']:.0f} tokens/s{mfu} | "
                + self._progress_note(record["step"])
            )

    def _progress_note(self, step: int) -> str:
        """The bar's percentage and time left, for a log: from the wall time of this run's steps so far
        (evaluations and saves included, as they will be again)."""
        elapsed = time.monotonic() - self.began
        done = step - self.start_step
        left = elapsed / done * (self.total_steps - step) if 0 < done and step < self.total_steps else None
        eta = "" if left is None else f", ETA {duration(left)}"
        return f"{step / self.total_steps:.0%} of {self.total_steps} steps, {duration(elapsed)} elapsed{eta}"

    def write_evaluation(self, step: int, metrics: dict[str, float], consumed: int) -> dict:
        """The evaluation record of (1-based) `step`, written and shown (also with --no-progress: batch logs
        want the evaluations); returns it."""
        record = {"step": step, "split": "valid", **metrics, "consumed_samples": consumed}
        self.sink.write(record)
        self.echo(f"step {step}: valid {format_metrics(metrics)}")
        return record

    def echo(self, message: str) -> None:
        """A console line from the logging rank, above the progress bar when there is one."""
        if not self.logging_rank:
            return
        if self.progress is not None:
            self.progress.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.sink.close()


def duration(seconds: float) -> str:
    """A time span as a log line says it: 45s, 2m07s, 3h05m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _loss_scale(step_out: dict) -> dict:
    scale = step_out.get("loss_scale")
    return {} if scale is None else {"loss_scale": float(scale)}


def objective_fields(engine: Engine, step_out: dict) -> dict:
    """The objective's own statistics of the step, by name (a mixture of experts' router statistics, DPO's
    rewards): `Objective.step_stats` (a collective over the ranks: every rank calls it) and `stat_fields`."""
    local = step_out.get("stats")
    if local is None:
        return {}
    return engine.objective.stat_fields(engine.objective.step_stats(local, step_out["sequences"]).tolist())


def _progress_bar(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
