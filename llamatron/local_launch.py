"""torchrun for `--nproc-per-node N`: stop signals reach the ranks, and a failed job is reported in one line.

The ranks already say what went wrong (a configuration or data error, once). torchrun would follow that with
its own traceback and failure table; here a failure ends with one line naming the ranks and their exit codes,
and the job exits with the first failed rank's code (2 for a bad setting, as a single process would).
Run as `python -m llamatron.local_launch TORCHRUN_ARGS...`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from .errors import STOPPED_EARLY_EXIT
from .parent_watch import PARENT_ENV, stop_with_parent

# A scheduler's stop signals, Ctrl-C and a closed terminal go to the ranks, which stop after the same step, save
# and exit 3 (faults.py); torchrun's own handler would instead stop the ranks itself and kill them 30 s later,
# mid-save. (A Ctrl-C reaches the ranks twice, from the terminal and from here: a second request is the same.)
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


def children(parent: int) -> list[int]:
    """Pids of the processes whose parent is `parent`, from /proc (Linux)."""
    me = str(parent)
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, ...
            except OSError:
                continue
            if fields[1] == me:
                pids.append(int(entry))
    return pids


def _forward_to_ranks(signum: int, frame) -> None:
    for pid in children(os.getpid()):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> int:
    # Its per-worker lines ("failed (exitcode: 3)", "Sending process N closing signal SIGTERM") would follow an
    # early stop that saved, and a failure the ranks already explained; the one line below replaces them.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    stop_with_parent()  # the llamatron command that started this one was killed: stop the ranks (parent_watch.py)
    os.environ[PARENT_ENV] = str(os.getpid())  # and the ranks stop if this process is
    try:
        return _run_torchrun(argv)
    finally:
        os.environ.pop(PARENT_ENV, None)  # (main run inside another process: leave its environment as it was)


def _run_torchrun(argv: list[str] | None) -> int:
    if sys.platform.startswith("linux"):
        # torchrun's --signals-to-handle (read from PET_*; ignored by a torchrun without it): not SIGTERM
        os.environ["PET_SIGNALS_TO_HANDLE"] = "SIGQUIT"
        for sig in FORWARDED:
            signal.signal(sig, _forward_to_ranks)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if STOPPED_EARLY_EXIT in codes and all(c == STOPPED_EARLY_EXIT or c < 0 for c in codes):
            return STOPPED_EARLY_EXIT  # stopped early and saved, as the ranks said; a rank still exiting was ended
        # Ranks ended by a signal were mostly stopped by torchrun after another rank failed.
        said = "; ".join(
            f"rank {r}: " + (f"exit code {f.exitcode}" if f.exitcode >= 0 else f"stopped by {f.signal_name()}")
            for r, f in sorted(e.failures.items())
        )
        print(f"llamatron: the job failed ({said}); the failing rank's message is above", file=sys.stderr, flush=True)
        return next((f.exitcode for _, f in sorted(e.failures.items()) if f.exitcode > 0), 1)
    except SignalException as e:  # SIGQUIT (Ctrl-\): torchrun stopped the ranks
        name = signal.Signals(e.sigval).name
        print(f"llamatron: stopped by {name}; the ranks were stopped without saving", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
