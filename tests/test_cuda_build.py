"""Build csrc/ops_cuda.cu (with csrc/ops.cpp) so that a broken .cu file fails a test.

torch.utils.cpp_extension.load compiles both sources with torch's own flags and links a shared
library; loading it needs no GPU (libtorch_cuda loads without one, and registering kernels runs
nothing on the device), so the test builds and loads the real library, then checks that every
op has a CUDA kernel. With a GPU it also runs each CUDA op against its CPU kernel (and the cuDNN
convolutions against torch's). All of it runs in a subprocess: a second TORCH_LIBRARY of the
monet_like namespace in this process (monet_like.kernels may have loaded the CPU build) fails.

The build directory is keyed by the sources' hash, so a second run only loads the library.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch

# importing it builds nothing; the flags are the loader's, so the test builds what users run
from monet_like.kernels import _CFLAGS, _CUDA_CFLAGS, _LDFLAGS, OPS
from monet_like.toolchain import carries_own_libstdcxx, compiler_overrides

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "csrc" / "ops.cpp", ROOT / "csrc" / "ops_cuda.cu"]
DEFAULT_ARCH = "8.0"  # one architecture keeps a build without a GPU short
CONV_OPS = (
    "conv_cudnn_algorithms",
    "conv_cudnn_forward",
    "conv_cudnn_backward_data",
    "conv_cudnn_backward_weight",
    "conv_cudnn_workspace",
)
# Read at import: conftest points MONET_LIKE_CACHE at a fresh temporary directory once the tests
# start, which would make every run a cold build.
_CACHE_ENV = os.environ.get("MONET_LIKE_CACHE")

pytestmark = pytest.mark.slow


def _cache_root() -> Path:
    if _CACHE_ENV:
        return Path(_CACHE_ENV)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "monet_like"


def _cuda_home(nvcc: str) -> str:
    """The CUDA toolkit nvcc belongs to: nvcc on PATH may be a wrapper script outside it."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    cmd = [nvcc, "--dryrun", "-E", "-x", "cu", os.devnull]  # prints its settings, runs nothing
    out = subprocess.run(cmd, capture_output=True, text=True)
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("#$ _HERE_="):
            home = Path(line.split("=", 1)[1].strip()).parent.resolve()
            if (home / "include" / "cuda_runtime.h").exists():
                return str(home)
    return str(Path(nvcc).resolve().parent.parent)


def _wheel_includes() -> list[Path]:
    """The include directories of pip's nvidia-* wheels (nvidia/cu13/include, ...)."""
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return sorted(inc for root in roots for inc in root.glob("*/include") if inc.is_dir())


def _extra_includes(cuda_home: str) -> tuple[list[str], bool]:
    """Include directories the build needs beyond the toolkit's, and whether cudnn.h is there.

    torch's CUDA headers include cuSPARSE's, cuBLAS's and cuDNN's, which a pip-installed torch
    finds in the nvidia-* wheels rather than in the toolkit. They go after the toolkit's
    directory (-isystem, appended), so that headers both hold come from the toolkit.
    """
    dirs = [
        Path(os.environ[v]) / "include" for v in ("CUDNN_HOME", "CUDNN_PATH") if os.environ.get(v)
    ]
    dirs += _wheel_includes()
    dirs = [d for d in dirs if d.is_dir()]
    has_cudnn = any((d / "cudnn.h").exists() for d in [*dirs, Path(cuda_home) / "include"])
    return [str(d) for d in dirs], has_cudnn


