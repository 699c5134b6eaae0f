"""Operator variants: memory-lean implementations of aten ops, rewritten into the graph.

A variant replaces an aten pattern of the captured joint graph with ops of
`torch.ops.monet_like` (C++/CUDA kernels in csrc/, see `monet_like.kernels`) that
need fewer or smaller values in the backward pass, or that write over an input
that is dead. Each one is described by a `Variant` in `REGISTRY`: the mode flag
that enables it, the aten pattern it replaces, what its backward reads (its
"path"), its extra forward outputs, and whether it works in place.

    graph = capture(model, shape, batch)
    graph = apply(graph, ("multiway", "newnode"))   # a new Graph; `graph` is unchanged

A mode's variants are applied wherever they are valid (each site is checked on
the graph: an input that is read later is never overwritten, an output that is
overwritten is never read back; output-activated BatchNorm is not rewritten into the
BatchNorms named by `plain_batch_norms`), and each site is recorded in `graph.sites`. The
solver then chooses checkpoints on the rewritten graph and, per `choosable` site,
whether the variant or the aten op it replaced runs (`select` turns sites back);
see docs/variants.md. An op the registry knows nothing about is left as PyTorch
runs it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

try:  # generates a module's Python code only when it is called (torch's own, private)
    from torch.fx._lazy_graph_module import _LazyGraphModule as _CopiedModule
except ImportError:
    _CopiedModule = torch.fx.GraphModule

from monet_like.errors import UserError
from monet_like.graph import Graph, derive, fake_like
from monet_like.variants.sites import decode, rename

MODE_FLAGS = ("inplace", "conv", "multiway", "newnode", "normal")
# Order of application: output-activated backward first (it frees inputs that an
# in-place pass may then overwrite), then compact intermediates; the convolution
# algorithm last (it changes no value, only which kernel computes it).
PASS_ORDER = ("multiway", "inplace", "newnode", "conv")


@dataclass(frozen=True)
class Variant:
    name: str
    flag: str  # the mode flag that enables it
    replaces: str  # the aten pattern
    backward_reads: str  # its "path": the values its backward needs
    extra_outputs: str  # forward outputs it adds ("" for none)
    in_place: bool
    # Rewrites every valid site of the module, appends a description of each to the
    # list (see sites.make_site), returns how many.
    rewrite: Callable[[Graph, torch.fx.GraphModule, list[dict]], int]


def parse_mode(mode: str) -> tuple[str, ...]:
    """MONeT's mode strings: flags joined by '_' (inplace_conv_multiway_newnode, normal...).
    Returns the variant flags (without 'normal'); refuses unknown ones."""
    flags = tuple(f for f in mode.lower().split("_") if f)
    unknown = [f for f in flags if f not in MODE_FLAGS]
    if not flags or unknown:
        raise UserError(
            f"unknown mode {mode!r}: flags are {', '.join(MODE_FLAGS)} joined by '_' "
            "(e.g. normal, inplace_multiway_newnode)"
        )
    return tuple(f for f in PASS_ORDER if f in flags)


def refresh(graph: Graph, gm: torch.fx.GraphModule, variants: tuple[str, ...]) -> Graph:
    """The Graph of a rewritten GraphModule (`gm`, rewritten from `graph.fx`): fake values
    propagated again where the rewrite changed them (aliasing included), then storages,
    ops and nodes derived as at capture."""
    gm.graph.lint()
    gm.recompile()
    if _propagate_changed(graph.fx, gm) is None:
        _propagate_all(gm)
    return derive(
        gm,
        graph.placeholders,
        graph.out_spec,
        graph.diff_outputs,
        variants=variants,
        model=graph.model,
        batch=graph.batch,
        input_shape=graph.input_shape,
        dtype=graph.dtype,
        device=graph.device,
        input_grad=graph.input_grad,
        outputs_held=graph.outputs_held,
        autocast=graph.autocast,
        plain_batch_norms=graph.plain_batch_norms,
    )


def _propagate_all(gm: torch.fx.GraphModule) -> None:
    """Fake values through every node of `gm`, from new placeholders."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    metas = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    with mode:
        values = [fake_like(m, m.dtype, m.device) for m in metas]
    with torch.no_grad():
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*values)


