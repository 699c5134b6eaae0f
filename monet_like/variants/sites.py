"""What the rewrites ask of a graph: which storage each fx value lives in, who touches a
storage and when, and whether a value can be overwritten or freed early.

Everything is read off the fake values (`meta["val"]`) the capture left on each fx
node, so two views of one storage are recognised as one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from monet_like.graph import BACKWARD, Graph, written_args


def _storage_key(t: torch.Tensor) -> int:
    """Which storage `t` lives in: its address, unique while the graph being rewritten
    holds it (the rewritten copy's values are that graph's, or run from them). `Uses` is
    built anew after each change: a weak reference, looked up in a weak dictionary,
    took five times as long."""
    return t.untyped_storage()._cdata


def _keys(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [_storage_key(value)]
    if value is None:
        return []
    if type(value) in (tuple, list):  # most multi-output ops; cheaper than a pytree walk
        return [k for v in value for k in _keys(v)]
    return [_storage_key(t) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class Uses:
    """Storage-level uses of one GraphModule, in execution order."""

    def __init__(self, graph: Graph, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.position: dict[str, int] = {}
        self.touches: dict[int, list[int]] = {}
        self.placeholder_keys: set[int] = set()
        phase = {op.name: op.phase for op in graph.ops}
        self.backward: set[str] = set()
        keys: dict[torch.fx.Node, list[int]] = {}  # each node's, once
        for i, n in enumerate(gm.graph.nodes):
            self.position[n.name] = i
            keys[n] = _keys(n.meta.get("val"))
            if n.op == "placeholder":
                self.placeholder_keys.update(keys[n])
                continue
            touched = {k for a in n.all_input_nodes for k in keys[a]}
            if n.op != "output":
                parent = n.args[0].name if is_getitem(n) else n.name
                if phase.get(parent) == BACKWARD:
                    self.backward.add(n.name)
                touched.update(keys[n])
            for k in touched:
                self.touches.setdefault(k, []).append(i)

    def key(self, node: torch.fx.Node) -> int:
        keys = _keys(node.meta.get("val"))
        if len(keys) != 1:
            raise ValueError(f"{node.name} does not hold exactly one tensor")
        return keys[0]

    def dead_after(self, value: torch.fx.Node, user: torch.fx.Node) -> bool:
        """Nothing but `user` touches `value`'s storage from `user` on (no later reader,
        writer or view, in either pass), and it is an activation: `user` may write
        over it."""
        k = self.key(value)
        if k in self.placeholder_keys:
            return False
        at = self.position[user.name]
        return all(i <= at for i in self.touches.get(k, []))

    def written_later(self, value: torch.fx.Node, after: torch.fx.Node) -> bool:
        """Some op after `after` writes `value`'s storage in place."""
        k = self.key(value)
        at = self.position[after.name]
        return any(
            k in _keys(v.meta.get("val"))
            for n in self.gm.graph.nodes
            if self.position.get(n.name, -1) > at and n.op == "call_function"
            for v in written_args(n)
        )

    def in_backward(self, node: torch.fx.Node) -> bool:
        return node.name in self.backward


