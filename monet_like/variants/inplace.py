"""`inplace`: run an op over its input's storage when nothing reads that input again.

"Nothing" is checked on storages over the whole step, backward included: an input
that a backward op reads, that a view still looks at, or that the model returns
is never overwritten.

- ReLU, hardtanh, add: the aten in-place form (`relu_`, `hardtanh_`, `add_`). ReLU's
  backward reads the output, so it never blocks; hardtanh's reads the input unless
  `multiway` made it read the output.
- BatchNorm (training): `batch_norm_inplace_` normalizes over its input's storage.
  Its backward must not read the input, so this follows `multiway`'s output-activated
  backward.
"""

from __future__ import annotations

import torch

from monet_like.graph import Graph
from monet_like.variants import Variant, register
from monet_like.variants.sites import Uses, calls, fixed_site, getitems, replace

aten = torch.ops.aten


def _overwritable(value, node, uses: Uses) -> bool:
    if not isinstance(value, torch.fx.Node):
        return False
    t, out = value.meta.get("val"), node.meta.get("val")
    if not isinstance(t, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    return (
        t.shape == out.shape
        and t.dtype == out.dtype
        and (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last))
        and uses.dead_after(value, node)
    )


def _activations_in_place(graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]) -> int:
    uses = Uses(graph, gm)
    changed = 0
    for target, in_place in (
        (aten.relu.default, aten.relu_.default),
        (aten.hardtanh.default, aten.hardtanh_.default),
    ):
        for node in calls(gm, target):
            if uses.in_backward(node) or not _overwritable(node.args[0], node, uses):
                continue
            node.target = in_place
            sites.append(fixed_site("activation_in_place", node))
            changed += 1
    return changed


def _add_in_place(graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]) -> int:
    uses = Uses(graph, gm)
    changed = 0
    for node in calls(gm, aten.add.Tensor):
        if uses.in_backward(node):
            continue
        a, b = node.args[:2]
        alpha = node.kwargs.get("alpha", 1)
        if _overwritable(a, node, uses):
            node.target = aten.add_.Tensor
        elif alpha == 1 and _overwritable(b, node, uses):
            node.target, node.args = aten.add_.Tensor, (b, a, *node.args[2:])
        else:
            continue
        sites.append(fixed_site("add_in_place", node))
        changed += 1
    return changed


def _batch_norm_in_place(graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]) -> int:
    ops = torch.ops.monet_like
    uses = Uses(graph, gm)
    changed = 0
    for fwd in calls(gm, aten.native_batch_norm.default):
        x, weight, bias, mean, var, training, momentum, eps = fwd.args[:8]
        items = getitems(fwd)
        if not training or 0 not in items or not _overwritable(x, items[0], uses):
            continue
        if not uses.dead_after(x, fwd):
            continue
        for site in sites:  # its backward must read the output now: no longer a choice
            if site["owner"] == fwd.name:
                site["choosable"] = False
        sites.append(fixed_site("batch_norm_in_place", fwd))
        new = replace(
            gm,
            fwd,
            ops.batch_norm_inplace_.default,
            (x, weight, bias, mean, var, float(momentum), float(eps)),
        )
        y = items.pop(0)
        y.replace_all_uses_with(x)  # the normalized values now live in x's storage
        gm.graph.erase_node(y)
        for index, item in items.items():  # (mean, invstd) move from 1, 2 to 0, 1
            item.args = (new, index - 1)
        changed += 1
    return changed


register(
    Variant(
        name="activation_in_place",
        flag="inplace",
        replaces="relu, hardtanh whose input is dead",
        backward_reads="as before (ReLU: its output)",
        extra_outputs="",
        in_place=True,
        rewrite=_activations_in_place,
    )
)
register(
    Variant(
        name="add_in_place",
        flag="inplace",
        replaces="add(a, b) where a (or b) is dead",
        backward_reads="nothing",
        extra_outputs="",
        in_place=True,
        rewrite=_add_in_place,
    )
)
register(
    Variant(
        name="batch_norm_in_place",
        flag="inplace",
        replaces="native_batch_norm (training) whose input is dead (needs multiway's "
        "output-activated backward)",
        backward_reads="the output (in the input's storage)",
        extra_outputs="",
        in_place=True,
        rewrite=_batch_norm_in_place,
    )
)
