"""Processes started for `--nproc-per-node` stop with the process that started them, even one killed outright.

A scheduler or a user that SIGKILLs `llamatron train --nproc-per-node N` (or the OOM killer) gives it no chance to
pass a stop on: its launcher and the ranks would train on unseen, holding the GPUs. Linux's parent-death signal
asks the kernel to send a child SIGTERM when its parent dies; SIGTERM is a stop request (training/faults.py), so
the ranks stop after the step and save, and the launcher, itself a child, forwards it to them. Each launcher
names itself in LLAMATRON_PARENT_PID for the processes it starts; without it (plain torchrun) nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "LLAMATRON_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_parent() -> None:
    """When started by a llamatron launcher, receive SIGTERM when it dies (at once if it already has)."""
    # read once (popped): a process this one starts is named by its own launcher, and a launcher run inside this
    # process (a test) named this process, which is no parent of itself
    parent = os.environ.pop(PARENT_ENV, "")
    if not parent.isdigit() or int(parent) == os.getpid() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return  # not granted (a sandbox): the old behaviour, nothing worse
    if os.getppid() != int(parent):  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def started_by_me() -> dict[str, str]:
    """The environment for a process this one starts: its parent is this process."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}
