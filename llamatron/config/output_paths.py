"""Output paths checked before a command does any work: of the right kind (a file where a file is written, a
directory where a directory is) and creatable. Creatable is tried, not inferred from permission bits: root passes
every os.access check, yet cannot create a file in /proc or on a read-only mount."""

from __future__ import annotations

import os
import tempfile

from ..errors import ConfigError


def check_output_directory(path: str, flag: str, what: str) -> None:
    """The directory `path` given by `flag` exists or can be created, and is writable."""
    given = f"{flag} {path}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{given} is a file; give a directory for {what}")
    _check_creatable(path, given)


def check_output_file(path: str, flag: str, example: str = "metrics.jsonl") -> None:
    """The file `path` given by `flag` can be opened for appending (it and its missing parents created); `example`:
    a file name the message suggests for a directory."""
    given = f"{flag} {path}"
    if os.path.isdir(path):
        raise ConfigError(f"{given} is a directory; give a file name, e.g. {os.path.join(path, example)}")
    if not os.path.exists(path):
        _check_creatable(path, given)
        return
    try:
        open(path, "a").close()  # appends nothing: the file stays as it was
    except OSError as e:
        raise ConfigError(f"{given}: cannot write to it ({e.strerror}); give another file") from None


def check_output_prefix(prefix: str, flag: str) -> None:
    """Files named PREFIX_* can be created: PREFIX's directory exists or can be created, and is writable."""
    directory = os.path.dirname(os.path.abspath(prefix))
    given = f"{flag} {prefix}"
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"{given}: {directory} is a file; choose a writable directory")
    _check_creatable(directory, given, os.path.join(directory, os.path.basename(prefix) + "_*"))


def _check_creatable(path: str, given: str, shown: str | None = None) -> None:
    """`path` (a file or directory that does not exist yet, or a directory that does) can be created or written:
    a file is made and removed in the nearest directory that exists (the missing ones would be created in it)."""
    parent = os.path.abspath(path) if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{given}: {parent} is a file, so the directory cannot be created there")
    try:
        handle, probe = tempfile.mkstemp(dir=parent, prefix=".llamatron-write-check-")
    except OSError as e:
        raise ConfigError(
            f"{given}: cannot create {shown or path} ({e.strerror}): choose a writable directory"
        ) from None
    os.close(handle)
    os.remove(probe)
