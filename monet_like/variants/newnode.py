"""`newnode`: compact intermediates, so that a backward op keeps bits instead of a tensor.

- ReLU: the forward also packs the sign of its output into 1 bit per element
  (`relu_mask`); the backward (`threshold_backward(dy, y, 0)`) becomes
  `relu_backward_mask(dy, mask)`, so `y` need not live until then.
- Max-pool: `max_pool2d_with_indices` keeps int64 indices and its backward reads the
  pool's input too; `max_pool2d_compact` keeps the argmax's position inside its window
  in one byte, and its backward reads that byte only.
"""

from __future__ import annotations

import torch

from monet_like.graph import Graph
from monet_like.variants import Variant, register
from monet_like.variants.sites import (
    Uses,
    args_with_defaults,
    bwd_original,
    calls,
    fixed_site,
    getitems,
    insert_after,
    make_site,
    pair,
    replace,
    source,
)

aten = torch.ops.aten


def _relu_mask(graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]) -> int:
    ops = torch.ops.monet_like
    uses = Uses(graph, gm)
    changed = 0
    # Also the out= form `inplace` writes over the incoming gradient (its pass runs
    # first): the mask's backward takes its place, out of place.
    for bwd in calls(gm, aten.threshold_backward.default) + calls(
        gm, aten.threshold_backward.grad_input
    ):
        grad, y, threshold = bwd.args[:3]
        if threshold != 0 or not isinstance(y, torch.fx.Node):
            continue
        # The backward reads y through an alias that autograd's unpacking adds in the
        # backward pass: the mask is taken from the forward ReLU's own output.
        producer = source(y)
        if (
            producer.op != "call_function"
            or producer.target not in (aten.relu.default, aten.relu_.default)
            or uses.in_backward(producer)
        ):
            continue
        site, original = bwd.name, bwd_original(bwd, {1: producer})
        original["target"] = str(aten.threshold_backward.default)  # not the out= form
        sites[:] = [s for s in sites if s["id"] != bwd.name]  # no longer in place
        mask = insert_after(gm, producer, ops.relu_mask.default, (producer,), like=producer)
        new = replace(gm, bwd, ops.relu_backward_mask.default, (grad, mask))
        sites.append(make_site(site, "relu_mask", producer, [mask], new, original))
        changed += 1
    return changed


def _max_pool_compact(graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]) -> int:
    ops = torch.ops.monet_like
    changed = 0
    for fwd in calls(gm, aten.max_pool2d_with_indices.default):
        x, kernel, stride, padding, dilation, ceil_mode = args_with_defaults(fwd)
        kernel = pair(kernel)
        stride = pair(stride or kernel)
        padding, dilation = pair(padding), pair(dilation)
        items = getitems(fwd)
        indices = items.get(1)
        shape = x.meta["val"].shape
        if indices is None or len(shape) != 4 or kernel[0] * kernel[1] > 256:
            continue
        backward = list(indices.users)
        if not all(u.target == aten.max_pool2d_with_indices_backward.default for u in backward):
            continue  # the indices go somewhere else (return_indices=True): keep them
        sites.append(fixed_site("max_pool2d_compact", fwd))
        pool = replace(
            gm,
            fwd,
            ops.max_pool2d_compact.default,
            (x, kernel, stride, padding, dilation, bool(ceil_mode)),
        )
        for bwd in backward:
            grad = bwd.args[0]
            replace(
                gm,
                bwd,
                ops.max_pool2d_compact_backward.default,
                (grad, items[1], list(shape), kernel, stride, padding, dilation, bool(ceil_mode)),
            )
        assert pool.users
        changed += 1
    return changed


register(
    Variant(
        name="relu_mask",
        flag="newnode",
        replaces="relu / relu_ with threshold_backward(dy, y, 0)",
        backward_reads="a 1-bit sign mask of y (numel/8 bytes)",
        extra_outputs="relu_mask(y): uint8[ceil(numel/8)]",
        in_place=False,
        rewrite=_relu_mask,
    )
)
register(
    Variant(
        name="max_pool2d_compact",
        flag="newnode",
        replaces="max_pool2d_with_indices and its backward",
        backward_reads="the argmax's position in its window, 1 byte per output (not the input, "
        "not int64 indices)",
        extra_outputs="",
        in_place=False,
        rewrite=_max_pool_compact,
    )
)
