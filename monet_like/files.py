"""Where monet_like keeps files, and writing them so that no reader ever sees half of
one and no link is followed."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` to `path` through a temporary file of a unique name in the same
    folder (created with O_EXCL, so a planted file or link there is never followed),
    flushed to disk, then renamed over `path`: concurrent writers each install a
    whole file, and an interrupted write leaves the old one. Returns `path`."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def writable_folder(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written at `path` (one line), or None when it can: its
    folder (made if missing) must be a writable directory, and `path` not a folder."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a folder, not a file name"
    folder = path.parent
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"cannot write {path}: {probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"cannot write {path}: {probe} is not writable"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".write-check.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    return None


def cache_dir() -> Path:
    """$MONET_LIKE_CACHE, else $XDG_CACHE_HOME/monet_like, else ~/.cache/monet_like: the
    profiles, the smallest-budget searches' schedules, the built C++ operators and
    downloaded zoo schedules."""
    if os.environ.get("MONET_LIKE_CACHE"):
        return Path(os.environ["MONET_LIKE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "monet_like"
