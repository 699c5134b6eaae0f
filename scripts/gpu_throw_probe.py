"""Does a C++ exception thrown from nvcc-compiled host code reach Python?

On one GPU image an error raised by a TORCH_CHECK in csrc/ops_cuda.cu killed the process
(SIGSEGV). The cause: that image's g++ wrapper links libstdc++ statically, and formatting a
number in the message with that private copy crashed (monet_like/toolchain.py). This builds
a one-op extension from a .cu file, whose message formats a number, under several
host-compiler settings (the image's CC, none, the C++ compiler torch uses) and calls it in
a child process each, so a crash is reported, not suffered. No GPU is needed: the throw is
in host code. It builds with the compilers as given: the package's own build picks one
that links libstdc++ dynamically.

With a GPU it also builds monet_like's own operators with CC set to torch's C++ compiler and
checks that relu_backward_mask's CUDA kernel, given a float mask, raises.

Usage: python scripts/gpu_throw_probe.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <torch/library.h>

at::Tensor probe_throw(const at::Tensor& t) {
  TORCH_CHECK(t.numel() < 0, "probe: thrown from nvcc-compiled code, numel ", t.numel());
  return t;
}

TORCH_LIBRARY(NAMESPACE, m) {
  m.def("throw_it(Tensor t) -> Tensor");
  m.impl("throw_it", &probe_throw);
}
"""

CHILD = """
import sys, torch
from torch.utils import cpp_extension
name, src, build = sys.argv[1:4]
cpp_extension.load(name=name, sources=[src], build_directory=build,
                   is_python_module=False, verbose=False)
try:
    getattr(torch.ops, name).throw_it(torch.ones(1))
except RuntimeError as exc:
    print("RAISED", str(exc).splitlines()[0])
else:
    print("NOT RAISED")
"""

OPS_CHILD = """
import torch
from monet_like import kernels
kernels.load()
g = torch.randn(16, device="cuda")
try:
    torch.ops.monet_like.relu_backward_mask(g, g)
except RuntimeError as exc:
    print("RAISED", str(exc).splitlines()[0])
else:
    print("NOT RAISED")
"""


def run_child(code: str, args: list[str], env: dict[str, str]) -> tuple[int, str]:
    run = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parent.parent,
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(("RAISED", "NOT"))]
    return run.returncode, lines[-1] if lines else "\n".join(run.stderr.strip().splitlines()[-6:])


def version(cmd: str | None) -> str:
    if not cmd or shutil.which(cmd) is None:
        return f"{cmd}: not found"
    out = subprocess.run([cmd, "--version"], capture_output=True, text=True).stdout
    return f"{cmd} ({shutil.which(cmd)}): {out.splitlines()[0] if out else '?'}"


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> int:
    for var in ("CC", "CXX", "CUDAHOSTCXX", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"):
        print(f"{var}={os.environ.get(var, '')}")
    for cmd in (os.environ.get("CC"), os.environ.get("CXX"), "gcc", "g++", "c++"):
        print(version(cmd))
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    print("nvcc:", nvcc.strip().splitlines()[-1] if nvcc else "not found")

    cxx = shutil.which(os.environ.get("CXX", "c++"))
    variants = {"image_env": os.environ.get("CC"), "no_cc": None, "cc_is_cxx": cxx}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for label, cc in variants.items():
            name = f"throw_probe_{label}"
            src = Path(tmp, f"{name}.cu")
            src.write_text(SOURCE.replace("NAMESPACE", name))
            build = Path(tmp, name)
            build.mkdir()
            env = dict(os.environ)
            env.pop("CC", None)
            if cc:
                env["CC"] = cc
            rc, verdict = run_child(CHILD, [name, str(src), str(build)], env)
            print(f"THROW {label} (CC={cc}): rc {rc}: {verdict}")
            failed += rc != 0
            if label == "cc_is_cxx" and torch_cuda():  # the candidate fix, on the real ops
                env["MONET_LIKE_JIT"], env["MONET_LIKE_CACHE"] = "1", str(Path(tmp, f"ops_{label}"))
                rc2, verdict2 = run_child(OPS_CHILD, [], env)
                print(f"OPS {label} (CC={cc}): rc {rc2}: {verdict2}")
                failed += rc2 != 0
            if rc < 0 and shutil.which("gdb"):
                bt = subprocess.run(
                    [
                        "gdb",
                        "-batch",
                        "-ex",
                        "run",
                        "-ex",
                        "bt 25",
                        "--args",
                        sys.executable,
                        "-c",
                        CHILD,
                        name,
                        str(src),
                        str(build),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                print("\n".join(ln for ln in bt.stdout.splitlines() if ln.startswith("#")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
