"""`conv`: the convolution algorithm, chosen per layer and per direction.

Every 2-D convolution (`aten.convolution`, not transposed) and its backward
(`aten.convolution_backward`) become `monet_like.conv2d_algo` and
`monet_like.conv2d_backward_algo`, whose last arguments name the algorithm of the
forward, the backward-data and the backward-weight parts. As rewritten they hold
-1, PyTorch's own choice, so the graph computes what the captured one does. The
profiler then measures every algorithm the device offers for each layer (time and
workspace, `profile.measure_algorithms`), the solver picks one per direction under
the budget (a slower algorithm with less workspace where memory is tight), and
`select` writes the picks into the graph that is replayed.

Algorithms: on CPU, -1 (oneDNN, through at::convolution) and 0 (PyTorch's im2col +
GEMM, for groups 1 without dilation); on CUDA, -1 and the cuDNN algorithms that
cuDNN reports for the layer.
"""

from __future__ import annotations

import torch

from monet_like.graph import Graph
from monet_like.variants import Variant, register
from monet_like.variants.sites import args_with_defaults, calls, pair, replace, source

aten = torch.ops.aten
DEFAULT_ALGO = -1  # PyTorch's own choice


def _conv_algorithm(graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]) -> int:
    ops = torch.ops.monet_like
    changed = 0
    for fwd in calls(gm, aten.convolution.default):
        x, w, b, stride, padding, dilation, transposed, _out_pad, groups = args_with_defaults(fwd)
        if transposed or len(x.meta["val"].shape) != 4:
            continue
        stride, padding, dilation = pair(stride), pair(padding), pair(dilation)
        geometry = (stride, padding, dilation, groups)
        # Looked up now, not before the loop: the input may be the output of a
        # convolution this loop already replaced (in MobileNetV2's full mode, BatchNorm
        # and ReLU6 run in place over it), which the backward now reads by a new name.
        matches = [
            n
            for n in calls(gm, aten.convolution_backward.default)
            if source(n.args[1]) is source(x)
            and source(n.args[2]) is source(w)
            and (pair(n.args[4]), pair(n.args[5]), pair(n.args[6]), n.args[9]) == geometry
        ]
        if len(matches) > 1:
            continue  # the same layer applied twice to the same input: leave both alone
        value = fwd.meta["val"]
        new_fwd = replace(gm, fwd, ops.conv2d_algo.default, (x, w, b, *geometry, DEFAULT_ALGO))
        # The same tensor as before: a later convolution reading it (through a BatchNorm
        # run in place, MobileNetV2) still finds its shape before the graph is refreshed.
        new_fwd.meta["val"] = value
        new_bwd = None
        if matches:
            bwd = matches[0]
            grad, x_saved, w_saved = bwd.args[:3]
            mask = list(bwd.args[10])
            new_bwd = replace(
                gm,
                bwd,
                ops.conv2d_backward_algo.default,
                (grad, x_saved, w_saved, *geometry, mask, DEFAULT_ALGO, DEFAULT_ALGO),
            )
        sites.append(algorithm_site(new_fwd, new_bwd))
        changed += 1
    return changed


def algorithm_site(fwd: torch.fx.Node, bwd: torch.fx.Node | None) -> dict:
    """A layer whose algorithms the solver picks: `forward` and `backward` name its two
    nodes (no backward: nothing is differentiated through it)."""
    return {
        "id": fwd.name,
        "variant": "conv_algorithm",
        "choosable": False,
        "algorithm": True,
        "owner": fwd.name,
        "forward": [fwd.name],
        "backward": bwd.name if bwd is not None else "",
        "original": {},
    }


register(
    Variant(
        name="conv_algorithm",
        flag="conv",
        replaces="convolution (2-D) and convolution_backward",
        backward_reads="the same as aten's (input and weight); the algorithm of each direction "
        "is the solver's choice (time against workspace)",
        extra_outputs="",
        in_place=False,
        rewrite=_conv_algorithm,
    )
)


class _ConvWithAlgorithms(torch.autograd.Function):
    """A convolution by named algorithms (forward, backward-data, backward-weight), in
    eager autograd."""

    @staticmethod
    def forward(ctx, x, weight, bias, geometry, algorithms):
        ctx.save_for_backward(x, weight)
        ctx.geometry, ctx.algorithms, ctx.has_bias = geometry, algorithms, bias is not None
        return torch.ops.monet_like.conv2d_algo(x, weight, bias, *geometry, algorithms[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias]
        _, data, weight_algo = ctx.algorithms
        grads = torch.ops.monet_like.conv2d_backward_algo(
            dy, x, weight, *ctx.geometry, mask, data, weight_algo
        )
        return *grads, None, None


def eager_with_algorithms(
    model: torch.nn.Module, graph: Graph, algorithms: dict[str, list[int]]
) -> torch.nn.Module:
    """A copy of `model` whose convolutions run the algorithms a solution chose: eager
    PyTorch doing the replay's arithmetic, to check a replay's exactness against.
    (Another algorithm sums in another order; a deep network can amplify that 1e-7 per
    op into 1e-3 and more in its gradients, when a value near a ReLU's threshold or a
    max-pool tie flips.)"""
    import copy

    from monet_like import kernels

    kernels.load()
    copied = copy.deepcopy(model)
    module_of = {n.name: n.module for n in graph.nodes}
    for site in graph.sites:
        if not site.get("algorithm"):
            continue
        # A site left to PyTorch's algorithms runs as conv2d_algo too in the replay, which
        # sums a bias's gradient apart from oneDNN's backward: so here as well.
        chosen = algorithms.get(site["id"], [DEFAULT_ALGO] * 3)
        conv = copied.get_submodule(module_of[site["forward"][0]])
        geometry = (list(conv.stride), list(conv.padding), list(conv.dilation), conv.groups)
        conv.forward = lambda x, c=conv, g=geometry, a=chosen: _ConvWithAlgorithms.apply(
            *_as_autocast_would(x, c.weight, c.bias), g, a
        )
    return copied


def _as_autocast_would(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """A convolution's operands cast as autocast casts them for aten's convolution (which it
    runs in the lower precision), since it does not know the custom op; unchanged outside
    autocast."""
    device = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device):
        return list(tensors)
    dtype = torch.get_autocast_dtype(device)
    return [t if t is None or not t.is_floating_point() else t.to(dtype) for t in tensors]
