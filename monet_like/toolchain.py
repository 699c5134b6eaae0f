"""Which C++ compiler builds the operators: one that links libstdc++ as a shared library.

A compiler driver that links libstdc++ statically (`-static-libstdc++`, as one GPU image's
g++ wrapper does) puts a private copy of the C++ runtime into the operators' library. The
process runs torch's shared libstdc++, and the private copy's streams are never set up
there: an error message that formats a number lost the number on one machine and crashed
the process (SIGSEGV) on another, instead of raising. So the loader builds with a compiler
that links libstdc++ dynamically, and refuses a built library that carries its own.
"""

from __future__ import annotations

import functools
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from monet_like.errors import UserError

_SHT_DYNAMIC = 6
_DT_NEEDED = 1
_PROBE = "#include <string>\nstd::string monet_like_probe(long v) { return std::to_string(v); }\n"


def needed_libraries(path: str | os.PathLike) -> list[str] | None:
    """The shared libraries an ELF64 little-endian file names as needed (DT_NEEDED).

    Returns:
        Their names in file order, or None when the file is not such an ELF file or has no
        dynamic section in its section table (nothing known then).
    """
    data = Path(path).read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":  # 64-bit, little-endian
        return None
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    needed, dynamic = [], False
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != _SHT_DYNAMIC:
            continue
        dynamic = True
        strtab = sections[link][4]
        for pos in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 0:  # DT_NULL ends the table
                break
            if tag == _DT_NEEDED:
                end = data.index(b"\0", strtab + value)
                needed.append(data[strtab + value : end].decode())
    return needed if dynamic else None


def carries_own_libstdcxx(path: str | os.PathLike) -> bool:
    """True when a C++ shared library needs no shared libstdc++: it was linked with its own.

    False where `needed_libraries` knows nothing.
    """
    needed = needed_libraries(path)
    if needed is None:
        return False
    return not any(n.startswith(("libstdc++.so", "libc++.so")) for n in needed)


@functools.cache
def links_libstdcxx_dynamically(compiler: str) -> bool | None:
    """Whether `compiler` (a path) links a shared library against the shared libstdc++.

    Builds a one-function library with it. None when that build fails: the compiler's own
    error then comes from the real build.
    """
    with tempfile.TemporaryDirectory(prefix="monet_like_cxx_") as tmp:
        src, lib = Path(tmp, "probe.cpp"), Path(tmp, "probe.so")
        src.write_text(_PROBE)
        try:
            run = subprocess.run(
                [compiler, "-shared", "-fPIC", str(src), "-o", str(lib)],
                capture_output=True,
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if run.returncode != 0 or not lib.exists():
            return None
        return not carries_own_libstdcxx(lib)


def compiler_overrides(
    environ: Mapping[str, str] | None = None, candidates: tuple[str, ...] = ("c++", "g++")
) -> dict[str, str]:
    """The environment to build the operators with: empty when the requested compiler
    (CXX, else c++, as torch's builder reads it) links libstdc++ dynamically; else CXX,
    CC (nvcc's host compiler) and CUDAHOSTCXX set to the first of `candidates` that does.

    Raises:
        UserError: when the requested compiler links it statically and no candidate does not.
    """
    environ = os.environ if environ is None else environ
    requested = environ.get("CXX") or "c++"
    path = shutil.which(requested, path=environ.get("PATH"))
    if path is None or links_libstdcxx_dynamically(path) is not False:
        return {}
    shown = requested if requested == path else f"{requested} ({path})"
    for name in candidates:
        other = shutil.which(name, path=environ.get("PATH"))
        if other is None or os.path.realpath(other) == os.path.realpath(path):
            continue
        if links_libstdcxx_dynamically(other):
            print(
                f"monet_like: {shown} links libstdc++ statically, which breaks "
                f"the operators' error messages; building them with {other}",
                file=sys.stderr,
            )
            return {"CXX": other, "CC": other, "CUDAHOSTCXX": other}
    raise UserError(
        f"monet_like: {shown} links libstdc++ statically into shared libraries, "
        f"and no other C++ compiler on PATH ({', '.join(candidates)}) links it as a shared "
        "library: an error raised by the operators would crash the process. Set CXX to a "
        "compiler that links libstdc++ dynamically"
    )


@contextmanager
def environment(overrides: Mapping[str, str]) -> Iterator[None]:
    """os.environ with `overrides` set, restored on exit."""
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
