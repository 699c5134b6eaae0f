"""The C++ operator variants (torch.ops.monet_like.*) against their aten references."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

from monet_like import kernels
from monet_like.errors import UserError

aten = torch.ops.aten
EPS = 1e-5


@pytest.fixture(scope="module")
def ops():
    kernels.load()  # the JIT build, if any, happens once here
    return torch.ops.monet_like


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that also holds for NaNs and signed zeros."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {torch.float64: torch.int64, torch.float32: torch.int32}
    view = ints.get(a.dtype, torch.int16)
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- ReLU


def relu_input(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    y = torch.relu(torch.randn(shape, generator=g))
    flat = y.view(-1)
    n = flat.numel()
    picks = torch.randint(0, n, (max(1, n // 5),), generator=g)
    flat[picks[0::4]] = float("nan")
    flat[picks[1::4]] = -0.0
    flat[picks[2::4]] = float("inf")
    flat[picks[3::4]] = float("-inf")
    return y


def packed_bits(y: torch.Tensor) -> torch.Tensor:
    bits = (~(y <= 0)).reshape(-1).to(torch.uint8)
    bits = torch.cat([bits, bits.new_zeros((-bits.numel()) % 8)]).view(-1, 8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(1).to(torch.uint8)


@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (13, 5), (2, 3, 5, 7), (4, 3, 17)])
def test_relu_mask_matches_threshold_backward(ops, shape):
    g = gen(sum(shape))
    y = relu_input(shape, g)
    grad = torch.randn(shape, generator=g)
    grad.view(-1)[::9] = float("nan")  # NaN gradients are dropped where y <= 0, kept elsewhere
    mask = ops.relu_mask(y)
    assert mask.dtype == torch.uint8 and mask.shape == ((y.numel() + 7) // 8,)
    assert torch.equal(mask, packed_bits(y))
    assert same_bits(ops.relu_backward_mask(grad, mask), aten.threshold_backward(grad, y, 0))


def test_relu_mask_follows_logical_order_of_strided_input(ops):
    g = gen(1)
    y = relu_input((6, 11), g).t()  # non-contiguous
    grad = torch.randn(11, 6, generator=g)
    out = ops.relu_backward_mask(grad, ops.relu_mask(y))
    assert out.is_contiguous()
    assert same_bits(out, aten.threshold_backward(grad, y, 0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_relu_mask_other_dtypes(ops, dtype):
    g = gen(2)
    y = relu_input((3, 37), g).to(dtype)
    grad = torch.randn(3, 37, generator=g).to(dtype)
    assert same_bits(
        ops.relu_backward_mask(grad, ops.relu_mask(y)), aten.threshold_backward(grad, y, 0)
    )


# --------------------------------------------------------------------------- max pool

POOLS = [
    # shape, kernel, stride, padding, dilation, ceil_mode
    ((2, 3, 8, 8), [2, 2], [2, 2], [0, 0], [1, 1], False),
    ((2, 3, 9, 9), [3, 3], [2, 2], [1, 1], [1, 1], False),  # overlapping windows
    ((2, 3, 9, 9), [3, 3], [2, 2], [1, 1], [1, 1], True),
    ((2, 3, 10, 10), [3, 3], [2, 2], [0, 0], [1, 1], True),  # ceil_mode adds a clipped window
    ((1, 2, 10, 7), [3, 2], [2, 1], [1, 0], [1, 1], True),
    ((2, 2, 11, 11), [3, 3], [2, 2], [1, 1], [2, 2], False),  # dilation
    ((2, 2, 12, 9), [2, 3], [3, 2], [1, 1], [2, 1], True),
    ((3, 9, 9), [3, 3], [2, 2], [1, 1], [1, 1], True),  # 3-D (C, H, W)
    ((1, 1, 20, 20), [16, 16], [4, 4], [8, 8], [1, 1], False),  # 256 positions, the limit
]


def pool_input(shape: tuple[int, ...], kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "ties":  # integer values: many equal maxima per window
        return torch.randint(-2, 3, shape, generator=g).float()
    x = torch.randn(shape, generator=g)
    if kind == "nan":
        flat = x.view(-1)
        picks = torch.randint(0, flat.numel(), (max(2, flat.numel() // 10),), generator=g)
        flat[picks[0::2]] = float("nan")
        flat[picks[1::2]] = float("-inf")
    return x


def compact_from_flat(flat, shape, kernel, stride, padding, dilation):
    """aten's flat input index -> position inside the window, kh * kW + kw."""
    height, width = shape[-2:]
    oh = torch.arange(flat.shape[-2]).view(-1, 1)
    ow = torch.arange(flat.shape[-1]).view(1, -1)
    kh = (flat // width - (oh * stride[0] - padding[0])) // dilation[0]
    kw = (flat % width - (ow * stride[1] - padding[1])) // dilation[1]
    assert kh.min() >= 0 and kw.min() >= 0
    return (kh * kernel[1] + kw).to(torch.uint8)


@pytest.mark.parametrize("kind", ["random", "ties", "nan"])
@pytest.mark.parametrize("cfg", POOLS, ids=lambda c: "x".join(map(str, c[0])) + f"k{c[1]}")
def test_max_pool_matches_aten(ops, cfg, kind):
    shape, kernel, stride, padding, dilation, ceil_mode = cfg
    g = gen(len(kind) + sum(shape))
    x = pool_input(shape, kind, g)
    args = (kernel, stride, padding, dilation, ceil_mode)
    out, idx = ops.max_pool2d_compact(x, *args)
    ref_out, ref_idx = aten.max_pool2d_with_indices(x, *args)
    assert same_bits(out, ref_out)
    assert idx.dtype == torch.uint8 and idx.shape == out.shape
    assert torch.equal(idx, compact_from_flat(ref_idx, shape, *args[:4]))

    grad = torch.randn(out.shape, generator=g)
    gx = ops.max_pool2d_compact_backward(grad, idx, list(shape), *args)
    ref_gx = aten.max_pool2d_with_indices_backward(grad, x, *args, ref_idx)
    assert same_bits(gx, ref_gx)


def test_max_pool_channels_last_input(ops):
    x = torch.randn(2, 4, 9, 9, generator=gen(3)).to(memory_format=torch.channels_last)
    args = ([3, 3], [2, 2], [1, 1], [1, 1], False)
    out, idx = ops.max_pool2d_compact(x, *args)
    ref_out, ref_idx = aten.max_pool2d_with_indices(x, *args)
    assert same_bits(out, ref_out.contiguous())
    grad = torch.randn(out.shape, generator=gen(4))
    gx = ops.max_pool2d_compact_backward(grad, idx, list(x.shape), *args)
    assert same_bits(gx, aten.max_pool2d_with_indices_backward(grad, x, *args, ref_idx))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_max_pool_other_dtypes(ops, dtype):
    x = pool_input((2, 3, 9, 9), "nan", gen(5)).to(dtype)
    args = ([3, 3], [2, 2], [1, 1], [1, 1], True)
    out, idx = ops.max_pool2d_compact(x, *args)
    ref_out, ref_idx = aten.max_pool2d_with_indices(x, *args)
    assert same_bits(out, ref_out)
    grad = torch.randn(out.shape, generator=gen(6)).to(dtype)
    gx = ops.max_pool2d_compact_backward(grad, idx, list(x.shape), *args)
    assert same_bits(gx, aten.max_pool2d_with_indices_backward(grad, x, *args, ref_idx))


def test_max_pool_refuses_windows_over_256(ops):
    with pytest.raises(RuntimeError, match="256"):
        ops.max_pool2d_compact(torch.randn(1, 1, 20, 20), [17, 16], [1, 1], [0, 0], [1, 1], False)


# --------------------------------------------------------------------------- BatchNorm


def bn_params(channels: int, g: torch.Generator, dtype=torch.float32):
    sign = torch.where(torch.rand(channels, generator=g) < 0.3, -1.0, 1.0)
    weight = (torch.rand(channels, generator=g) + 0.5) * sign
    bias = torch.randn(channels, generator=g)
    return weight.to(dtype), bias.to(dtype)


BN_SHAPES = [(4, 3, 5, 5), (16, 4), (3, 5, 7), (2, 3, 4, 5, 6)]
MASKS = [[True, True, True], [True, False, False], [False, True, True], [True, False, True]]


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "".join("1" if b else "0" for b in m))
@pytest.mark.parametrize("shape", BN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_batch_norm_backward_from_output(ops, shape, mask, affine):
    g = gen(sum(shape) + sum(mask))
    x = torch.randn(shape, generator=g) * 3 + 1
    weight, bias = bn_params(shape[1], g) if affine else (None, None)
    y, save_mean, save_invstd = aten.native_batch_norm(x, weight, bias, None, None, True, 0.1, EPS)
    dy = torch.randn(shape, generator=g)
    ref = aten.native_batch_norm_backward(
        dy, x, weight, None, None, save_mean, save_invstd, True, EPS, mask
    )
    got = ops.batch_norm_backward_from_output(dy, y, weight, bias, save_invstd, mask)
    for r, o in zip(ref, got, strict=True):
        assert (r is None) == (o is None)
        if r is not None:
            assert o.shape == r.shape and o.dtype == r.dtype
            assert rel(o, r) < 1e-5


def test_batch_norm_backward_needs_nonzero_gamma(ops):
    x = torch.randn(4, 3, 5, generator=gen(7))
    weight = torch.tensor([1.0, 0.0, 2.0])
    y, _, save_invstd = aten.native_batch_norm(x, weight, None, None, None, True, 0.1, EPS)
    with pytest.raises(RuntimeError, match="nonzero gamma"):
        ops.batch_norm_backward_from_output(
            torch.randn_like(y), y, weight, None, save_invstd, [True, True, True]
        )


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "".join("1" if b else "0" for b in m))
@pytest.mark.parametrize("shape", BN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_batch_norm_backward_from_input(ops, shape, mask, affine):
    g = gen(sum(shape) + sum(mask) + 1)
    x = torch.randn(shape, generator=g) * 3 + 1
    weight = bn_params(shape[1], g)[0] if affine else None
    _, save_mean, save_invstd = aten.native_batch_norm(x, weight, None, None, None, True, 0.1, EPS)
    dy = torch.randn(shape, generator=g)
    ref = aten.native_batch_norm_backward(
        dy, x, weight, None, None, save_mean, save_invstd, True, EPS, mask
    )
    got = ops.batch_norm_backward_from_input(dy, x, weight, save_mean, save_invstd, mask)
    for r, o in zip(ref, got, strict=True):
        assert (r is None) == (o is None)
        if r is not None:
            assert o.shape == r.shape and o.dtype == r.dtype
            assert rel(o, r) < 1e-5
    if not mask[0]:
        with pytest.raises(RuntimeError, match=r"output_mask\[0\] must be true"):
            ops.batch_norm_backward_from_input_(dy, x, weight, save_mean, save_invstd, mask)
        return
    # In place: the same arithmetic, the input's gradient written over dy.
    overwritten = dy.clone()
    params = ops.batch_norm_backward_from_input_(
        overwritten, x, weight, save_mean, save_invstd, mask
    )
    assert torch.equal(overwritten, got[0])
    for p, o in zip(params, got[1:], strict=True):
        assert (p is None) == (o is None)
        assert p is None or torch.equal(p, o)


def test_batch_norm_backward_in_place_refuses_a_strided_gradient(ops):
    x = torch.randn(4, 3, 5, 5, generator=gen(8))
    _, mean, invstd = aten.native_batch_norm(x, None, None, None, None, True, 0.1, EPS)
    dy = torch.randn(4, 5, 5, 3, generator=gen(9)).permute(0, 3, 1, 2)  # not contiguous
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.batch_norm_backward_from_input_(dy, x, None, mean, invstd, [True, True, True])


def test_batch_norm_backward_from_input_takes_no_scratch(ops):
    """aten's CPU BatchNorm backward allocates a buffer as large as its input beside its
    result; ours allocates its result and per-channel sums only."""
    from monet_like.profile import _workspace_of

    g = gen(12)
    x = torch.randn(8, 16, 24, 24, generator=g)
    weight, _ = bn_params(16, g)
    _, mean, invstd = aten.native_batch_norm(x, weight, None, None, None, True, 0.1, EPS)
    dy = torch.randn(x.shape, generator=g)
    mask = [True, True, True]
    cpu = torch.device("cpu")
    ours = _workspace_of(
        lambda: ops.batch_norm_backward_from_input(dy, x, weight, mean, invstd, mask), cpu
    )
    theirs = _workspace_of(
        lambda: aten.native_batch_norm_backward(
            dy, x, weight, None, None, mean, invstd, True, EPS, mask
        ),
        cpu,
    )
    activation = x.numel() * x.element_size()
    assert ours < 0.01 * activation
    assert ours < theirs


INPLACE_CASES = [(s, "contiguous") for s in BN_SHAPES] + [(s, "no_params") for s in BN_SHAPES]
INPLACE_CASES.append(((4, 3, 5, 5), "channels_last"))  # not contiguous: works on a copy


@pytest.mark.parametrize(
    ("shape", "layout"),
    INPLACE_CASES,
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v,
)
def test_batch_norm_inplace(ops, shape, layout):
    g = gen(sum(shape))
    x = torch.randn(shape, generator=g) * 2 - 0.5
    weight, bias = bn_params(shape[1], g) if layout != "no_params" else (None, None)
    rm, rv = torch.randn(shape[1], generator=g), torch.rand(shape[1], generator=g) + 0.5
    ref_rm, ref_rv = rm.clone(), rv.clone()
    ref_y, ref_mean, ref_invstd = aten.native_batch_norm(
        x, weight, bias, ref_rm, ref_rv, True, 0.1, EPS
    )
    work = x.clone()
    if layout == "channels_last":
        work = work.to(memory_format=torch.channels_last)
    ptr = work.data_ptr()
    mean, invstd = ops.batch_norm_inplace_(work, weight, bias, rm, rv, 0.1, EPS)
    assert work.data_ptr() == ptr  # written over its own storage
    assert rel(work, ref_y) < 1e-5
    for got, ref in ((mean, ref_mean), (invstd, ref_invstd), (rm, ref_rm), (rv, ref_rv)):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel(got, ref) < 1e-6


def test_batch_norm_inplace_without_running_stats(ops):
    x = torch.randn(8, 3, 4, 4, generator=gen(8))
    ref_y, ref_mean, ref_invstd = aten.native_batch_norm(x, None, None, None, None, True, 0.1, EPS)
    mean, invstd = ops.batch_norm_inplace_(x, None, None, None, None, 0.1, EPS)
    assert rel(x, ref_y) < 1e-5 and rel(mean, ref_mean) < 1e-6 and rel(invstd, ref_invstd) < 1e-6


# --------------------------------------------------------------------------- hardtanh


@pytest.mark.parametrize("bounds", [(-1.0, 1.0), (0.0, 6.0), (-0.3, 0.7)])
def test_hardtanh_backward_from_output(ops, bounds):
    lo, hi = bounds
    g = gen(int(hi * 10))
    x = torch.randn(3, 4, 33, generator=g) * 4
    flat = x.view(-1)
    flat[::7] = lo  # exactly on the bounds
    flat[3::7] = hi
    flat[5::31] = float("nan")
    y = aten.hardtanh(x, lo, hi)
    dy = torch.randn(x.shape, generator=g)
    assert same_bits(
        ops.hardtanh_backward_from_output(dy, y, lo, hi), aten.hardtanh_backward(dy, x, lo, hi)
    )


# --------------------------------------------------------------------------- convolution

# (input shape, weight shape, stride, padding, bias)
CONVS = [
    ((2, 8, 9, 9), (6, 8, 3, 3), [1, 1], [1, 1], False),
    ((2, 8, 9, 9), (6, 8, 1, 1), [1, 1], [0, 0], True),
    ((2, 8, 9, 9), (6, 8, 1, 1), [2, 2], [0, 0], False),
    ((2, 3, 16, 16), (4, 3, 7, 7), [2, 2], [3, 3], True),
    ((1, 4, 6, 5), (3, 4, 3, 2), [1, 2], [1, 0], True),
]


def conv_case(cfg, g: torch.Generator, dtype=torch.float32):
    x_shape, w_shape, stride, padding, has_bias = cfg
    x = torch.randn(x_shape, generator=g, dtype=dtype)
    w = torch.randn(w_shape, generator=g, dtype=dtype)
    b = torch.randn(w_shape[0], generator=g, dtype=dtype) if has_bias else None
    return x, w, b, (stride, padding, [1, 1], 1)


@pytest.mark.parametrize("cfg", CONVS)
def test_conv_algorithms_match_aten(ops, cfg):
    x, w, b, geometry = conv_case(cfg, gen(21))
    stride, padding, dilation, groups = geometry
    assert ops.conv2d_algorithms(x, w, *geometry) == [4, -1, 0, -2, -8] * 3
    ref = aten.convolution(x, w, b, stride, padding, dilation, False, [0, 0], groups)
    assert same_bits(ops.conv2d_algo(x, w, b, *geometry, -1), ref)  # PyTorch's own choice
    assert rel(ops.conv2d_algo(x, w, b, *geometry, 0), ref) < 1e-6  # im2col: another sum order
    # PyTorch's choice over batch chunks (more chunks than samples: one per sample); oneDNN
    # may pick another kernel for the smaller batch
    for chunked in (-2, -8):
        assert rel(ops.conv2d_algo(x, w, b, *geometry, chunked), ref) < 1e-6
    dy = torch.randn(ref.shape, generator=gen(22))
    bias_sizes = [w.shape[0]] if b is not None else None
    mask = [True, True, b is not None]
    want = aten.convolution_backward(
        dy, x, w, bias_sizes, stride, padding, dilation, False, [0, 0], groups, mask
    )
    for data in (-1, 0, -2, -8):
        for weight in (-1, 0, -2, -8):
            got = ops.conv2d_backward_algo(dy, x, w, *geometry, mask, data, weight)
            for k in range(3 if b is not None else 2):
                assert rel(got[k], want[k]) < 1e-6, (data, weight, k)
            if (data, weight) == (-1, -1):  # the same oneDNN kernels, one part at a time
                assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
            if b is None:
                assert got[2] is None


def test_conv_backward_parts_follow_the_mask(ops):
    x, w, _, geometry = conv_case(CONVS[0], gen(23))
    dy = torch.randn(2, 6, 9, 9, generator=gen(24))
    gi, gw, gb = ops.conv2d_backward_algo(dy, x, w, *geometry, [False, True, False], 0, 0)
    assert gi is None and gb is None and gw.shape == w.shape


def test_conv_grouped_or_dilated_offers_only_pytorchs_choice(ops):
    x = torch.randn(2, 8, 9, 9)
    depthwise = torch.randn(8, 1, 3, 3)
    assert ops.conv2d_algorithms(x, depthwise, [1, 1], [1, 1], [1, 1], 8) == [3, -1, -2, -8] * 3
    with pytest.raises(RuntimeError, match="only -1"):
        ops.conv2d_algo(x, depthwise, None, [1, 1], [1, 1], [1, 1], 8, 0)
    w = torch.randn(4, 8, 3, 3)
    assert ops.conv2d_algorithms(x, w, [1, 1], [2, 2], [2, 2], 1) == [3, -1, -2, -8] * 3
    ref = aten.convolution(x, depthwise, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 8)
    assert rel(ops.conv2d_algo(x, depthwise, None, [1, 1], [1, 1], [1, 1], 8, -2), ref) < 1e-6
    with pytest.raises(RuntimeError, match="backward-weight algorithm 3"):
        dy = torch.randn(2, 4, 9, 9)
        ops.conv2d_backward_algo(dy, x, w, [1, 1], [1, 1], [1, 1], 1, [True, True, False], 0, 3)


def test_a_channels_last_input_is_not_offered_im2col(ops):
    """slow_conv2d's backward refuses a channels-last input ("grad_weight must be
    contiguous": ConvNeXt's first step in the full mode failed so), and its forward would
    return another layout than the graph was traced with."""
    x = torch.randn(2, 8, 9, 9).contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 8, 3, 3)
    geometry = ([1, 1], [1, 1], [1, 1], 1)
    assert ops.conv2d_algorithms(x, w, *geometry) == [3, -1, -2, -8] * 3
    with pytest.raises(RuntimeError, match="contiguous input"):
        ops.conv2d_algo(x, w, None, *geometry, 0)
    assert ops.conv2d_algorithms(x.contiguous(), w, *geometry) == [4, -1, 0, -2, -8] * 3


