"""Profiles of two graphs of one model (a mode's variants and the captured graph):
their common ops' times aligned, and a profile derived for a graph from another's."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

from monet_like.graph import BACKWARD, FORWARD, Graph
from monet_like.profile.algorithms import algorithm_workspace
from monet_like.profile.types import Profile, _node_profiles
from monet_like.profile.workspace import _extrapolate_float


def _with_op_times(prof: Profile, graph: Graph, op_times: list[float]) -> Profile:
    """`prof` with every time derived from `op_times` (seconds per op index of `graph`):
    each node's forward (and recompute) and backward, and the step's totals."""
    nodes = {n.id: n for n in graph.nodes}
    timed = []
    for n in prof.nodes:
        fwd = sum(op_times[i] for i in nodes[n.node].ops)
        bwd = sum(op_times[i] for i in nodes[n.node].backward_ops)
        timed.append(replace(n, forward_s=fwd, backward_s=bwd, recompute_s=fwd))
    return replace(
        prof,
        nodes=timed,
        op_times_s=list(op_times),
        op_forward_s=sum(op_times[o.index] for o in graph.ops if o.phase == FORWARD),
        op_backward_s=sum(op_times[o.index] for o in graph.ops if o.phase == BACKWARD),
    )


# Two profiles whose common ops ran more than this many times apart in speed are said
# to: the alignment then carries a large correction to the ops only one graph runs (a
# profile taken beside other work measured a tenfold one; two taken one after the
# other by the time-to-schedule benchmark, nothing else running, 1.36 and 1.71 in two
# runs: a shared host's speed moves).
SPEEDS_APART = 1.5


def align_times(prof: Profile, graph: Graph, reference: Profile, captured: Graph) -> Profile:
    """`prof` (of `graph`, the captured graph with variants rewritten in) with its times
    put on the same footing as `reference` (of `captured`), so that the two graphs'
    schedules can be compared by time.

    Two profiles taken minutes apart on a shared machine differ by more than the
    variants change (ResNet-50's store-all step: 24 s in one, 32 s in the next, the same
    kernels). Here every op both graphs run takes the reference's time: the same name and
    aten op, or a convolution rewritten for `conv`, which the step runs with PyTorch's
    own algorithm (the solver scales the other algorithms' times from it). Each op only
    `graph` runs (a variant's) takes its own time times the ratio of the reference's to
    `prof`'s over the common ops: the machine's speed during the one profile against
    the other. A profile without per-op times, or one already aligned to `reference`,
    is returned as it is."""
    n = len(getattr(graph, "ops", ()))
    own, theirs_s = getattr(prof, "op_times_s", ()), getattr(reference, "op_times_s", ())
    if not n or len(own) != n or len(theirs_s) != len(captured.ops):
        return prof
    common = {i: theirs_s[j] for i, j in _counterparts(graph, captured).items()}
    own_common = sum(own[i] for i in common)
    speed = sum(common.values()) / own_common if own_common > 0 else 1.0
    times = [common.get(i, t * speed) for i, t in enumerate(own)]
    if prof.aligned and times == own:
        return prof
    aligned = _with_op_times(prof, graph, times)
    said = (
        f"{len(common)} of {n} ops timed as in the captured graph's profile,"
        f" the other {n - len(common)} scaled by {speed:.3f}"
    )
    apart = max(speed, 1 / speed) if speed > 0 else 1.0
    if apart > SPEEDS_APART:
        said += (
            f" (the two profiles ran {apart:.2f}x apart in speed: the machine was slower"
            " during one; the graph's own ops are right as far as that ratio holds for them)"
        )
    return replace(aligned, aligned=said)


def _counterparts(graph: Graph, captured: Graph) -> dict[int, int]:
    """Op index in `graph` -> index of the op of `captured` (the graph it was rewritten
    from) that does the same work: the same name and aten op, or a `conv` site's
    convolution or its backward, which the profiled step runs with PyTorch's own
    algorithm, mapped to the aten op it replaced. Ops only `graph` runs are absent."""
    theirs = {o.name: o for o in captured.ops}
    same_work = _same_work(graph)
    found = {}
    for o in graph.ops:
        match = theirs.get(o.name)
        if match is None or str(match.target) != str(o.target):
            match = theirs.get(same_work.get(o.name, ""))
        if match is not None:
            found[o.index] = match.index
    return found


def _same_work(graph: Graph) -> dict[str, str]:
    """Ops of `graph` (by name) that run the same kernel as an op of the graph it was
    rewritten from: the convolutions of `conv` sites (PyTorch's algorithm in the step),
    mapped to the aten convolution each replaced."""
    from monet_like.variants import algorithm_sites

    if graph.fx is None:
        return {}
    nodes = {n.name: n for n in graph.fx.graph.nodes}
    found = {}
    for site in algorithm_sites(graph):
        for name in (site["forward"][0], site["backward"]):
            replaced = nodes[name].meta.get("replaces", []) if name in nodes else []
            if replaced:
                found[name] = replaced[0]  # the captured op, before any rewrite
    return found


def derived_profile(
    graph: Graph, captured: Graph, reference: Profile, measured: Profile, measured_graph: Graph
) -> Profile | None:
    """A profile of `graph` (the captured graph with only `conv` rewritten in) built from
    measurements already taken: every op's time and workspace from `reference` (the
    captured graph's profile; a convolution site runs PyTorch's algorithm in the step,
    the kernel the captured op ran), and each convolution's algorithm options from
    `measured`, the profile of `measured_graph`, another rewrite of the same captured
    graph with `conv` in it (the sites matched through the captured op each replaced).
    None when an op of `graph` or one of its sites has no counterpart there.

    The full mode's solve uses it to weigh the convolution algorithms without the
    mode's other variants, without a third profile."""
    ref_times = getattr(reference, "op_times_s", ())
    counterpart = _counterparts(graph, captured)
    if len(ref_times) != len(captured.ops) or len(counterpart) != len(graph.ops):
        return None
    ref_workspace = dict(reference.op_workspace)
    source = [counterpart[o.index] for o in graph.ops]  # the captured op each runs as
    same_work = _same_work(graph)
    # a site's options, keyed by the captured convolution it replaced
    measured_same = _same_work(measured_graph)
    by_captured = {
        measured_same[site_id]: options
        for site_id, options in measured.algorithms.items()
        if site_id in measured_same
    }
    from monet_like.variants import algorithm_sites

    algorithms = {}
    for site in algorithm_sites(graph):
        options = by_captured.get(same_work.get(site["id"], ""))
        if options is None:
            return None
        if site["backward"] and not {"both", "data", "weight"} & set(options):
            # Measured there without its backward (a rewrite that left a site unpaired,
            # as the conv pass once did in MobileNetV2's full mode): options without one
            # would price this graph's backward at nothing. It runs PyTorch's choice.
            continue
        algorithms[site["id"]] = copy.deepcopy(options)
    workspace = [ref_workspace.get(i, 0) for i in source]
    for i, w in algorithm_workspace(graph, algorithms, {}).items():
        workspace[i] = w
    nodes = _node_profiles(graph, workspace)
    derived = replace(
        reference,
        fingerprint=graph.fingerprint,
        nodes=nodes,
        op_workspace=[(i, w) for i, w in enumerate(workspace) if w > 0],
        alone_seconds=[],  # the reference's are by its own op indices
        algorithms=algorithms,
        profile_seconds=0.0,
        aligned="every op timed as in the captured graph's profile; the convolution"
        " algorithms' options from the mode's profile",
        cached=False,
    )
    return _with_op_times(derived, graph, [ref_times[i] for i in source])


def at_batch(sources: list[tuple[Graph, Profile]], other: Graph) -> Profile:
    """A profile of `other`, a step captured at some batch, carried over from profiles of
    the same step at one or two other batches (`sources`: (graph, profile) pairs),
    without running anything. Bytes come from `other` itself (exact). From two profiles,
    each op's time and workspace follow the line through their two batches (never
    negative; workspace never below what either measured: a library picks its blocking
    by shape); from one, times scale with the batch and workspace scales up with it,
    never down. An estimate for searching over batch sizes: a schedule that is kept is
    solved again on a profile taken at its own batch.

    Raises:
        ValueError: the graphs do not run the same ops (batch-dependent control flow).
    """
    for graph, _ in sources:
        if [o.target for o in graph.ops] != [o.target for o in other.ops]:
            raise ValueError(f"the graphs at batches {graph.batch} and {other.batch} differ")
    (g1, p1), (g2, p2) = sources[0], sources[-1]
    b1, b2, batch = g1.batch, g2.batch, other.batch
    if b1 == b2:  # one profile: proportional, workspace scaled up only

        def time_at(t1: float, t2: float) -> float:
            return t1 * batch / b1

        def bytes_at(w1: int, w2: int) -> int:
            return math.ceil(w1 * max(1.0, batch / b1))

    else:

        def time_at(t1: float, t2: float) -> float:
            slope = max(0.0, (t2 - t1) / (b2 - b1))
            if t1 < slope * b1:  # superlinear: proportional, through the larger batch
                return t2 * batch / b2
            return t1 - slope * b1 + slope * batch

        def bytes_at(w1: int, w2: int) -> int:
            return int(_extrapolate_float([w1], b1, [w2], b2, batch)[0])

    ws1, ws2 = dict(p1.op_workspace), dict(p2.op_workspace)
    workspace = [bytes_at(ws1.get(i, 0), ws2.get(i, 0)) for i in range(len(other.ops))]
    times = [time_at(t1, t2) for t1, t2 in zip(p1.op_times_s, p2.op_times_s, strict=True)]
    algorithms = {}
    for site, per_site in p1.algorithms.items():
        algorithms[site] = {}
        for direction, rows in per_site.items():
            theirs = {a: (s, w) for a, s, w in p2.algorithms.get(site, {}).get(direction, [])}
            algorithms[site][direction] = [
                [a, time_at(s, theirs.get(a, (s, w))[0]), bytes_at(w, theirs.get(a, (s, w))[1])]
                for a, s, w in rows
            ]
    batches = f"batch {b1}" if b1 == b2 else f"batches {b1} and {b2}"
    carried = replace(
        p1,
        fingerprint=other.fingerprint,
        batch=batch,
        scaled=True,
        workspace_method=f"estimated from the profiles at {batches}",
        alone_seconds=[],  # measured at another batch
        nodes=_node_profiles(other, workspace),
        op_workspace=[(i, w) for i, w in enumerate(workspace) if w > 0],
        algorithms=algorithms,
        cached=False,
    )
    return _with_op_times(carried, other, times)
