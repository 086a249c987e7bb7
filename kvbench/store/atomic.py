"""Writes that either happen whole or not at all: a killed run never leaves half a file or directory."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def write_with(path: Path, writer: Callable[[Path], None]) -> None:
    """Let ``writer`` fill a temporary path beside ``path``, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        writer(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


#: what an OSError from a write means for the folder written to
_WHY = {errno.EROFS: "it is on a read-only file system", errno.EACCES: "permission denied",
        errno.EPERM: "permission denied", errno.ENOSPC: "no space is left on its device",
        errno.EDQUOT: "the disk quota is exceeded"}


def why_unwritable(e: OSError) -> str:
    """Why a write failed, in words (a read-only file system, permission denied, no space, ...)."""
    return _WHY.get(e.errno, e.strerror or type(e).__name__)


def probe_write(folder: Path, nbytes: int = 0) -> None:
    """Create ``folder`` if missing, then write, sync and remove a hidden file of ``nbytes`` there: raises the
    OSError a read-only, foreign or full folder gives, before any work whose output would be lost to it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * nbytes)
            f.flush()
            os.fsync(f.fileno())
    finally:
        Path(probe).unlink(missing_ok=True)


@contextmanager
def staged_dir(final: Path):
    """Yield a scratch directory that becomes ``final`` only if the block completes."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