@pytest.mark.parametrize("algo", [-1, 0, -2])
def test_gradcheck_conv_registered_autograd(ops, algo):
    x, w, b, geometry = conv_case(CONVS[3], gen(25), torch.float64)
    args = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_())
    assert torch.autograd.gradcheck(lambda *t: ops.conv2d_algo(*t, *geometry, algo), args)


# --------------------------------------------------------------------------- opcheck


def opcheck_cases(ops) -> list[tuple[str, object, tuple]]:
    g = gen(9)
    x = torch.randn(2, 3, 5, 5, generator=g)
    y = torch.relu(x)
    weight, bias = bn_params(3, g)
    bn_y, bn_mean, invstd = aten.native_batch_norm(x, weight, bias, None, None, True, 0.1, EPS)
    pool_args = ([3, 3], [2, 2], [1, 1], [1, 1], True)
    out, idx = ops.max_pool2d_compact(x, *pool_args)
    cw, cb = torch.randn(4, 3, 3, 3, generator=g), torch.randn(4, generator=g)
    geometry = ([1, 1], [1, 1], [1, 1], 1)
    return [
        ("relu_mask", ops.relu_mask, (y,)),
        ("relu_backward_mask", ops.relu_backward_mask, (torch.randn_like(x), ops.relu_mask(y))),
        ("max_pool2d_compact", ops.max_pool2d_compact, (x.clone().requires_grad_(), *pool_args)),
        (
            "max_pool2d_compact_backward",
            ops.max_pool2d_compact_backward,
            (torch.randn_like(out), idx, [2, 3, 5, 5], *pool_args),
        ),
        (
            "batch_norm_backward_from_output",
            ops.batch_norm_backward_from_output,
            (torch.randn_like(x), bn_y, weight, bias, invstd, [True, True, True]),
        ),
        (
            "batch_norm_backward_from_output_masked",
            ops.batch_norm_backward_from_output,
            (torch.randn_like(x), bn_y, None, None, invstd, [True, False, True]),
        ),
        (
            "batch_norm_backward_from_input",
            ops.batch_norm_backward_from_input,
            (torch.randn_like(x), x, weight, bn_mean, invstd, [True, True, True]),
        ),
        (
            "batch_norm_backward_from_input_masked",
            ops.batch_norm_backward_from_input,
            (torch.randn_like(x), x, None, bn_mean, invstd, [False, True, False]),
        ),
        (
            "batch_norm_backward_from_input_",
            ops.batch_norm_backward_from_input_,
            (torch.randn_like(x), x, weight, bn_mean, invstd, [True, False, True]),
        ),
        (
            "hardtanh_backward_from_output",
            ops.hardtanh_backward_from_output,
            (torch.randn_like(x), x.clamp(-1, 1), -1.0, 1.0),
        ),
        (
            "batch_norm_inplace_",
            ops.batch_norm_inplace_,
            (x.clone(), weight, bias, torch.zeros(3), torch.ones(3), 0.1, EPS),
        ),
        *[
            (
                f"conv2d_algo_{algo}",
                ops.conv2d_algo,
                (x.clone().requires_grad_(), cw.clone().requires_grad_(), cb, *geometry, algo),
            )
            for algo in (-1, 0, -2)
        ],
        *[
            (
                f"conv2d_backward_algo_{mask}_{data}",
                ops.conv2d_backward_algo,
                (torch.randn(2, 4, 5, 5, generator=g), x, cw, *geometry, mask, data, -1),
            )
            for mask in ([True, True, True], [False, True, False])
            for data in (0, -2)
        ],
    ]


