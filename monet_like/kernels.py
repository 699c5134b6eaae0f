"""Memory-lean operator variants, as torch.ops.monet_like.*, and their loader.

The ops are written in C++ (csrc/ops.cpp; CUDA kernels in csrc/ops_cuda.cu where
present) and registered with torch.library. `load()` makes them available: from
`monet_like._C` when setup.py built it, else by compiling the sources once into
the cache (`<cache>/ext/<key>`, about a minute). Importing this module builds
nothing; it only registers the fake (meta) kernels, so FakeTensorMode and make_fx
see the right shapes, dtypes and strides without running anything.

    relu_mask(y) -> uint8[ceil(numel/8)]     bit i of byte j: !(y[8j+i] <= 0)
    relu_backward_mask(dy, mask)            == threshold_backward(dy, y, 0)
    max_pool2d_compact(x, k, s, p, d, ceil) -> (out, uint8 index kh * kW + kw)
    max_pool2d_compact_backward(...)        == max_pool2d_with_indices_backward
    batch_norm_backward_from_output(...)    native_batch_norm_backward from y, not x
    batch_norm_backward_from_input(...)     native_batch_norm_backward without aten's CPU scratch
    batch_norm_backward_from_input_(dy,...) the same, dx written over dy -> (dw, db)
    hardtanh_backward_from_output(dy, y, lo, hi)
    batch_norm_inplace_(x, ...)             training BatchNorm written over x
    conv2d_algo(x, w, b, s, p, d, g, algo)  convolution by a named algorithm (-1: PyTorch's)
    conv2d_backward_algo(dy, x, w, ..., mask, algo_data, algo_weight)
    conv2d_algorithms(x, w, s, p, d, g)     [n, ids...] per direction (forward, data, weight)
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

import torch

from monet_like import toolchain
from monet_like.errors import UserError

NAMESPACE = "monet_like"
OPS: tuple[str, ...] = (
    "relu_mask",
    "relu_backward_mask",
    "max_pool2d_compact",
    "max_pool2d_compact_backward",
    "batch_norm_backward_from_output",
    "batch_norm_backward_from_input",
    "batch_norm_backward_from_input_",
    "hardtanh_backward_from_output",
    "batch_norm_inplace_",
    "conv2d_algo",
    "conv2d_backward_algo",
    "conv2d_algorithms",
)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_CPP = _CSRC / "ops.cpp"
_CU = _CSRC / "ops_cuda.cu"
_JIT_NAME = "monet_like_ops"
_CFLAGS = ["-O3", "-fopenmp"]  # -fopenmp: at::parallel_for is inline and needs it to go parallel
_LDFLAGS = ["-fopenmp"]
_CUDA_CFLAGS = ["-O3"]

_lock = threading.Lock()
_loaded = False
_origin = ""  # "extension", "jit" or "preloaded", once loaded


def _ops_registered() -> bool:
    return all(hasattr(getattr(torch.ops, NAMESPACE), name) for name in OPS)


def load() -> None:
    """Make torch.ops.monet_like.* available; cheap after the first call.

    Raises UserError when the ops must be compiled and cannot be (no compiler, a
    failed build), with the tail of the compiler's output.
    """
    global _loaded, _origin
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        if _ops_registered():
            _origin = "preloaded"
        elif _load_extension():
            _origin = "extension"
        else:
            _jit_build()
            _origin = "jit"
        if not _ops_registered():
            raise UserError(f"monet_like: the {_origin} build did not register every op of {OPS}")
        _register_python_kernels()
        _warn_missing_cuda()
        _loaded = True


def available() -> bool:
    """True when the ops can be used; builds them if needed (see `load`)."""
    try:
        load()
    except UserError:
        return False
    return True


def origin() -> str:
    """Where the loaded ops came from: "extension", "jit", "preloaded", or "" if not loaded."""
    return _origin


# --------------------------------------------------------------------------- loading


def _want_cuda() -> bool:
    return _CU.exists() and torch.cuda.is_available()


def _extension_is_current(path: Path) -> bool:
    """False when the sources beside the package are newer than the prebuilt module."""
    sources = [_CPP] + ([_CU] if _want_cuda() else [])
    built = path.stat().st_mtime
    return all(not s.exists() or s.stat().st_mtime <= built for s in sources)


def _load_extension() -> bool:
    """Import monet_like._C if setup.py built it and it is not older than the sources."""
    if os.environ.get("MONET_LIKE_JIT") == "1":
        return False
    spec = importlib.util.find_spec("monet_like._C")
    if spec is None or spec.origin is None or not _extension_is_current(Path(spec.origin)):
        return False
    if toolchain.carries_own_libstdcxx(spec.origin):
        print(
            "monet_like: ignoring monet_like._C (linked with its own copy of libstdc++, which "
            "breaks its error messages); compiling instead",
            file=sys.stderr,
        )
        return False
    try:
        importlib.import_module("monet_like._C")
    except ImportError as exc:  # built for another torch or Python: compile afresh
        print(f"monet_like: ignoring monet_like._C ({exc}); compiling instead", file=sys.stderr)
        return False
    return _ops_registered()


def _build_key(sources: list[Path], compiler: str = "") -> str:
    h = hashlib.sha256()
    for src in sources:
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    h.update("|".join([torch.__version__, *_CFLAGS, *_LDFLAGS, *_CUDA_CFLAGS]).encode())
    if compiler:  # one put in place of the requested one (toolchain.compiler_overrides)
        h.update(b"|" + compiler.encode())
    return h.hexdigest()[:16]


def _ensure_ninja_on_path() -> None:
    # cpp_extension runs `ninja` from PATH; a venv's python run by its full path
    # does not put the venv's bin (where the ninja package lives) there.
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        if scripts and Path(scripts, "ninja").exists():
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def _cuda_include_flags() -> list[str]:
    """-isystem for the headers of the nvidia-* wheels (cuDNN, cuBLAS, cuSPARSE).

    torch's CUDA headers include them, and a pip-installed torch has them there rather
    than in the CUDA toolkit; appended after the toolkit's so that its own come first.
    """
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    dirs = sorted(inc for root in roots for inc in root.glob("*/include") if inc.is_dir())
    return [flag for d in dirs for flag in ("-isystem", str(d))]


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _jit_build() -> None:
    # Its import warns "No CUDA runtime is found" on a CPU-only machine: noise here.
    cpp_log = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_log.level
    cpp_log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        cpp_log.setLevel(level)

    from monet_like.files import cache_dir

    if not _CPP.exists():
        raise UserError(
            f"monet_like: the C++ source {_CPP} is missing and monet_like._C is not built; "
            "reinstall monet_like from its source tree"
        )
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise UserError(
            f"monet_like: no C++ compiler ({compiler!r} not found on PATH) to build the "
            "monet_like operators; install g++ (or set CXX)"
        )
    _ensure_ninja_on_path()
    overrides = toolchain.compiler_overrides()
    cuda = _want_cuda()
    sources = [_CPP] + ([_CU] if cuda else [])
    build_dir = cache_dir() / "ext" / _build_key(sources, overrides.get("CXX", ""))
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{_JIT_NAME}.so").exists():
        print(
            f"monet_like: compiling the C++ operators into {build_dir} (up to a minute, once)",
            file=sys.stderr,
            flush=True,
        )
    try:
        with toolchain.environment(overrides):
            cpp_extension.load(
                name=_JIT_NAME,
                sources=[str(s) for s in sources],
                build_directory=str(build_dir),
                extra_cflags=_CFLAGS,
                extra_ldflags=_LDFLAGS,
                extra_cuda_cflags=_CUDA_CFLAGS + (_cuda_include_flags() if cuda else []),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - any build failure becomes one clear message
        raise UserError(
            f"monet_like: building the C++ operators in {build_dir} failed "
            f"({type(exc).__name__}); the compiler said:\n{_tail(str(exc))}"
        ) from exc
    if toolchain.carries_own_libstdcxx(build_dir / f"{_JIT_NAME}.so"):
        raise UserError(
            f"monet_like: the operators built in {build_dir} carry their own copy of "
            "libstdc++ (linked statically): an error raised by them would crash the process. "
            "Set CXX to a compiler that links libstdc++ dynamically"
        )


def _warn_missing_cuda() -> None:
    if _want_cuda() and not torch._C._dispatch_has_kernel_for_dispatch_key(
        f"{NAMESPACE}::relu_mask", "CUDA"
    ):
        print(
            "monet_like: the loaded operators have no CUDA kernels; rebuild with "
            "MONET_LIKE_CUDA=1 pip install -e . or set MONET_LIKE_JIT=1",
            file=sys.stderr,
        )


# --------------------------------------------------------------------------- autograd


def _pool_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    x, kernel_size, stride, padding, dilation, ceil_mode = inputs
    _, indices = output
    ctx.save_for_backward(indices)
    ctx.input_size = list(x.shape)
    ctx.params = (kernel_size, stride, padding, dilation, ceil_mode)


def _pool_backward(ctx: Any, grad_out: torch.Tensor, _grad_indices: Any) -> tuple[Any, ...]:
    (indices,) = ctx.saved_tensors
    grad = torch.ops.monet_like.max_pool2d_compact_backward(
        grad_out, indices, ctx.input_size, *ctx.params
    )
    return grad, None, None, None, None, None


# --------------------------------------------------------------------------- fake kernels
# torch.library.register_fake needs the op to exist, so they are registered by
# load(), or at import when the ops are already there (the C++ library names this
# module as their home with set_python_module, so torch imports it when needed).


def _pair(values: list[int], default: list[int] | None = None) -> tuple[int, int]:
    if not values and default is not None:
        return default[0], default[1]
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


def _pool_out_size(size: Any, k: int, pad: int, stride: int, dil: int, ceil_mode: bool) -> Any:
    out = (size + 2 * pad - dil * (k - 1) - 1 + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out = out - 1  # the last window must start inside the input or its left padding
    return out


def _pool_out_shape(
    shape: Any,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
) -> list[Any]:
    torch._check(len(shape) in (3, 4), lambda: "max_pool2d_compact: expected a 3-D or 4-D input")
    k = _pair(kernel_size)
    s = _pair(stride, list(k))
    p = _pair(padding)
    d = _pair(dilation)
    torch._check(k[0] * k[1] <= 256, lambda: "max_pool2d_compact: window over 256 positions")
    oh = _pool_out_size(shape[-2], k[0], p[0], s[0], d[0], ceil_mode)
    ow = _pool_out_size(shape[-1], k[1], p[1], s[1], d[1], ceil_mode)
    return [*shape[:-2], oh, ow]


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(t.shape)


def _relu_mask_fake(self: torch.Tensor) -> torch.Tensor:
    return self.new_empty(((self.numel() + 7) // 8,), dtype=torch.uint8)


def _relu_backward_mask_fake(grad_output: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    torch._check(mask.dtype == torch.uint8, lambda: "relu_backward_mask: mask must be uint8")
    torch._check(mask.numel() == (grad_output.numel() + 7) // 8, lambda: "mask size mismatch")
    return _contiguous_like(grad_output)


def _max_pool2d_compact_fake(
    self: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = _pool_out_shape(self.shape, kernel_size, stride, padding, dilation, ceil_mode)
    return self.new_empty(shape), self.new_empty(shape, dtype=torch.uint8)


def _max_pool2d_compact_backward_fake(
    grad_output: torch.Tensor,
    indices: torch.Tensor,
    input_size: list[Any],
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
) -> torch.Tensor:
    torch._check(indices.dtype == torch.uint8, lambda: "indices must be uint8")
    return grad_output.new_empty(input_size)


def _batch_norm_backward_from_output_fake(
    grad_output: torch.Tensor,
    output: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    save_invstd: torch.Tensor,
    output_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    channels = output.shape[1]
    param_dtype = weight.dtype if weight is not None else grad_output.dtype
    grad_input = _contiguous_like(grad_output) if output_mask[0] else None
    grad_weight = output.new_empty((channels,), dtype=param_dtype) if output_mask[1] else None
    grad_bias = output.new_empty((channels,), dtype=param_dtype) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


def _batch_norm_backward_from_input_fake(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    save_mean: torch.Tensor,
    save_invstd: torch.Tensor,
    output_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    return _batch_norm_backward_from_output_fake(
        grad_output, input, weight, None, save_invstd, output_mask
    )


def _batch_norm_backward_from_input_inplace_fake(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    save_mean: torch.Tensor,
    save_invstd: torch.Tensor,
    output_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    torch._check(bool(output_mask[0]), lambda: "output_mask[0] must be true")
    _, grad_weight, grad_bias = _batch_norm_backward_from_output_fake(
        grad_output, input, weight, None, save_invstd, [False, *output_mask[1:]]
    )
    return grad_weight, grad_bias


def _hardtanh_backward_from_output_fake(
    grad_output: torch.Tensor, output: torch.Tensor, min_val: Any, max_val: Any
) -> torch.Tensor:
    return _contiguous_like(grad_output)


def _batch_norm_inplace_fake(
    self: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The CPU kernel is aten's batch norm aimed at its own input: its statistics have
    # aten's dtypes (the input's, on CPU), which aten's own rule gives here.
    _, mean, invstd = torch.ops.aten.native_batch_norm.default(
        self, weight, bias, None, None, True, momentum, eps
    )
    return mean, invstd


def _conv2d_algo_fake(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    algo: int,
) -> torch.Tensor:
    return torch.ops.aten.convolution.default(
        input, weight, bias, stride, padding, dilation, False, [0, 0], groups
    )


def _conv2d_backward_algo_fake(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    output_mask: list[bool],
    algo_data: int,
    algo_weight: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    grad_input = _contiguous_like(input) if output_mask[0] else None
    grad_weight = _contiguous_like(weight) if output_mask[1] else None
    grad_bias = grad_output.new_empty((weight.shape[0],)) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


def _conv_setup_context(ctx, inputs, output) -> None:
    input, weight, bias, stride, padding, dilation, groups, _algo = inputs
    ctx.save_for_backward(input, weight)
    ctx.conv = (stride, padding, dilation, groups, bias is not None)


def _conv_backward(ctx, grad_output):
    input, weight = ctx.saved_tensors
    stride, padding, dilation, groups, has_bias = ctx.conv
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]]
    grads = torch.ops.monet_like.conv2d_backward_algo(
        grad_output, input, weight, stride, padding, dilation, groups, mask, -1, -1
    )
    return *grads, None, None, None, None, None


_FAKES = {
    "relu_mask": _relu_mask_fake,
    "relu_backward_mask": _relu_backward_mask_fake,
    "max_pool2d_compact": _max_pool2d_compact_fake,
    "max_pool2d_compact_backward": _max_pool2d_compact_backward_fake,
    "batch_norm_backward_from_output": _batch_norm_backward_from_output_fake,
    "batch_norm_backward_from_input": _batch_norm_backward_from_input_fake,
    "batch_norm_backward_from_input_": _batch_norm_backward_from_input_inplace_fake,
    "hardtanh_backward_from_output": _hardtanh_backward_from_output_fake,
    "batch_norm_inplace_": _batch_norm_inplace_fake,
    "conv2d_algo": _conv2d_algo_fake,
    "conv2d_backward_algo": _conv2d_backward_algo_fake,
    # conv2d_algorithms asks the device which algorithms exist: no fake kernel
}
_python_kernels_registered = False


def _register_python_kernels() -> None:
    """Fake kernels for every op and the autograd formula of max_pool2d_compact, once."""
    global _python_kernels_registered
    if _python_kernels_registered:
        return
    for name, fake in _FAKES.items():
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake)
    torch.library.register_autograd(
        f"{NAMESPACE}::max_pool2d_compact", _pool_backward, setup_context=_pool_setup_context
    )
    torch.library.register_autograd(
        f"{NAMESPACE}::conv2d_algo", _conv_backward, setup_context=_conv_setup_context
    )
    _python_kernels_registered = True


if _ops_registered():  # monet_like._C imported before this module
    _register_python_kernels()
