"""The operators are built by a compiler that links libstdc++ as a shared library.

A GPU image's g++ wrapper linked it statically: the operators' error messages then crashed
the process (monet_like/toolchain.py). These tests make such a compiler with a wrapper
script that adds -static-libstdc++, and need g++ (with its static libstdc++).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from monet_like import kernels, toolchain
from monet_like.errors import UserError

GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")


def _static_wrapper(directory: Path, name: str = "static-g++") -> Path:
    """A compiler driver that links libstdc++ statically, like the GPU image's."""
    directory.mkdir(parents=True, exist_ok=True)
    wrapper = directory / name
    wrapper.write_text(f'#!/bin/sh\nexec {GXX} "$@" -static-libstdc++\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper


def _library(tmp_path: Path, compiler: str | Path, name: str) -> Path:
    src = tmp_path / f"{name}.cpp"
    src.write_text("#include <string>\nstd::string f(long v) { return std::to_string(v); }\n")
    lib = tmp_path / f"{name}.so"
    subprocess.run([str(compiler), "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    return lib


def test_a_library_linked_with_its_own_libstdcxx_is_told_from_one_that_needs_the_shared_one(
    tmp_path: Path,
) -> None:
    shared = _library(tmp_path, GXX, "shared")
    own = _library(tmp_path, _static_wrapper(tmp_path), "own")
    assert any(n.startswith("libstdc++.so") for n in toolchain.needed_libraries(shared))
    assert not any(n.startswith("libstdc++.so") for n in toolchain.needed_libraries(own))
    assert not toolchain.carries_own_libstdcxx(shared)
    assert toolchain.carries_own_libstdcxx(own)
    text = tmp_path / "not_elf.so"
    text.write_text("not a library")
    obj = tmp_path / "object.o"  # ELF, but with no dynamic section: nothing known either
    subprocess.run([GXX, "-c", str(tmp_path / "shared.cpp"), "-o", str(obj)], check=True)
    for unknown in (text, obj):
        assert toolchain.needed_libraries(unknown) is None
        assert not toolchain.carries_own_libstdcxx(unknown)


def test_the_requested_compiler_is_kept_when_it_links_libstdcxx_dynamically() -> None:
    assert toolchain.compiler_overrides({"CXX": GXX, "PATH": os.environ["PATH"]}) == {}


def test_a_compiler_that_links_libstdcxx_statically_is_replaced_by_one_on_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wrapper = _static_wrapper(tmp_path)
    env = {"CXX": str(wrapper), "PATH": os.environ["PATH"]}
    overrides = toolchain.compiler_overrides(env, candidates=("g++",))
    assert overrides == {"CXX": GXX, "CC": GXX, "CUDAHOSTCXX": GXX}
    assert f"{wrapper} links libstdc++ statically" in capsys.readouterr().err


def test_with_no_other_compiler_on_path_the_build_is_refused_naming_the_compiler(
    tmp_path: Path,
) -> None:
    # the only g++ on PATH is the wrapper itself, and there is no c++
    wrapper = _static_wrapper(tmp_path / "bin", "g++")
    with pytest.raises(UserError, match="links libstdc\\+\\+ statically") as err:
        toolchain.compiler_overrides({"CXX": "g++", "PATH": str(wrapper.parent)})
    assert str(wrapper) in str(err.value)


def test_the_jit_build_runs_with_the_replacement_compiler_and_refuses_a_private_libstdcxx(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils import cpp_extension

    shared = _library(tmp_path, GXX, "shared")
    own = _library(tmp_path, _static_wrapper(tmp_path), "own")
    seen = []

    def fake_load(**kwargs: object) -> None:  # the build, without compiling the operators
        seen.append((os.environ.get("CXX"), os.environ.get("CC")))
        Path(str(kwargs["build_directory"]), f"{kernels._JIT_NAME}.so").write_bytes(
            built.read_bytes()
        )

    monkeypatch.setenv("MONET_LIKE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", GXX)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(kernels, "_want_cuda", lambda: False)
    monkeypatch.setattr(
        toolchain, "compiler_overrides", lambda: {"CXX": "/replacement/c++", "CC": "/x/c++"}
    )
    built = shared
    kernels._jit_build()
    assert seen == [("/replacement/c++", "/x/c++")]
    assert os.environ["CXX"] == GXX and "CC" not in os.environ  # restored after the build
    keyed = kernels._build_key([kernels._CPP], "/replacement/c++")
    assert (tmp_path / "cache" / "ext" / keyed / f"{kernels._JIT_NAME}.so").exists()
    assert keyed != kernels._build_key([kernels._CPP])

    built = own
    monkeypatch.setattr(toolchain, "compiler_overrides", lambda: {})
    with pytest.raises(UserError, match="carry their own copy of libstdc\\+\\+"):
        kernels._jit_build()


def test_a_prebuilt_extension_with_its_own_libstdcxx_is_not_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    own = _library(tmp_path, _static_wrapper(tmp_path), "own")
    spec = importlib.util.spec_from_file_location("monet_like._C", own)
    real_find_spec = importlib.util.find_spec
    monkeypatch.delenv("MONET_LIKE_JIT", raising=False)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: spec if name == "monet_like._C" else real_find_spec(name, *a),
    )
    assert kernels._load_extension() is False
    assert (
        "ignoring monet_like._C (linked with its own copy of libstdc++" in capsys.readouterr().err
    )


def test_the_install_builds_the_extension_with_the_replacement_compiler(tmp_path: Path) -> None:
    """setup.py (install.sh's editable install) picks the compiler as the loader does."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, CXX=str(_static_wrapper(tmp_path)))
    run = subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=root, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "monet_like"
    assert f"{env['CXX']} links libstdc++ statically" in run.stderr
    assert "building them with" in run.stderr