# In-place ops that change a tensor's shape, strides or storage: run on a value that the
# source graph shares, they would change that graph's values too.
_RESHAPING_IN_PLACE = {
    "resize_", "resize_as_", "set_", "as_strided_", "t_", "transpose_", "squeeze_",
    "unsqueeze_", "swapdims_", "swapaxes_", "detach_",
}  # fmt: skip


def _propagate_changed(source: torch.fx.GraphModule, gm: torch.fx.GraphModule) -> int | None:
    """Fake values of `gm`, a rewritten copy of `source`, run again only where they may
    differ from the source's node of the same name. An op whose results are new storages
    keeps the source's value where its inputs are laid out as the source's were (its
    result depends on nothing else); any other op keeps it where its call and its inputs'
    values are unchanged. A value run again that comes out laid out alike, from an op of
    new storages, is the source's too: so storages stay shared as they were and the
    change stops spreading. The rewrites change a few dozen nodes of thousands, and a
    whole propagation was half of a ResNet-50 rewrite's seconds. Returns how many nodes
    ran; None, having done nothing, where the values cannot be run in their fake mode."""
    from torch._subclasses.fake_tensor import FakeTensor, maybe_get_fake_mode
    from torch.fx.experimental.proxy_tensor import snapshot_fake
    from torch.fx.node import map_aggregate, map_arg

    placeholders = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    modes = {id(maybe_get_fake_mode(v)): maybe_get_fake_mode(v) for v in placeholders}
    mode = next(iter(modes.values()), None)
    if mode is None or len(modes) != 1:
        return None
    if any(_target_name(n.target) in _RESHAPING_IN_PLACE for n in gm.graph.nodes):
        return None
    before = {n.name: n for n in source.graph.nodes}
    present = {n.name for n in gm.graph.nodes}
    values = lambda n: map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))  # noqa: E731
    ran = 0
    adopted: set[str] = set()  # source nodes whose value a new node took over

    try:
        with mode, torch.no_grad():
            for n in gm.graph.nodes:
                if n.op in ("placeholder", "output", "get_attr"):
                    continue
                old = before.get(n.name)
                same_op = old is not None and old.op == n.op and old.target == n.target
                fresh = _fresh_result(n.target)
                inputs = values(n)
                if same_op:
                    then = values(old)
                    if _same(inputs, then, _identical) or (
                        fresh and _same(inputs, then, _laid_out_alike)
                    ):
                        n.meta["val"] = old.meta.get("val")
                        continue
                args, kwargs = inputs
                result = n.target(*args, **kwargs)
                ran += 1
                value = map_aggregate(
                    result, lambda v: snapshot_fake(v) if isinstance(v, FakeTensor) else v
                )
                # The node it runs in place of (a rewrite's new op), or its own former self:
                # where both make a new storage laid out alike, the source's value stands.
                replaced = before.get((n.meta.get("replaces") or [""])[-1]) if old is None else old
                if (
                    fresh
                    and replaced is not None
                    and (replaced is old or replaced.name not in present)
                    and replaced.name not in adopted
                    and _fresh_result(replaced.target)
                    and _same(value, replaced.meta.get("val"), _laid_out_alike)
                ):
                    value = replaced.meta["val"]
                    adopted.add(replaced.name)
                n.meta["val"] = value
    except Exception:  # an op fake values cannot run this way: the whole propagation runs
        return None
    return ran


