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
- BatchNorm backward (training, from the input): `batch_norm_backward_from_input_`
  writes the input's gradient over the incoming gradient where nothing reads that
  again; elsewhere `batch_norm_backward_from_input` allocates it. Both are our kernel,
  which needs no buffer as large as the input: aten's CPU kernel takes one beside its
  result (MobileNetV2's floor at 272 was such a backward: 1.22 GiB of it).
- ReLU and hardtanh backward: aten's out= form (`threshold_backward.grad_input`,
  `hardtanh_backward.grad_input`) with the incoming gradient as its out, where nothing
  reads that gradient again. Elementwise, so each element is read before it is
  written. A hardtanh backward that reads the output (`multiway`) runs as aten's
  hardtanh_backward of the output: the same test, since y = clamp(x).
"""

from __future__ import annotations

import torch

from monet_like.graph import Graph
from monet_like.variants import Variant, register
from monet_like.variants.sites import Uses, calls, fixed_site, getitems, merge_into, replace

aten = torch.ops.aten


def _overwritable(value, node, uses: Uses) -> bool:
    if not isinstance(value, torch.fx.Node):
        return False
    t, out = value.meta.get("val"), node.meta.get("val")
    if not isinstance(t, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    # the same strides too: an in-place op leaves its input's layout, where the op it
    # replaces may have laid its output out after another operand's (Qwen2's rotary
    # embedding: a later view of the result then no longer fits)
    return (
        t.shape == out.shape
        and t.dtype == out.dtype
        and t.stride() == out.stride()
        and (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last))
        and uses.dead_after(value, node)
    )


def _first_output_into(
    gm: torch.fx.GraphModule, new: torch.fx.Node, items: dict, into: torch.fx.Node
) -> None:
    """`new` (an in-place op that replaced a multi-output one) wrote the replaced op's
    first output over `into` and returns only the others: the first's readers read
    `into`, and the others' getitems move down by one (1, 2 to 0, 1)."""
    merge_into(gm, items.pop(0), into)
    for index, item in items.items():
        item.args = (new, index - 1)


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


def _mixed_precision(x: torch.fx.Node, *others) -> bool:
    """Whether a BatchNorm's parameters or statistics are of another dtype than its input (a
    float32 BatchNorm under autocast): aten keeps such statistics in float32, which the
    in-place kernel, writing them in the input's dtype, does not."""
    dtype = x.meta["val"].dtype
    return any(isinstance(o, torch.fx.Node) and o.meta["val"].dtype != dtype for o in others)


def _batch_norm_in_place(graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]) -> int:
    ops = torch.ops.monet_like
    uses = Uses(graph, gm)
    changed = 0
    for fwd in calls(gm, aten.native_batch_norm.default):
        x, weight, bias, mean, var, training, momentum, eps = fwd.args[:8]
        items = getitems(fwd)
        if not training or 0 not in items or not _overwritable(x, items[0], uses):
            continue
        if not uses.dead_after(x, fwd) or _mixed_precision(x, weight, bias, mean, var):
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
        _first_output_into(gm, new, items, x)  # the normalized values live in x now
        changed += 1
    return changed


def _batch_norm_backward_in_place(graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]) -> int:
    ops = torch.ops.monet_like
    changed = 0
    for bwd in calls(gm, aten.native_batch_norm_backward.default):
        grad, x, weight, _running_mean, _running_var, mean, invstd, training = bwd.args[:8]
        mask = list(bwd.args[9]) if len(bwd.args) > 9 else [True, True, True]
        if not training or mean is None or invstd is None:
            continue
        items = getitems(bwd)
        # Uses anew for each: an earlier in-place backward moved its gradient's readers.
        # The kernel walks (N, C, spatial) rows: a channels-last gradient stays apart.
        in_place = (
            0 in items
            and _overwritable(grad, items[0], Uses(graph, gm))
            and grad.meta["val"].is_contiguous()
        )
        op = ops.batch_norm_backward_from_input_ if in_place else ops.batch_norm_backward_from_input
        new = replace(gm, bwd, op.default, (grad, x, weight, mean, invstd, mask))
        if in_place:
            _first_output_into(gm, new, items, grad)  # the input's gradient lives in grad now
        sites.append(fixed_site("batch_norm_backward_in_place", new))
        changed += 1
    return changed


def _gradients_in_place(graph: Graph, gm: torch.fx.GraphModule, sites: list[dict]) -> int:
    in_place = {
        aten.threshold_backward.default: aten.threshold_backward.grad_input,
        aten.hardtanh_backward.default: aten.hardtanh_backward.grad_input,
        torch.ops.monet_like.hardtanh_backward_from_output.default: (
            aten.hardtanh_backward.grad_input
        ),
    }
    # A site the solver may turn off names its backward node: that node stays.
    choosable = {site["backward"] for site in sites if site["choosable"]}
    # One Uses for the pass: a replacement reads and writes the storages its aten op
    # read, so no other gradient's uses move, and a gradient an earlier replacement
    # returned holds no fake value until the graph is refreshed: never overwritten here.
    uses = Uses(graph, gm)
    changed = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in in_place]:
        grad = node.args[0]
        if node.name in choosable or not _overwritable(grad, node, uses):
            continue
        new = replace(gm, node, in_place[node.target], node.args[:4], {"grad_input": grad})
        sites.append(fixed_site("gradient_in_place", new))
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
register(
    Variant(
        name="batch_norm_backward_in_place",
        flag="inplace",
        replaces="native_batch_norm_backward (training, from the input): dx written over dy "
        "where dy is dead, elsewhere into a new tensor; no scratch as large as the input",
        backward_reads="as before (the input, the saved mean and inverse std)",
        extra_outputs="",
        in_place=True,
        rewrite=_batch_norm_backward_in_place,
    )
)
register(
    Variant(
        name="gradient_in_place",
        flag="inplace",
        replaces="threshold_backward, hardtanh_backward (also from the output) whose incoming "
        "gradient is dead: its out= form writing over that gradient",
        backward_reads="as before",
        extra_outputs="",
        in_place=True,
        rewrite=_gradients_in_place,
    )
)
