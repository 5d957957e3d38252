"""Surviving faults: non-finite steps, pre-emption signals, time limits and hung ranks.

- A step whose gradient norm is not finite is skipped: parameters and optimizer state stay as they were
  (llamatron/optim/). A NaN/Inf loss reaches the gradients through backward, so the same test catches
  it. `FaultGuard` counts skipped steps and stops the run after --max-skipped-steps of them in a row. Under
  fp16 an overflow while the loss scale can still back off is the scaler calibrating, not a fault: it is
  counted in `skipped_steps` but neither reported nor part of a streak.
- SIGTERM / SIGUSR1 (SLURM pre-emption or time limit), SIGINT (Ctrl-C), SIGHUP (the terminal closed) and
  --exit-duration-mins only raise a flag (a Ctrl-C stops at the end of the step, with a save; Ctrl-\\ quits at
  once, unsaved). At the
  next step boundary every rank contributes its flags to one all-reduce, so all ranks stop after the same
  step; the loop then saves a checkpoint (with --save) and the run exits with STOPPED_EARLY_EXIT (3): it did
  not finish, so not 0, and a job script can tell it from a failure (1) or bad input (2).
- --dist-timeout bounds every collective. When one fails, `explain_collective_failure` finds out through
  the rendezvous store which ranks did not see the failure themselves (the hung or dead ones) and names them.

Faults for tests are injected, never read from the environment: a `FaultInjection` goes to the guard (NaN
steps, a hung rank) and to the checkpointing (a failed write); tests/inject_faults.py runs a command with one.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import TrainingAborted
from ..models import Transformer
from .engine import Engine

PROCESS_START = time.monotonic()  # --exit-duration-mins counts from here (module import = start of `train`)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
_WHY = {signal.SIGINT: "Ctrl-C", signal.SIGHUP: "the terminal closed"}


@dataclass(frozen=True)
class FaultInjection:
    """Faults a test makes happen (tests/inject_faults.py); a real run has none (NO_FAULTS)."""

    nan_steps: frozenset[int] = frozenset()  # the loss of these (1-based) steps becomes NaN before backward
    hang: tuple[int, int, float] | None = None  # (rank, step, seconds): it sleeps before that step, until a signal
    fail_save: tuple[int, int] | None = None  # (step, rank): that rank's write of that checkpoint fails half-way


NO_FAULTS = FaultInjection()


class CollectiveTimeout(TrainingAborted):
    rank_specific = True


# Signal handlers are process-wide, so the received signal is too. The handler only records it: anything
# more (printing, saving) inside a handler could interrupt the same work in the main thread.
_received_signal = 0
_previous_handlers: dict[int, Any] = {}


def _record_signal(signum: int, frame) -> None:
    global _received_signal
    _received_signal = max(_received_signal, signum)


def install_signal_handlers() -> None:
    """The stop signals request a clean stop at the next step boundary (main thread only, as Python requires)."""
    global _received_signal
    if _previous_handlers or not _in_main_thread():
        return
    _received_signal = 0
    for sig in STOP_SIGNALS:
        _previous_handlers[sig] = signal.signal(sig, _record_signal)


def restore_signal_handlers() -> None:
    for sig, handler in _previous_handlers.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    _previous_handlers.clear()


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class FaultGuard:
    """Per-run fault state: skipped-step counts, stop requests agreed across ranks, injected faults."""

    def __init__(self, engine: Engine, faults: FaultInjection = NO_FAULTS, echo: Callable[[str], None] = print):
        t = engine.cfg.train
        self.max_skipped = t.max_skipped_steps
        self.exit_duration_mins = t.exit_duration_mins
        self.mesh, self.echo = engine.mesh, echo
        scaler = engine.loss_scaler
        self.min_loss_scale = None if scaler is None else scaler.min_scale
        self.skipped_total = 0
        self.streak: list[dict] = []  # records of the current run of consecutive skipped steps
        self.too_many_skipped: str | None = None
        self.last_update_step: int | None = None  # the last step that changed the parameters
        # The stop flags travel over a gloo group even on GPU: a CPU all-reduce between steps does not
        # make the host wait for the GPU, so the next step's kernels can still be queued ahead.
        self.flag_group = None
        if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "gloo":
            self.flag_group = dist.new_group(backend="gloo")
        install_signal_handlers()
        self.nan_steps, self.hang = faults.nan_steps, faults.hang
        self.inject_nan = False
        if self.nan_steps:
            _install_nan_injection(engine.chunks, self)

    def start_step(self, step: int) -> None:
        """Called before the (1-based) step `step` runs: injected faults only."""
        self.inject_nan = step in self.nan_steps
        if self.hang is not None and self.hang[0] == self.mesh.rank and self.hang[1] == step:
            end = time.monotonic() + self.hang[2]
            while time.monotonic() < end and not _received_signal:
                time.sleep(0.05)

    def stop_reason(self) -> str | None:
        """Whether to stop after the step just run; the same answer on every rank (one all-reduce)."""
        time_up = self.exit_duration_mins is not None and self.elapsed_mins() >= self.exit_duration_mins
        flags = torch.tensor([_received_signal, int(time_up)], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.flag_group)
        signum, time_up = flags.tolist()
        if signum:
            why = _WHY.get(signal.Signals(signum), "pre-emption or job time limit")
            return f"received {signal.Signals(signum).name} ({why})"
        if time_up:
            return (
                f"--exit-duration-mins {self.exit_duration_mins:g} reached "
                f"({self.elapsed_mins():.2f} minutes since start)"
            )
        return None

    @staticmethod
    def elapsed_mins() -> float:
        return (time.monotonic() - PROCESS_START) / 60.0

    def count(self, record: dict) -> None:
        """Add the running `skipped_steps` count to a step record; note a streak that reaches the limit."""
        if record["skipped"]:
            self.skipped_total += 1
            # fp16: the record holds the scale after the step's back-off; above the floor it can still adapt.
            if self.min_loss_scale is not None and record.get("loss_scale", 0.0) > self.min_loss_scale:
                record["skipped_steps"] = self.skipped_total
                return
            self.streak.append(record)
            self.echo(
                f"step {record['step']}: loss {record['loss']}, grad norm {record['grad_norm']}: not finite, "
                f"step skipped ({len(self.streak)} in a row, {self.skipped_total} in total)"
            )
            if self.max_skipped and len(self.streak) >= self.max_skipped and self.too_many_skipped is None:
                self.too_many_skipped = self._streak_message()
        else:
            self.streak = []
            self.last_update_step = record["step"]
        record["skipped_steps"] = self.skipped_total

    def check_skipped(self, on_abort: Callable[[], None] = lambda: None) -> None:
        """Raise once --max-skipped-steps consecutive steps were skipped (after their records are written)."""
        if self.too_many_skipped is not None:
            on_abort()
            raise TrainingAborted(self.too_many_skipped)

    @staticmethod
    def stop_message(step: int, reason: str, checkpoint: str | None, save_dir: str | None) -> str:
        if checkpoint is None:
            return f"stopping after step {step}: {reason}; nothing saved (no --save given)"
        return f"stopping after step {step}: {reason}; saved {checkpoint}, resume with --load {save_dir}"

    def _streak_message(self) -> str:
        first, last = self.streak[0], self.streak[-1]
        return (
            f"{len(self.streak)} steps in a row (steps {first['step']}-{last['step']}) had a non-finite loss or "
            f"gradient norm and were skipped (--max-skipped-steps {self.max_skipped}); the parameters are those "
            f"{'as loaded' if self.last_update_step is None else f'after step {self.last_update_step}'}. "
            f"Resume from the last checkpoint with a lower --lr, more "
            f"--warmup-steps or a smaller --clip-grad, or inspect the data those steps read (consumed samples "
            f"up to {last['consumed_samples']})."
        )


def _install_nan_injection(chunks: Sequence[Transformer], guard: FaultGuard) -> None:
    """Injected fault: multiply the final norm's output by NaN on chosen steps, so loss and gradients become NaN."""

    def hook(module, inputs, output):
        return output * float("nan") if guard.inject_nan and module.training else output

    for chunk in chunks:
        if chunk.norm is not None:  # the last pipeline stage's chunk
            chunk.norm.register_forward_hook(hook)