def _same(a, b, tensors_match) -> bool:
    """Same structure, tensors that `tensors_match`, equal other values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensors_match(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(
            _same(x, y, tensors_match) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], tensors_match) for k in a)
    return type(a) is type(b) and a == b


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b


def _laid_out_alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape, strides, offset, dtype and device."""
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _target_name(target) -> str:
    schema = getattr(target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else getattr(target, "__name__", "")


def _fresh_result(target) -> bool:
    """Whether `target` is an op whose results are new storages: no result aliases an
    input and no input is written (from its schema; False for what has none)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return all(r.alias_info is None for r in schema.returns) and not any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def apply(
    graph: Graph, flags: tuple[str, ...] | str, plain_batch_norms: tuple[str, ...] = ()
) -> Graph:
    """`graph` with the variants of `flags` (or a mode string) rewritten in, as a new
    Graph; `graph.variants` lists the flags applied. Flags already applied are skipped."""
    import dataclasses

    if isinstance(flags, str):
        flags = parse_mode(flags)
    todo = [f for f in PASS_ORDER if f in flags and f not in graph.variants]
    if not todo:
        return graph
    from monet_like import kernels

    kernels.load()
    _register_all()
    graph = dataclasses.replace(graph, plain_batch_norms=tuple(plain_batch_norms))
    sites = copy.deepcopy(graph.sites)
    for flag in todo:
        for variant in (v for v in REGISTRY.values() if v.flag == flag):
            gm = copy_module(graph.fx)
            if variant.rewrite(graph, gm, sites):  # later variants see this one's result
                graph = refresh(graph, gm, graph.variants)
        graph = dataclasses.replace(graph, variants=(*graph.variants, flag))
    # A site's replaced op reads values by name; a later rewrite may have replaced the
    # node that produced one (a ReLU's incoming gradient came from the max-pool backward
    # that the compact max-pool replaced): follow the renames.
    names = {
        old: n.name
        for n in graph.fx.graph.nodes
        for old in (*n.meta.get("replaces", []), *n.meta.get("merged", []))
    }
    for site in sites:
        if site["original"]:
            site["original"]["args"] = [rename(a, names) for a in site["original"]["args"]]
    graph.sites = sites
    return graph


def choosable(graph: Graph) -> list[dict]:
    """The sites the solver may turn off (run the replaced aten op instead): those whose
    variant only changes what a backward op reads."""
    return [s for s in graph.sites if s["choosable"]]


def algorithm_sites(graph: Graph) -> list[dict]:
    """The convolutions whose algorithms the solver picks (see variants.conv)."""
    return [s for s in graph.sites if s.get("algorithm")]


def select(
    graph: Graph,
    off: list[str] | tuple[str, ...],
    algorithms: dict[str, list[int]] | None = None,
) -> Graph:
    """`graph` with the sites named in `off` turned back to the aten ops they replaced:
    the variant's backward node runs the original op (same name, so schedules built
    on `graph` still find it) and the forward nodes it added are gone. `algorithms`
    maps a convolution site to its [forward, backward-data, backward-weight]
    algorithms. Only the traced module changes; storages, ops and nodes stay those
    the solver worked on."""
    import dataclasses

    algorithms = algorithms or {}
    if not off and not algorithms:
        return graph
    by_id = {s["id"]: s for s in graph.sites}
    unknown = [i for i in off if i not in by_id or not by_id[i]["choosable"]]
    unknown += [i for i in algorithms if i not in by_id or not by_id[i].get("algorithm")]
    if unknown:
        raise UserError(f"no variant site {', '.join(unknown)} to set in this graph")
    gm = copy_module(graph.fx)
    nodes = {n.name: n for n in gm.graph.nodes}
    for site_id, (forward, data, weight) in algorithms.items():
        site = by_id[site_id]
        node = nodes[site["forward"][0]]
        node.args = (*node.args[:-1], int(forward))
        if site["backward"]:
            node = nodes[site["backward"]]
            node.args = (*node.args[:-2], int(data), int(weight))
    for site_id in off:
        site = by_id[site_id]
        node = nodes[site["backward"]]
        node.target = _resolve(site["original"]["target"])
        node.args = tuple(decode(a, nodes) for a in site["original"]["args"])
        for name in reversed(site["forward"]):
            gm.graph.erase_node(nodes[name])
    gm.recompile()
    return dataclasses.replace(graph, fx=gm)


def _resolve(target: str):
    """An op by its printed name: aten.threshold_backward.default -> the OpOverload."""
    value = torch.ops
    for part in target.split("."):
        value = getattr(value, part)
    return value


def copy_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with its own nodes (their meta copied shallowly), so that rewriting
    it leaves the original graph intact."""
    g = torch.fx.Graph()
    g._codegen = copy.deepcopy(gm.graph._codegen)  # make_fx's pytree calling convention
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    # lazy: the rewrites copy ResNet-50's graph seven times, and only the last is run
    return _CopiedModule(gm, g)


def _register_all() -> None:
    from monet_like.variants import conv, inplace, multiway, newnode  # noqa: F401  (registers)


REGISTRY: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
    REGISTRY[variant.name] = variant
    return variant


def describe() -> list[dict]:
    """The registry as plain rows (for docs/variants.md)."""
    _register_all()

    return [
        {
            "variant": v.name,
            "flag": v.flag,
            "replaces": v.replaces,
            "backward reads": v.backward_reads,
            "extra outputs": v.extra_outputs or "-",
            "in place": "yes" if v.in_place else "no",
        }
        for v in REGISTRY.values()
    ]
