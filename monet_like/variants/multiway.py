"""`multiway`: output-activated backward, so that an op's input need not be kept.

- BatchNorm (training): the backward reconstructs the normalized input from the
  output, xhat = (y - beta) / gamma, with the saved inverse std
  (`batch_norm_backward_from_output`). Valid only where `y` survives to the backward
  pass: not where a later op overwrites it (an in-place ReLU or residual add right
  after it). gamma = 0 would make xhat unrecoverable: the kernel refuses it and the
  replay checks gamma before every step (see `monet_like.schedule`).
- Hardtanh / ReLU6: `hardtanh_backward(dy, x, lo, hi)` reads the input;
  `hardtanh_backward_from_output(dy, y, lo, hi)` reads the output (the same test,
  since y = clamp(x)). ReLU's own backward already reads its output. An in-place
  ReLU6 (`hardtanh_`, MobileNetV2's) is captured as autograd runs it: a clone of its
  input taken first, for the backward to read, a whole activation kept per layer.
  Read from the output instead, the clone is gone (a site always taken: the aten
  backward it replaces needs the clone).
"""

from __future__ import annotations

import torch

from monet_like.graph import Graph
from monet_like.variants import Variant, register
from monet_like.variants.sites import (
    Uses,
    bwd_original,
    calls,
    fixed_site,
    getitems,
    make_site,
    replace,
    source,
)

aten = torch.ops.aten


GAMMA_MIN = 1e-8  # the smallest |gamma| batch_norm_backward_from_output accepts


def divided_by_gamma(gm: torch.fx.GraphModule) -> set[str]:
    """The placeholders (fx names) that an output-activated BatchNorm backward of `gm`
    divides by: such a backward cannot run while one has an element near zero."""
    return {
        source(node.args[2]).name
        for node in gm.graph.nodes
        # by name: a graph without variants may run where the ops were never loaded
        if str(node.target) == "monet_like.batch_norm_backward_from_output.default"
        and isinstance(node.args[2], torch.fx.Node)
    }


def _batch_norm_from_output(graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]) -> int:
    ops = torch.ops.monet_like
    uses = Uses(graph, gm)
    changed = 0
    for fwd in calls(gm, aten.native_batch_norm.default):
        x, weight, bias, _mean, _var, training = fwd.args[:6]
        items = getitems(fwd)
        if not training or 0 not in items or 2 not in items or fwd.name in graph.plain_batch_norms:
            continue
        y, invstd = items[0], items[2]
        if uses.written_later(y, fwd):
            continue  # overwritten (relu_, add_): the output is gone by the backward pass
        backward = [
            u
            for item in (items.get(1), invstd)
            if item is not None
            for u in item.users
            if u.target == aten.native_batch_norm_backward.default
        ]
        for bwd in dict.fromkeys(backward):
            grad, bx, bweight = bwd.args[:3]
            if bx is not x and source(bx) is not source(x):
                continue
            mask = list(bwd.args[9]) if len(bwd.args) > 9 else [True, True, True]
            original = bwd_original(bwd, {1: source(bx)})
            site = bwd.name
            new = replace(
                gm,
                bwd,
                ops.batch_norm_backward_from_output.default,
                (grad, y, bweight, bias, invstd, mask),
            )
            sites.append(make_site(site, "batch_norm_from_output", fwd, [], new, original))
            changed += 1
    return changed


def _hardtanh_from_output(graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]) -> int:
    ops = torch.ops.monet_like
    uses = Uses(graph, gm)
    changed = 0
    for fwd in calls(gm, aten.hardtanh.default):  # out of place: input and output differ
        if uses.written_later(fwd, fwd):
            continue
        for bwd in calls(gm, aten.hardtanh_backward.default):
            grad, x, low, high = bwd.args[:4]
            if source(x) is not source(fwd.args[0]):
                continue
            original = bwd_original(bwd, {1: source(x)})
            site = bwd.name
            new = replace(
                gm, bwd, ops.hardtanh_backward_from_output.default, (grad, fwd, low, high)
            )
            sites.append(make_site(site, "hardtanh_from_output", fwd, [], new, original))
            changed += 1
    return changed


def _hardtanh_in_place_from_output(
    graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]
) -> int:
    ops = torch.ops.monet_like
    uses = Uses(graph, gm)
    changed = 0
    for fwd in calls(gm, aten.hardtanh_.default):
        if uses.written_later(fwd, fwd):
            continue  # the output is overwritten before the backward pass
        clones = [c for c in fwd.args[0].users if c.target == aten.clone.default]
        for clone in clones:
            readers = [u for u in clone.users if u.target == aten.hardtanh_backward.default]
            if len(readers) != len(clone.users):
                continue  # the clone is read elsewhere too: it stays
            for bwd in readers:
                grad, _x, low, high = bwd.args[:4]
                replace(gm, bwd, ops.hardtanh_backward_from_output.default, (grad, fwd, low, high))
            gm.graph.erase_node(clone)
            sites.append(fixed_site("hardtanh_in_place_from_output", fwd))
            changed += 1
    return changed


register(
    Variant(
        name="batch_norm_from_output",
        flag="multiway",
        replaces="native_batch_norm_backward (training)",
        backward_reads="the output y, gamma, beta and the saved inverse std (not the input)",
        extra_outputs="",
        in_place=False,
        rewrite=_batch_norm_from_output,
    )
)
register(
    Variant(
        name="hardtanh_from_output",
        flag="multiway",
        replaces="hardtanh (ReLU6) with hardtanh_backward(dy, x, lo, hi)",
        backward_reads="the output y (not the input)",
        extra_outputs="",
        in_place=False,
        rewrite=_hardtanh_from_output,
    )
)
register(
    Variant(
        name="hardtanh_in_place_from_output",
        flag="multiway",
        replaces="hardtanh_ (in-place ReLU6) whose backward reads a clone of its input",
        backward_reads="the output y (the clone is no longer taken)",
        extra_outputs="",
        in_place=False,
        rewrite=_hardtanh_in_place_from_output,
    )
)