def is_getitem(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "getitem"


def getitems(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """Index -> getitem node, for an op with several outputs."""
    return {u.args[1]: u for u in node.users if is_getitem(u)}


def calls(gm: torch.fx.GraphModule, target: Any) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def source(node: torch.fx.Node) -> torch.fx.Node:
    """Follow view ops (alias, view, ...) back to the op that produced the storage."""
    seen = node
    while _is_view(seen) and seen.args and isinstance(seen.args[0], torch.fx.Node):
        seen = seen.args[0]
    return seen


def pair(values) -> list[int]:
    """A 2-D op's int[2] argument as two values (aten accepts one for both)."""
    values = list(values)
    return values * 2 if len(values) == 1 else values


def args_with_defaults(node: torch.fx.Node) -> list[Any]:
    """The node's positional arguments, completed with its schema's defaults."""
    schema = node.target._schema
    out = list(node.args)
    for arg in schema.arguments[len(out) :]:
        if arg.name in node.kwargs:
            out.append(node.kwargs[arg.name])
        elif arg.has_default_value():
            out.append(arg.default_value)
        else:
            raise ValueError(f"{node.name}: no value for {arg.name}")
    return out


def replace(
    gm: torch.fx.GraphModule, old: torch.fx.Node, target: Any, args: tuple, kwargs=None
) -> torch.fx.Node:
    """Insert `target(*args)` where `old` is, hand it `old`'s users, erase `old`. The new
    node keeps `old`'s meta (seq_nr, module path): the backward attribution holds."""
    with gm.graph.inserting_before(old):
        new = gm.graph.call_function(target, args, kwargs or {})
    new.meta = {k: v for k, v in old.meta.items() if k != "val"}
    new.meta["replaces"] = [*old.meta.get("replaces", []), old.name]  # see apply()
    old.replace_all_uses_with(new)
    inputs = old.all_input_nodes
    gm.graph.erase_node(old)
    for value in inputs:  # the alias through which autograd handed over a saved value
        if not value.users and _is_view(value):
            gm.graph.erase_node(value)
    return new


def merge_into(gm: torch.fx.GraphModule, old: torch.fx.Node, new: torch.fx.Node) -> None:
    """`old`'s value now lives in `new` (an op wrote it there in place): hand `old`'s
    users to `new`, erase `old`, and record the rename for the sites' originals. Kept
    apart from "replaces", whose first name is the captured op a node runs in place of
    (`profile._same_work`): `new` still runs its own op."""
    old.replace_all_uses_with(new)
    new.meta["merged"] = [*new.meta.get("merged", []), old.name]  # see apply()
    gm.graph.erase_node(old)


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return (
        node.op == "call_function"
        and schema is not None
        and not schema.is_mutable
        and bool(schema.returns)
        and schema.returns[0].alias_info is not None
    )


def insert_after(
    gm: torch.fx.GraphModule, anchor: torch.fx.Node, target: Any, args: tuple, like: torch.fx.Node
) -> torch.fx.Node:
    """Insert `target(*args)` right after `anchor`, with `like`'s meta (its forward seq_nr)."""
    with gm.graph.inserting_after(anchor):
        new = gm.graph.call_function(target, args, {})
    new.meta = {k: v for k, v in like.meta.items() if k != "val"}
    return new


def encode(value: Any) -> Any:
    """An fx argument as plain data: ["node", name] or ["value", constant]."""
    if isinstance(value, torch.fx.Node):
        return ["node", value.name]
    if isinstance(value, (list, tuple)):
        return ["list", [encode(v) for v in value]]
    return ["value", value]


def decode(value: Any, nodes: dict[str, torch.fx.Node]) -> Any:
    kind, payload = value
    if kind == "node":
        return nodes[payload]
    if kind == "list":
        return [decode(v, nodes) for v in payload]
    return payload


def encoded_names(value: Any) -> list[str]:
    """The node names inside an encoded argument (or a list of them)."""
    if value and value[0] == "node":
        return [value[1]]
    if value and value[0] == "list":
        return [name for v in value[1] for name in encoded_names(v)]
    return []


def bwd_original(bwd: torch.fx.Node, substitute: dict[int, torch.fx.Node]) -> dict:
    """The replaced backward op, to run instead when the solver turns its variant off;
    `substitute` names forward values to read in place of autograd's aliases."""
    args = [substitute.get(i, a) for i, a in enumerate(bwd.args)]
    return {"target": str(bwd.target), "args": [encode(a) for a in args]}


def make_site(
    site: str,
    variant: str,
    owner: torch.fx.Node,
    forward: list[torch.fx.Node],
    backward: torch.fx.Node,
    original: dict,
) -> dict:
    """One place a variant was rewritten in: `site` is the replaced backward op's name,
    `owner` the forward node whose backward it is, `forward` the nodes the variant adds
    to the forward pass, `backward` its own backward node."""
    return {
        "id": site,
        "variant": variant,
        "choosable": True,
        "owner": owner.name,
        "forward": [n.name for n in forward],
        "backward": backward.name,
        "original": original,
    }


def fixed_site(variant: str, node: torch.fx.Node) -> dict:
    """A place a variant always runs once rewritten in (its forward op changed too)."""
    return {
        "id": node.name,
        "variant": variant,
        "choosable": False,
        "owner": node.name,
        "forward": [],
        "backward": "",
        "original": {},
    }


def rename(value: Any, names: dict[str, str]) -> Any:
    """An encoded argument with node names mapped through `names`."""
    kind, payload = value
    if kind == "node":
        return ["node", names.get(payload, payload)]
    if kind == "list":
        return ["list", [rename(v, names) for v in payload]]
    return value
