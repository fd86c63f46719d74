"""Whole-file outputs (JSON, plots, tables) that touch only the file the user named.

A path that is a regular file, or nothing yet, is replaced in one step (a new file beside it,
renamed over it), so a reader never sees half of it. A symbolic link is followed to its target,
which is written the same way (a loop of links is refused). A path that is something else (a
device such as /dev/null, a FIFO) is written through as a stream and never replaced; a folder is
refused.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path


def _target(path: Path) -> Path:
    """Where a write to path lands: a symbolic link's final target, else path itself."""
    return Path(os.path.realpath(path))


def check(path: Path) -> None:
    """Refuse, before any work and creating nothing, a path a whole-file output cannot go to."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"cannot write {path} (its symbolic links form a loop): pass a "
                             "file's path") from None
    target = _target(path)
    if target.is_dir():
        raise ValueError(f"cannot write {path} (it is a folder): pass a file's path")
    folder = target.parent
    if not target.exists() and not folder.is_dir():
        raise ValueError(f"cannot write {path} (no folder {folder}): pass a writable path")
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise ValueError(f"cannot write {path} (permission denied): pass a writable path")


def check_folder(path: Path, flag: str) -> None:
    """Refuse, before any work and creating nothing, a path a folder of outputs cannot go to:
    flag's folder must be one, or be creatable in a writable folder."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{flag} {path}: its symbolic links form a loop: pass a folder") from None
    target = _target(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {path} is not a folder: pass a folder (or a path to make one)")
    if os.path.islink(path) and not target.exists():
        raise ValueError(f"{flag} {path} is a link to {target}, which does not exist: make it, "
                         "or pass a folder")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path} cannot be made ({existing} is not a folder): pass a "
                         "folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} cannot be written ({existing}: permission denied): "
                         "pass a writable folder")


def is_stream(path: Path) -> bool:
    """Whether path is (or links to) a device or FIFO, which is written through, not replaced."""
    target = _target(path)
    return target.exists() and not stat.S_ISREG(target.stat().st_mode)


def write(path: Path, data: bytes) -> None:
    """data as path's whole content (see the module's docstring); an error is one line. A FIFO
    that no process reads is refused at once, never waited on."""
    target = _target(path)
    try:
        if is_stream(target):
            try:  # O_NONBLOCK: a FIFO without a reader fails at once (ENXIO) instead of hanging.
                fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                raise ValueError(f"cannot write {path} (a FIFO that no process reads): read it "
                                 "while the run ends, or pass a file's path") from None
            os.set_blocking(fd, True)  # A reader is there: write it all, as it reads.
            with open(fd, "wb") as stream:
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