# Runs in a fresh interpreter: build, load, check the registrations; with a GPU, compare.
_SCRIPT = r"""
import faulthandler
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.grad import conv2d_input, conv2d_weight
from torch.utils import cpp_extension

faulthandler.enable()  # a crash in a kernel prints where it happened
args = json.loads(sys.argv[1])
cpp_extension.load(
    name="monet_like_ops_cuda_test",
    sources=args["sources"],
    build_directory=args["build_dir"],
    extra_cflags=args["cflags"] + args["flags"],
    extra_cuda_cflags=args["cuda_cflags"] + args["flags"],
    extra_ldflags=args["ldflags"],
    is_python_module=False,
    with_cuda=True,
    verbose=True,
)
missing = [
    op for op in args["ops"]
    if not torch._C._dispatch_has_kernel_for_dispatch_key("monet_like::" + op, "CUDA")
]
assert not missing, f"no CUDA kernel for {missing}"
print("REGISTERED", len(args["ops"]))
if not torch.cuda.is_available():
    sys.exit(0)

ops = torch.ops.monet_like
torch.manual_seed(0)
torch.backends.cudnn.allow_tf32 = False  # compare float32 convolutions without TF32
TOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def same(got, want, tol=0.0):
    if want is None:
        assert got is None, "expected an undefined tensor"
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol, equal_nan=True)


def cuda(t):
    return None if t is None else t.cuda()


def check_relu(dtype, tol):
    x = torch.randn(2, 3, 7, 9, dtype=dtype)
    x[0, 0, 0, :3] = torch.tensor([float("nan"), 0.0, -0.0])
    g = torch.randn_like(x)
    same(ops.relu_mask(x.cuda()), ops.relu_mask(x))
    mask = ops.relu_mask(x)
    same(ops.relu_backward_mask(g.cuda(), mask.cuda()), ops.relu_backward_mask(g, mask))


def check_max_pool(dtype, tol):
    x = torch.randn(2, 3, 7, 9, dtype=dtype)
    for pool in (([3, 3], [2, 2], [1, 1], [1, 1], False), ([2, 2], [], [0, 0], [1, 1], True),
                 ([3, 2], [2, 1], [1, 0], [2, 1], True)):
        out, idx = ops.max_pool2d_compact(x.cuda(), *pool)
        want_out, want_idx = ops.max_pool2d_compact(x, *pool)
        same(out, want_out)
        same(idx, want_idx)
        dy = torch.randn_like(want_out)
        got = ops.max_pool2d_compact_backward(dy.cuda(), idx, list(x.shape), *pool)
        same(got, ops.max_pool2d_compact_backward(dy, want_idx, list(x.shape), *pool), tol)


def check_hardtanh(dtype, tol):
    y = torch.clamp(torch.randn(4, 3, 5, dtype=dtype), -1.0, 1.0)
    dy = torch.randn_like(y)
    same(ops.hardtanh_backward_from_output(dy.cuda(), y.cuda(), -1.0, 1.0),
         ops.hardtanh_backward_from_output(dy, y, -1.0, 1.0))


def check_batch_norm_backward(dtype, tol):
    pdtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    w = torch.rand(3, dtype=pdtype) + 0.5
    b = torch.randn(3, dtype=pdtype)
    invstd = torch.rand(3, dtype=pdtype) + 0.5
    mean = torch.randn(3, dtype=pdtype)
    y = torch.randn(4, 3, 5, 6, dtype=dtype)
    dy = torch.randn_like(y)
    for weight, bias in ((w, b), (None, None)):
        for mask3 in ([True, True, True], [True, False, True], [False, True, False]):
            got = ops.batch_norm_backward_from_output(
                dy.cuda(), y.cuda(), cuda(weight), cuda(bias), invstd.cuda(), mask3)
            want = ops.batch_norm_backward_from_output(dy, y, weight, bias, invstd, mask3)
            for a, e in zip(got, want, strict=True):
                same(a, e, tol)
            got = ops.batch_norm_backward_from_input(
                dy.cuda(), y.cuda(), cuda(weight), mean.cuda(), invstd.cuda(), mask3)
            want = ops.batch_norm_backward_from_input(dy, y, weight, mean, invstd, mask3)
            for a, e in zip(got, want, strict=True):
                same(a, e, tol)
            if mask3[0]:
                dyc = dy.cuda()
                got = ops.batch_norm_backward_from_input_(
                    dyc, y.cuda(), cuda(weight), mean.cuda(), invstd.cuda(), mask3)
                for a, e in zip((dyc, *got), want, strict=True):
                    same(a, e, tol)


def check_batch_norm_in_place(dtype, tol):
    # against aten's own training BatchNorm on the GPU: it keeps half and bfloat16 inputs'
    # statistics in float32 there (on the CPU in the input's dtype); parameters in the input's
    # dtype, as the full mode leaves mixed-precision BatchNorms alone
    x = torch.randn(2, 3, 7, 9, dtype=dtype, device="cuda")
    w = torch.rand(3, dtype=dtype, device="cuda") + 0.5
    b = torch.randn(3, dtype=dtype, device="cuda")
    rm, rv = torch.zeros(3, dtype=dtype, device="cuda"), torch.ones(3, dtype=dtype, device="cuda")
    want_rm, want_rv = rm.clone(), rv.clone()
    want = torch.ops.aten.native_batch_norm(x, w, b, want_rm, want_rv, True, 0.1, 1e-5)
    got = ops.batch_norm_inplace_(x, w, b, rm, rv, 0.1, 1e-5)
    for a, e in zip((x, *got, rm, rv), (*want, want_rm, want_rv), strict=True):
        same(a, e.cpu(), tol)


def check_cudnn_conv(dtype, tol):
    if dtype == torch.bfloat16:
        return  # float, double and half
    conv = dict(stride=[2, 1], padding=[1, 1], dilation=[1, 2], groups=2)
    cargs = list(conv.values())
    x = torch.randn(2, 4, 9, 10, dtype=dtype)
    wt = torch.randn(6, 2, 3, 3, dtype=dtype)
    bias = torch.randn(6, dtype=dtype)
    ref = lambda t: t.double()  # noqa: E731
    want_y = F.conv2d(ref(x), ref(wt), ref(bias), **conv)
    dy = torch.randn(want_y.shape, dtype=dtype)
    want_dx = conv2d_input(x.shape, ref(wt), ref(dy), **conv)
    want_dw = conv2d_weight(ref(x), wt.shape, ref(dy), **conv)
    flat = ops.conv_cudnn_algorithms(x.cuda(), wt.cuda(), *cargs)
    lists, pos = [], 0
    for _ in range(3):
        lists.append(flat[pos + 1 : pos + 1 + flat[pos]])
        pos += 1 + flat[pos]
    assert pos == len(flat) and all(lists), flat
    ctol = {torch.float32: 2e-3, torch.float64: 1e-9, torch.float16: 5e-2}[dtype]
    for which, algos in enumerate(lists):
        for algo in algos:
            ws = ops.conv_cudnn_workspace(x.cuda(), wt.cuda(), *cargs, which, algo)
            assert ws >= 0
            if which == 0:
                got = ops.conv_cudnn_forward(x.cuda(), wt.cuda(), bias.cuda(), *cargs, algo)
                want = want_y
            elif which == 1:
                got = ops.conv_cudnn_backward_data(dy.cuda(), wt.cuda(), list(x.shape), *cargs,
                                                   algo)
                want = want_dx
            else:
                got = ops.conv_cudnn_backward_weight(dy.cuda(), x.cuda(), list(wt.shape), *cargs,
                                                     algo)
                want = want_dw
            torch.testing.assert_close(got.cpu().double(), want, rtol=ctol, atol=ctol)
    print("CUDNN ALGORITHMS", dtype, [len(a) for a in lists])


def raises(call, match):
    try:
        call()
    except RuntimeError as exc:
        assert match in str(exc), exc
    else:
        raise AssertionError(f"accepted: expected an error saying {match!r}")


def check_errors_raise(dtype, tol):
    # after the others: an error thrown by a kernel must reach Python as a RuntimeError
    g = torch.randn(16, dtype=dtype)
    print("  from the CPU kernel (ops.cpp)", flush=True)  # whether any throw crashes, or CUDA's
    raises(lambda: ops.relu_backward_mask(g, g), "mask must be uint8")
    g = g.cuda()
    print("  from the CUDA kernel (ops_cuda.cu)", flush=True)
    raises(lambda: ops.relu_backward_mask(g, g), "mask must be uint8")
    if dtype == torch.bfloat16:
        return
    x = torch.randn(2, 4, 9, 10, dtype=dtype, device="cuda")
    wt = torch.randn(6, 4, 3, 3, dtype=dtype, device="cuda")
    raises(lambda: ops.conv_cudnn_forward(x, wt, None, [1, 1], [1, 1], [1, 1], 1, 99),
           "out of range")


# Every check runs, each named before it starts (a crash in a kernel is then placed by the
# last CHECK line and faulthandler's traceback); a GPU's minutes are too few for one
# failure per run.
failures = []
CHECKS = (check_relu, check_max_pool, check_hardtanh, check_batch_norm_backward,
          check_batch_norm_in_place, check_cudnn_conv, check_errors_raise)
for check in CHECKS:
    for dtype, tol in TOL.items():
        print("CHECK", check.__name__, dtype, flush=True)
        try:
            check(dtype, tol)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below, all of them
            failures.append(f"{check.__name__} {dtype}: {type(exc).__name__}: {exc}")
            print("FAIL", failures[-1], flush=True)
if failures:
    sys.exit("GPU FAILURES:\n" + "\n".join(failures))
print("GPU OK")
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH: no CUDA build")
@pytest.mark.skipif(torch.version.cuda is None, reason="this torch is not a CUDA build")
def test_cuda_sources_build_and_register() -> None:
    missing = [str(s) for s in SOURCES if not s.exists()]
    assert not missing, f"missing sources: {missing}"
    nvcc = shutil.which("nvcc")
    assert nvcc is not None
    cuda_home = _cuda_home(nvcc)
    env = dict(os.environ, CUDA_HOME=cuda_home)
    env.update(compiler_overrides(env))  # the compiler the package's own build would use
    if not env.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        env["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH  # with a GPU torch builds for that one
    # cpp_extension runs ninja from PATH; a venv's python run by its full path lacks it there.
    scripts = sysconfig.get_path("scripts")
    env["PATH"] = os.pathsep.join(p for p in (scripts, env.get("PATH", "")) if p)
    includes, cudnn = _extra_includes(cuda_home)

    key = hashlib.sha256()
    for src in SOURCES:
        key.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    arch = env.get("TORCH_CUDA_ARCH_LIST", "native")
    key.update(
        f"{torch.__version__}|{cuda_home}|{includes}|{arch}|{_CFLAGS}|{_CUDA_CFLAGS}|"
        f"{env.get('CXX', '')}".encode()
    )
    build_dir = _cache_root() / "ext-cuda" / key.hexdigest()[:16]
    build_dir.mkdir(parents=True, exist_ok=True)

    ops = OPS + (CONV_OPS if cudnn else ())
    args = {
        "sources": [str(s) for s in SOURCES],
        "build_dir": str(build_dir),
        "flags": [flag for d in includes for flag in ("-isystem", d)],
        "cflags": _CFLAGS,
        "cuda_cflags": _CUDA_CFLAGS,
        "ldflags": _LDFLAGS,
        "ops": list(ops),
    }
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    log = proc.stdout + proc.stderr
    tail = "\n".join(log.strip().splitlines()[-120:])
    assert proc.returncode == 0, f"CUDA build or check failed in {build_dir}:\n{tail}"
    assert f"REGISTERED {len(ops)}" in proc.stdout, tail
    # a private libstdc++ breaks the kernels' error messages (toolchain's docstring)
    assert not carries_own_libstdcxx(build_dir / "monet_like_ops_cuda_test.so"), build_dir
    if torch.cuda.is_available():
        assert "GPU OK" in proc.stdout, tail
    print(f"built and loaded in {time.monotonic() - start:.0f} s ({build_dir})")