def test_opcheck_every_op(ops):
    # Every default sub-test applies, the mutating batch_norm_inplace_ included
    # (functionalization handles its declared (a!) (b!) (c!) aliases).
    checked = set()
    for name, op, args in opcheck_cases(ops):
        result = opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (name, result)
        checked.add(op._qualified_op_name.split("::")[1])
    # conv2d_algorithms asks the device which algorithms it has: no tensor op to check
    assert checked >= set(kernels.OPS) - {"conv2d_algorithms"}


# --------------------------------------------------------------------------- gradcheck


class BatchNormFromOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        y, _, invstd = aten.native_batch_norm(x, weight, bias, None, None, True, 0.1, EPS)
        ctx.save_for_backward(y, weight, bias, invstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, weight, bias, invstd = ctx.saved_tensors
        return torch.ops.monet_like.batch_norm_backward_from_output(
            dy, y, weight, bias, invstd, list(ctx.needs_input_grad)
        )


class BatchNormFromInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        y, mean, invstd = aten.native_batch_norm(x, weight, bias, None, None, True, 0.1, EPS)
        ctx.save_for_backward(x, weight, mean, invstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        dy = dy.clone()  # the in-place form writes the input's gradient over it
        grad_weight, grad_bias = torch.ops.monet_like.batch_norm_backward_from_input_(
            dy, x, weight, mean, invstd, [True, *ctx.needs_input_grad[1:]]
        )
        return dy, grad_weight, grad_bias


class ReluMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.relu(x)
        ctx.save_for_backward(torch.ops.monet_like.relu_mask(y))
        return y

    @staticmethod
    def backward(ctx, dy):
        (mask,) = ctx.saved_tensors
        return torch.ops.monet_like.relu_backward_mask(dy, mask)


POOL_ARGS = ([3, 3], [2, 2], [1, 1], [1, 1], True)


class MaxPoolCompact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out, idx = torch.ops.monet_like.max_pool2d_compact(x, *POOL_ARGS)
        ctx.save_for_backward(idx)
        ctx.input_size = list(x.shape)
        return out

    @staticmethod
    def backward(ctx, dy):
        (idx,) = ctx.saved_tensors
        return torch.ops.monet_like.max_pool2d_compact_backward(dy, idx, ctx.input_size, *POOL_ARGS)


class HardtanhFromOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.nn.functional.hardtanh(x, -1.0, 1.0)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return torch.ops.monet_like.hardtanh_backward_from_output(dy, y, -1.0, 1.0)


def away_from(x: torch.Tensor, points: list[float], gap: float = 0.05) -> torch.Tensor:
    """Move values off the kinks, where finite differences disagree with any gradient."""
    for p in points:
        near = (x - p).abs() < gap
        x = torch.where(near, x + 2 * gap, x)
    return x


def no_ties(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    n = torch.Size(shape).numel()
    return (torch.randperm(n, generator=g).double() / n).view(shape)


def test_gradcheck_variants_as_backward_of_their_reference(ops):
    g = gen(10)
    x = torch.randn(4, 3, 3, 2, generator=g, dtype=torch.float64)
    weight, bias = bn_params(3, g, torch.float64)
    bn_inputs = tuple(t.clone().requires_grad_() for t in (x, weight, bias))
    assert torch.autograd.gradcheck(BatchNormFromOutput.apply, bn_inputs)
    assert torch.autograd.gradcheck(BatchNormFromInput.apply, bn_inputs)

    xr = away_from(torch.randn(3, 5, 7, generator=g, dtype=torch.float64), [0.0])
    assert torch.autograd.gradcheck(ReluMask.apply, (xr.requires_grad_(),))

    xp = no_ties((2, 2, 7, 7), g).requires_grad_()
    assert torch.autograd.gradcheck(MaxPoolCompact.apply, (xp,))

    xh = away_from(torch.randn(3, 5, 7, generator=g, dtype=torch.float64) * 2, [-1.0, 1.0])
    assert torch.autograd.gradcheck(HardtanhFromOutput.apply, (xh.requires_grad_(),))


def test_gradcheck_max_pool_registered_autograd(ops):
    x = no_ties((2, 2, 9, 8), gen(11)).requires_grad_()
    for args in (POOL_ARGS, ([2, 2], [2, 2], [0, 0], [1, 1], False)):
        assert torch.autograd.gradcheck(lambda t, a=args: ops.max_pool2d_compact(t, *a)[0], (x,))


# --------------------------------------------------------------------------- fake kernels


def test_fake_kernels_match_real_outputs(ops):
    for name, op, args in opcheck_cases(ops):
        real_args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
        real = op(*real_args)
        mode = FakeTensorMode()
        fake_args = tuple(
            mode.from_tensor(a.detach()) if isinstance(a, torch.Tensor) else a for a in args
        )
        with mode:
            fake = op(*fake_args)
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        assert len(real) == len(fake), name
        for r, f in zip(real, fake, strict=True):
            assert (r is None) == (f is None), name
            if r is not None:
                assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride()), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fake_batch_norm_inplace_stats_dtype(ops, dtype):
    x = torch.randn(4, 3, 2, 2).to(dtype)
    mean, _ = ops.batch_norm_inplace_(x.clone(), None, None, None, None, 0.1, EPS)
    with FakeTensorMode() as mode:
        fake_mean, _ = ops.batch_norm_inplace_(
            mode.from_tensor(x), None, None, None, None, 0.1, EPS
        )
    assert fake_mean.dtype == mean.dtype and fake_mean.shape == mean.shape == (3,)


# --------------------------------------------------------------------------- loader


def test_second_load_is_instant_and_ops_work(ops, monkeypatch):
    def no_second_build(*_):  # a second load finds the ops loaded: nothing built or read
        raise AssertionError("a second load() built or loaded the ops again")

    monkeypatch.setattr(kernels, "_load_extension", no_second_build)
    monkeypatch.setattr(kernels, "_jit_build", no_second_build)
    monkeypatch.setattr(kernels, "_ops_registered", no_second_build)
    kernels.load()
    assert kernels.available()
    assert kernels.origin() in ("extension", "jit", "preloaded")
    assert all(hasattr(ops, name) for name in kernels.OPS)
    # Smoke: a tiny ReLU + pool step, forward and backward, through the variants.
    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    pooled, _ = ops.max_pool2d_compact(torch.relu(x), [2, 2], [2, 2], [0, 0], [1, 1], False)
    pooled.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert int((x.grad != 0).sum()) <= 18


def test_import_builds_nothing(tmp_path):
    env = {**os.environ, "MONET_LIKE_CACHE": str(tmp_path)}
    code = "import sys, monet_like.kernels; assert 'monet_like._C' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert not (tmp_path / "ext").exists()


def test_missing_compiler_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(UserError, match="compiler"):
        kernels._jit_build()


def test_failed_build_is_a_user_error_with_the_compiler_output(monkeypatch, tmp_path):
    broken = tmp_path / "ops.cpp"
    broken.write_text("this is not C++ (monet_like test)\n")
    monkeypatch.setattr(kernels, "_CPP", broken)
    monkeypatch.setattr(kernels, "_want_cuda", lambda: False)
    monkeypatch.setenv("MONET_LIKE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match="failed") as err:
        kernels._jit_build()
    assert "ops.cpp" in str(err.value) and "error" in str(err.value)


def test_a_prebuilt_extension_older_than_its_source_is_not_used(monkeypatch, tmp_path):
    built, source = tmp_path / "_C.so", tmp_path / "ops.cpp"
    built.write_bytes(b"")
    source.write_text("// newer\n")
    os.utime(built, (1_000_000, 1_000_000))
    monkeypatch.setattr(kernels, "_CPP", source)
    assert not kernels._extension_is_current(built)
    os.utime(source, (900_000, 900_000))
    assert kernels._extension_is_current(built)
