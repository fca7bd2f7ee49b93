"""Durable atomic file replacement: the file at a path is always a whole old or a whole new one.

:func:`write_atomically` has a writer fill a temporary file next to the target, flushes it to
disk (``fsync``), renames it over the target (``os.replace``, atomic on POSIX and Windows) and
flushes the folder, so that the rename itself survives a power cut. A process killed at any
point (even by ``SIGKILL``, which runs no clean-up) leaves the previous file intact and at
worst a temporary file, named ``<target>.tmp-<pid>-<hex>``. The next write to the same target
removes the temporary files of processes that no longer run.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Callable

__all__ = ["write_atomically", "stale_temporaries"]

#: What separates a target's name from the rest of the name of one of its temporary files.
TEMP_MARK = ".tmp-"


def write_atomically(filename: str, write: Callable[[str], object]) -> None:
    """Replace ``filename`` by what ``write(temporary_name)`` writes, durably and atomically.

    Examples
    --------
    >>> import os, pathlib, tempfile
    >>> from braintrace._atomic_file import write_atomically
    >>> target = os.path.join(tempfile.mkdtemp(), 'notes.txt')
    >>> write_atomically(target, lambda tmp: pathlib.Path(tmp).write_text('hello'))
    >>> pathlib.Path(target).read_text(), os.listdir(os.path.dirname(target))
    ('hello', ['notes.txt'])
    """
    folder = os.path.dirname(os.path.abspath(filename))
    os.makedirs(folder, exist_ok=True)
    for stale in stale_temporaries(filename):
        with contextlib.suppress(OSError):  # another process may remove it first
            os.remove(stale)
    temp = f"{filename}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex}"
    try:
        write(temp)
        with open(temp, "ab") as f:  # "ab": fsync needs a writable handle on some systems
            os.fsync(f.fileno())
        os.replace(temp, filename)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temp)
        raise
    _fsync_folder(folder)


def stale_temporaries(filename: str) -> list[str]:
    """The temporary files of ``filename`` left by processes that no longer run."""
    folder = os.path.dirname(os.path.abspath(filename))
    prefix = os.path.basename(filename) + TEMP_MARK
    found = []
    for name in sorted(os.listdir(folder)):
        if not name.startswith(prefix):
            continue
        pid, dash, _ = name[len(prefix):].partition("-")
        if dash and pid.isdigit() and not _running(int(pid)):
            found.append(os.path.join(folder, name))
    return found


def _running(pid: int) -> bool:
    if pid == os.getpid() or os.name != "posix":
        return True  # on Windows os.kill would end the process: keep every file
    try:
        os.kill(pid, 0)  # signal 0: an existence check only
    except ProcessLookupError:
        return False
    except (OverflowError, OSError):
        return True  # it runs under another user, or no such pid can exist: keep its file
    return True


def _fsync_folder(folder: str) -> None:
    """Flush the folder entry of the rename (POSIX; Windows has no folder handles to flush)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
