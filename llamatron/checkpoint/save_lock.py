"""One run at a time per --save directory: an exclusive OS lock on DIR/.lock, held for the whole run.

Two runs saving into one directory replace each other's step-N and move each other's `latest` (a resumed run
too: two resumes of one checkpoint both save step N+1). The lock is taken before anything is built; the lock
file names its holder (host, pid, start time) for the error the second run prints. The OS releases it when
the holding process exits in any way, so a crashed run leaves no stale lock (the file stays, unlocked).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from typing import IO

from ..errors import ConfigError

LOCK_FILE = ".lock"


class SaveDirLock:
    """Held from `acquire` until `release` (or the process ends)."""

    def __init__(self, handle: IO[str] | None):
        self._handle = handle

    @classmethod
    def acquire(cls, save_dir: str) -> SaveDirLock:
        path = os.path.join(save_dir, LOCK_FILE)
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = _describe(handle.read())
            handle.close()
            raise ConfigError(
                f"--save {save_dir} is in use by another run ({holder}): two runs saving into one directory "
                "replace each other's checkpoints; wait for it to end, or save to another directory"
            ) from None
        except OSError as e:  # a filesystem without locks (some network mounts): say so, go on unprotected
            print(
                f"llamatron: warning: cannot lock {path} ({e.strerror}); nothing stops a second run from "
                "saving into the same directory",
                file=sys.stderr,
            )
            return cls(handle)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}))
        handle.flush()
        return cls(handle)

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the file releases the lock
            self._handle = None


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["started"])))
        return f"pid {int(holder['pid'])} on {holder['host']}, started {started}"
    except (ValueError, KeyError, TypeError):
        return "its lock file does not say which"
