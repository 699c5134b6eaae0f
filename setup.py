"""monet_like: a schedule compiler for memory-bounded training."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def _compiler_linking_libstdcxx_dynamically() -> None:
    """Build with the compiler the run-time loader would pick: one linking libstdc++
    statically breaks the operators' error messages (monet_like/toolchain.py)."""
    sys.path.insert(0, str(HERE))
    try:
        from monet_like.errors import UserError
        from monet_like.toolchain import compiler_overrides

        os.environ.update(compiler_overrides())
    except UserError as exc:  # the loader refuses such a build at run time, saying why
        print(exc, file=sys.stderr)
    finally:
        sys.path.remove(str(HERE))


def _extension() -> tuple[list[Any], dict[str, Any]]:
    """monet_like._C from csrc/ (CUDA kernels too where wanted), built with torch's tools.

    Without torch at build time (an isolated build) there is nothing to build
    against; monet_like.kernels.load() then compiles the same sources at run time.
    """
    if not (HERE / "csrc" / "ops.cpp").exists() or os.environ.get("MONET_LIKE_NO_EXT") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        return [], {}

    class OptionalBuildExtension(BuildExtension):
        # A failed compile must not fail the install: the JIT loader is the fallback.
        def build_extension(self, ext: Any) -> None:
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - any compiler failure
                print(
                    f"monet_like: building {ext.name} failed ({exc}); the operators will be "
                    "compiled on first use instead",
                    file=sys.stderr,
                )

    _compiler_linking_libstdcxx_dynamically()
    # BuildExtension finds ninja on PATH; a venv's python run by its path lacks its bin.
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and scripts and (Path(scripts) / "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")

    sources = ["csrc/ops.cpp"]  # relative: setuptools wants paths inside the project
    cuda_wanted = os.environ.get("MONET_LIKE_CUDA") == "1" or torch.cuda.is_available()
    cuda_source = HERE / "csrc" / "ops_cuda.cu"
    kwargs: dict[str, Any] = {
        "define_macros": [("MONET_LIKE_PYTHON_MODULE", None)],
        # -fopenmp: at::parallel_for is inline and only goes parallel with it.
        "extra_compile_args": {"cxx": ["-O3", "-fopenmp"], "nvcc": ["-O3"]},
        "extra_link_args": ["-fopenmp"],
    }
    if cuda_wanted and cuda_source.exists():
        # torch's CUDA headers include cuDNN's, cuBLAS's and cuSPARSE's, which a
        # pip-installed torch has in the nvidia-* wheels rather than in the toolkit:
        # -isystem, so that the toolkit's own headers (-I) come first.
        spec = importlib.util.find_spec("nvidia")
        roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
        wheel_includes = sorted(str(i) for r in roots for i in r.glob("*/include"))
        kwargs["extra_compile_args"]["nvcc"] += [
            flag for d in wheel_includes for flag in ("-isystem", d)
        ]
        ext = CUDAExtension("monet_like._C", [*sources, "csrc/ops_cuda.cu"], **kwargs)
    else:
        kwargs["extra_compile_args"] = {"cxx": kwargs["extra_compile_args"]["cxx"]}
        ext = CppExtension("monet_like._C", sources, **kwargs)
    return [ext], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = _extension()

setup(
    name="monet_like",
    version="0.1.0",
    description="MILP schedule compiler for memory-bounded deep-learning training",
    packages=find_packages(include=["monet_like", "monet_like.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch==2.14.1",
        "torchvision==0.29.1",
        "cvxpy>=1.5",
        "cylp>=0.92",
        "highspy>=1.7",
        "pulp>=2.8",
        "pandas>=2.0",
        "ninja>=1.11",
        "tqdm>=4.66",
        "matplotlib>=3.8",
    ],
    entry_points={"console_scripts": ["monet_like=monet_like.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
