"""Writes that survive a crash: fsync of files and of folder entries, and a file replaced atomically.

A leaf module (it imports nothing of mlm_ddp): checkpoints, the run folder's files, prepared shards and
the watchdog's hang record all write through it.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable, not only the files' bytes."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path, only: Callable[[Path], bool] | None = None) -> None:
    """fsync the files under `root` (those `only` selects) and every folder's entries."""
    for path in sorted(root.rglob("*")):
        if path.is_file() and (only is None or only(path)):
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(root)


def write_atomic(path: Path, text: str | bytes, shared: bool = False) -> None:
    """Write `text` to `path` through a temporary file and a rename: a crash leaves the old file or
    the new one (text or bytes), never a torn one (a torn summary.json would make `auto` think a run finished).
    `shared`: several processes may write the same file at once (the same text), each through a
    temporary file of its own, which no other can replace under it."""
    tmp = path.with_name(f".tmp-{path.name}" + (f".{socket.gethostname()}.{os.getpid()}" if shared else ""))
    with open(tmp, "wb" if isinstance(text, bytes) else "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def unwritable(folder: Path) -> str | None:
    """Why `folder` (made later, with its parents) could not be written, or None. A file is created and removed in
    its nearest existing folder, so nothing stays behind: permission bits do not tell it for root, who writes past
    them, while a read-only mount, /sys or /proc refuse it, and a path through a regular file cannot be made."""
    at = Path(folder).absolute()
    while not at.exists() and at != at.parent:
        at = at.parent
    if not at.is_dir():
        return f"{at} is a file, not a folder"
    try:
        handle, name = tempfile.mkstemp(dir=at, prefix=".mlm_ddp-write-test-")
        os.close(handle)
        os.unlink(name)
    except OSError as err:
        return f"{at} cannot be written ({err.strerror or err})"
    return None