def explain_collective_failure(
    error: BaseException, timeout_s: float, grace_s: float = 10.0
) -> CollectiveTimeout | None:
    """A collective timed out or lost a peer: name the ranks that did not report the failure themselves.

    Every rank that catches the error writes a key into the rendezvous store and waits up to `grace_s`
    (at most the timeout) for the others; ranks still silent then are hung, dead, or stuck elsewhere.
    Returns None for errors that do not come from a collective.
    """
    if not (dist.is_initialized() and _is_collective_error(error)):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    silent: list[int] | None = None
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"llamatron/collective-failure/{rank}", "1")
        deadline = time.monotonic() + min(grace_s, timeout_s)
        while True:
            silent = [r for r in range(world) if not store.check([f"llamatron/collective-failure/{r}"])]
            if not silent or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    except (RuntimeError, OSError):  # the store can be gone too (its host died); then say what is known
        silent = None
    what = "did not complete within --dist-timeout" if "timed out" in str(error).lower() else "failed"
    message = f"rank {rank}: a collective operation {what} ({timeout_s:g} s) — {first_line}"
    if silent:
        names = ", ".join(str(r) for r in silent)
        message += (
            f"\nrank(s) {names} did not report this failure: they are hung, crashed or killed. Look at "
            f"their log and stack (`py-spy dump --pid PID`); --dist-timeout sets how long to wait."
        )
    elif silent is not None:
        message += "\nevery rank reports the failure: a peer's connection broke (see the first error in the logs)."
    return CollectiveTimeout(message)


def _is_collective_error(error: BaseException) -> bool:
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return any(
        s in text
        for s in ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer", "gloo/transport")
    )
