"""What C++ libraries write to stdout or stderr (solvers' banners and logs, the
profiler's lines), collected or discarded at the file-descriptor level, where Python's
own redirection does not reach."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def silenced(fd: int):
    """Discard what C++ libraries write to file descriptor `fd` (1 or 2) meanwhile: the
    profiler library's log lines, HiGHS's banner (printed from its constructor since
    highspy 1.16, before any option can turn it off)."""
    with captured(fd):
        yield


@contextlib.contextmanager
def captured(fd: int):
    """Collect what C++ libraries write to file descriptor `fd` meanwhile: yields a list
    that holds the text once the block is left (CBC's log, read for what it proves)."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    text: list[str] = []
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), fd)
        try:
            yield text
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            sink.seek(0)
            text.append(sink.read().decode(errors="replace"))
