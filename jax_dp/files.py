"""Whole-file outputs (JSON, plots, tables) that touch only the file the user named.

A path that is a regular file, or nothing yet, is replaced in one step (a new file beside it,
renamed over it), so a reader never sees half of it. A symbolic link is followed to its target,
which is written the same way. A path that is something else (a device such as /dev/null, a
FIFO) is written through as a stream and never replaced; a folder is refused.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _target(path: Path) -> Path:
    """Where a write to path lands: a symbolic link's final target, else path itself."""
    return Path(os.path.realpath(path))


def check(path: Path) -> None:
    """Refuse, before any work and creating nothing, a path a whole-file output cannot go to."""
    target = _target(path)
    if target.is_dir():
        raise ValueError(f"cannot write {path} (it is a folder): pass a file's path")
    folder = target.parent
    if not target.exists() and not folder.is_dir():
        raise ValueError(f"cannot write {path} (no folder {folder}): pass a writable path")
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise ValueError(f"cannot write {path} (permission denied): pass a writable path")


def write(path: Path, data: bytes) -> None:
    """data as path's whole content (see the module's docstring); an error is one line."""
    target = _target(path)
    try:
        if target.exists() and not stat.S_ISREG(target.stat().st_mode):
            with open(target, "wb") as stream:  # A device or FIFO: written through, kept.
                stream.write(data)
            return
        mode = target.stat().st_mode & 0o777 if target.exists() else 0o666 & ~_umask()
        fd, part = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(part, mode)
            os.replace(part, target)
        except BaseException:
            os.unlink(part)
            raise
    except OSError as e:
        raise ValueError(f"cannot write {path} ({e.strerror}): free some space, or pass another "
                         "path") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
