"""From Graph + Profile to the plain data the MILP is written over.

Units. A unit is what can be kept or dropped: the activation storages one forward
compute node allocates, together with the in-place nodes that later write into
them (a BatchNorm output and the `relu_` applied to it are one unit: autograd
only ever saves the final contents). Recomputing a unit re-runs all its nodes.

Stages. The backward pass runs in eager PyTorch's order. A stage is a maximal run
of consecutive backward ops attributed to the same unit; `need[t]` are the units
whose storages the stage's ops read (what autograd saved), and `grad_bytes[t]` the
largest number of bytes that exist only in the backward pass (gradients,
temporaries, workspace) at any op of the stage. That part does not depend on the
checkpointing decisions, so it is computed once, exactly, from the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from monet_like.graph import (
    ACTIVATION,
    BACKWARD,
    FORWARD,
    GRADIENT,
    RUNNING_STAT_WRITERS,
    Graph,
)
from monet_like.memory import last_uses
from monet_like.profile import backward_option, option, weight_grad_bytes

# An output at least this many times smaller than its node's largest is a side output:
# BatchNorm's statistics, the compact max-pool's byte indices (not int64 indices, twice
# the pooled output, nor the pooled output itself).
SIDE_RATIO = 4


@dataclass(frozen=True)
class Unit:
    id: int
    nodes: tuple[int, ...]  # graph nodes, forward order
    storages: tuple[int, ...]
    bytes: int
    recompute_s: float
    workspace_bytes: int  # largest forward workspace among its nodes
    inputs: tuple[int, ...]  # units whose storages its nodes read
    last_forward_use: int  # last unit (index) that reads it in the forward pass
    random: bool = False  # holds a random op (dropout): never recomputed, only kept
    side_of: int | None = None  # small outputs of that unit's nodes: kept, never recomputed
    side_bytes: int = 0  # bytes of its side units, rewritten whenever it is recomputed
    # first and last forward op of its nodes (views folded into them included: a view
    # read late holds the unit's storage until then); None: its node ids stand in
    op_span: tuple[int, int] | None = None

    # why it is never recomputed though it draws no random number ("" where it may be):
    # it reads a value that an op writes in place afterwards, which a recomputation
    # would see written
    pinned: str = ""

    @property
    def recomputable(self) -> bool:
        return not self.random and not self.pinned and self.side_of is None

    @property
    def span(self) -> tuple[int, int]:
        if self.op_span is not None:
            return self.op_span
        return (min(self.nodes), max(self.nodes)) if self.nodes else (0, 0)


@dataclass(frozen=True)
class Stage:
    id: int
    unit: int | None  # the unit whose backward this is (None: glue ops)
    ops: tuple[int, ...]
    need: tuple[int, ...]
    grad_bytes: int  # backward-only bytes alive at the stage's worst op, workspace included
    start_bytes: int = 0  # backward-only bytes alive when the stage starts (recomputation)
    # Per run of the stage's ops: (its first op, the largest backward-only bytes at its
    # ops, the units read by them or by the stage's later ops, either option of a choice
    # included). Empty: one run, with grad_bytes and need plus the choices' units.
    by_op: tuple[tuple[int, int, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class Choice:
    """A variant site the solver may turn off (monet_like.variants.choosable): at stage
    `stage`, the variant's backward op needs `on_units`, the aten op it replaced needs
    `off_units`; the variant's own forward outputs (`optional_units`) exist only when
    it runs. Times: the site's ops with the variant on, and with it off."""

    site: str
    stage: int
    on_units: tuple[int, ...]
    off_units: tuple[int, ...]
    optional_units: tuple[int, ...]
    on_s: float
    off_s: float


# An algorithm option: (algorithms, seconds, workspace bytes); algorithms is (forward,)
# for a forward option and (backward-data, backward-weight) for a backward one.
Option = tuple[tuple[int, ...], float, int]


@dataclass(frozen=True)
class AlgorithmChoice:
    """A convolution whose algorithms the solver picks (monet_like.variants.conv): one
    forward option, run where unit `unit` runs and again wherever it is recomputed, and
    one backward option, run at stage `stage` (None: no backward). `forward_live` and
    `backward_live` are the other bytes alive at those two ops, their workspace left out
    (the option adds its own). Options keep the Pareto front of time and workspace; the
    `*_default_s` are the times of PyTorch's own choice in the profiled step, and an
    option's time is that times its ratio to PyTorch's choice, measured side by side."""

    site: str
    unit: int
    forward_live: int
    forward: tuple[Option, ...]
    forward_default_s: float
    stage: int | None
    backward_live: int
    backward: tuple[Option, ...]
    backward_default_s: float
    backward_op: int | None = None  # its backward op's index (what the stage reads from it)

    @property
    def base_s(self) -> float:
        """The profiled step's time above the fastest options."""
        fastest_bwd = min((o[1] for o in self.backward), default=self.backward_default_s)
        return (self.forward_default_s - min(o[1] for o in self.forward)) + (
            self.backward_default_s - fastest_bwd
        )


@dataclass(frozen=True)
class Problem:
    units: list[Unit]
    stages: list[Stage]
    constant_bytes: int  # parameters, buffers, input, seed: alive the whole step
    forward_extra: list[int]  # per unit: other bytes alive while it runs in forward
    store_all_peak_bytes: int  # exact peak of the eager store-all step (with workspace)
    store_all_time_s: float  # forward + backward time of one eager step
    fixed_bytes: int  # params + grads + buffers + input (what no schedule removes)
    choices: tuple[Choice, ...] = ()
    algorithms: tuple[AlgorithmChoice, ...] = ()

    @property
    def choice_base_s(self) -> float:
        """Time the choices' costs are counted above: the store-all step runs every
        variant and PyTorch's own convolution algorithms, so its time less each choice's
        cost above its cheapest option."""
        return sum(c.on_s - min(c.on_s, c.off_s) for c in self.choices) + sum(
            a.base_s for a in self.algorithms
        )

    @property
    def fastest_step_s(self) -> float:
        """A lower bound on any schedule's predicted step: the store-all step with every
        choice at its fastest option (the objective counts time above it)."""
        return self.store_all_time_s - self.choice_base_s


def build_problem(
    graph: Graph, profile, workspace: dict[int, int] | None = None, reference=None
) -> Problem:
    """`profile`: a monet_like.profile.Profile for `graph` (times and workspace).

    `reference`: the profile of the graph before its variants were rewritten in; with
    it, every choosable variant site becomes a `Choice` (its off-time comes from there).
    Without it the variants are fixed on."""
    from monet_like.memory import fixed_bytes, held_outputs, store_all_timeline

    workspace = workspace if workspace is not None else profile.workspace_by_op()
    profiled_workspace = workspace
    ops = graph.ops
    # The outputs the training loop holds live to the step's end whatever the schedule
    # does: never a unit's, counted like gradients.
    held = held_outputs(graph)
    unit_nodes, unit_storages, side_of, pinned = _join_reads_before_writes(
        graph, *_group_units(graph, held)
    )
    unit_of_storage = {s: uid for uid, acts in enumerate(unit_storages) for s in acts}
    unit_of_node = {n: uid for uid, nids in enumerate(unit_nodes) for n in nids}
    # Convolutions with algorithm options (and a unit to recompute them with): the MILP
    # adds their ops' workspace, the chosen option's, so it is left out of the constants.
    algorithm_ops = {
        site: found
        for site, found in _algorithm_ops(graph, profile).items()
        if ops[found[0]].node in unit_of_node
    }
    chosen_ops = {i for f, b, _ in algorithm_ops.values() for i in (f, b) if i is not None}
    workspace = {i: w for i, w in workspace.items() if i not in chosen_ops}
    _pin_makers_of_held_outputs(graph, unit_nodes, held, pinned)
    units = _units(graph, profile, unit_nodes, unit_storages, side_of, pinned, workspace)
    other_live, other_no_ws = _other_live(graph, set(unit_of_storage), held, workspace)
    forward_extra = [0] * len(units)
    for op in ops:
        if op.phase == FORWARD and op.node is not None and op.node in unit_of_node:
            u = unit_of_node[op.node]
            forward_extra[u] = max(forward_extra[u], other_live[op.index])
    stages = _stages(graph, unit_of_node, unit_of_storage, other_live, other_no_ws)
    choices: list[Choice] = []
    if reference is not None:
        stages, choices = _choices(graph, profile, reference, stages, unit_of_storage)
    algorithms = _algorithm_choices(
        graph, profile, algorithm_ops, unit_of_node, stages, other_no_ws
    )
    return Problem(
        units=units,
        stages=stages,
        choices=tuple(choices),
        algorithms=tuple(algorithms),
        constant_bytes=sum(
            s.nbytes for s in graph.storages if s.kind in ("param", "buffer", "input", "seed")
        ),
        forward_extra=forward_extra,
        store_all_peak_bytes=store_all_timeline(graph, profiled_workspace).peak_bytes,
        store_all_time_s=profile.step_time_s,
        fixed_bytes=fixed_bytes(graph).total,
    )


def _group_units(graph: Graph, held: set[int]):
    """Forward nodes grouped into units: (nodes per unit, activation storages per unit,
    side unit -> the unit whose recomputation rewrites it)."""
    storages, ops = graph.storages, graph.ops
    unit_of_storage: dict[int, int] = {}
    unit_nodes: list[list[int]] = []
    unit_storages: list[list[int]] = []
    side_of: dict[int, int] = {}

    def new_unit(nodes: list[int], acts: list[int]) -> int:
        uid = len(unit_nodes)
        unit_nodes.append(nodes)
        unit_storages.append(list(acts))
        for s in acts:
            unit_of_storage[s] = uid
        return uid

    for node in graph.nodes:
        acts = [s for s in node.outputs if storages[s].kind == ACTIVATION and s not in held]
        overwritten = [
            unit_of_storage[s]
            for s in ops[node.op].outputs
            if s in unit_of_storage and s not in node.outputs
        ]
        held_here = [s for s in node.outputs if s in held]
        if not acts and not held_here:
            if node.inplace and overwritten:
                unit_nodes[overwritten[0]].append(node.id)
            # else: bookkeeping on buffers or parameters (num_batches_tracked += 1): no unit
            continue
        # Small side outputs (BatchNorm's saved mean and inverse std) form a unit of their
        # own, kept rather than recomputed, so that the large output can be dropped
        # while a backward op still reads the statistics.
        largest = max(
            [storages[s].nbytes for s in acts + held_here]
            + [storages[s].nbytes for u in overwritten[:1] for s in unit_storages[u]]
        )
        side = [s for s in acts if storages[s].nbytes * SIDE_RATIO <= largest]
        main = [s for s in acts if s not in side]
        if not main and not overwritten and not held_here:  # nothing larger (empty tensors)
            main, side = acts, []
        if overwritten:
            # Also writes an earlier unit's storage (BatchNorm run in place): recomputing
            # that unit must run this node too.
            uid = overwritten[0]
            unit_nodes[uid].append(node.id)
            unit_storages[uid].extend(main)
            for s in main:
                unit_of_storage[s] = uid
        else:
            uid = new_unit([node.id], main)
        if side:
            side_of[new_unit([], side)] = uid
    return unit_nodes, unit_storages, side_of


def _pin_makers_of_held_outputs(graph: Graph, unit_nodes, held: set[int], pinned: dict) -> None:
    """A unit that makes a held output (its storage is no unit's) is never recomputed: a
    second copy of the output would be uncounted, the first one being alive anyway."""
    ops, storages = graph.ops, graph.storages
    for uid, nids in enumerate(unit_nodes):
        made = [s for n in nids for i in graph.nodes[n].ops for s in ops[i].outputs if s in held]
        if made:
            pinned.setdefault(uid, f"it makes {storages[made[0]].name}, an output the loop holds")


def _units(
    graph: Graph, profile, unit_nodes, unit_storages, side_of, pinned, workspace
) -> list[Unit]:
    """The Units: bytes, recompute time and workspace, inputs, last forward reader."""
    storages, ops = graph.storages, graph.ops
    node_time = {n.node: n.forward_s for n in profile.nodes}
    unit_of_storage = {s: uid for uid, acts in enumerate(unit_storages) for s in acts}
    n_units = len(unit_nodes)
    inputs: list[set[int]] = [set() for _ in range(n_units)]
    last_fwd = list(range(n_units))
    for uid, nids in enumerate(unit_nodes):
        for nid in nids:
            for i in graph.nodes[nid].ops:
                for s in ops[i].reads:
                    src = unit_of_storage.get(s)
                    if src is not None and src != uid:
                        inputs[uid].add(src)
                        last_fwd[src] = max(last_fwd[src], uid)
    units = []
    for uid, nids in enumerate(unit_nodes):
        op_ids = [i for n in nids for i in graph.nodes[n].ops]
        side_bytes = sum(
            storages[s].nbytes
            for side, main in side_of.items()
            if main == uid
            for s in unit_storages[side]
        )
        units.append(
            Unit(
                id=uid,
                nodes=tuple(nids),
                storages=tuple(unit_storages[uid]),
                bytes=sum(storages[s].nbytes for s in unit_storages[uid]),
                recompute_s=sum(node_time.get(n, 0.0) for n in nids),
                workspace_bytes=max((workspace.get(graph.nodes[n].op, 0) for n in nids), default=0),
                inputs=tuple(sorted(inputs[uid])),
                last_forward_use=last_fwd[uid],
                random=any(ops[i].random for i in op_ids),
                side_of=side_of.get(uid),
                pinned=pinned.get(uid, ""),
                side_bytes=side_bytes,
                op_span=(min(op_ids), max(op_ids)) if nids else None,
            )
        )
    return units


def _other_live(
    graph: Graph, unit_storages: set[int], held: set[int], workspace: dict[int, int]
) -> tuple[list[int], list[int]]:
    """Bytes that are no unit's and no constant's (gradients, temporaries, held
    outputs) alive at each op: with that op's workspace, and without."""
    storages, ops = graph.storages, graph.ops
    last = last_uses(graph)
    other_live = [0] * (len(ops) + 1)
    diff = [0] * (len(ops) + 1)
    for op in ops:
        for s in op.allocates:
            if s in unit_storages or storages[s].kind not in (ACTIVATION, GRADIENT):
                continue
            end = len(ops) if storages[s].kind == GRADIENT or s in held else last[s] + 1
            diff[op.index] += storages[s].nbytes
            diff[end] -= storages[s].nbytes
    running = 0
    other_no_ws = [0] * len(ops)
    for i in range(len(ops)):
        running += diff[i]
        other_no_ws[i] = running
        other_live[i] = running + workspace.get(i, 0)
    return other_live, other_no_ws


def _stages(graph: Graph, unit_of_node, unit_of_storage, other_live, other_no_ws) -> list[Stage]:
    """The backward ops cut into stages, one per unit whose gradient ops they are, each
    with the units it reads and the bytes at each of its ops."""
    ops = graph.ops
    stages: list[Stage] = []
    current: list[int] = []
    current_unit: int | None = None

    def close() -> None:
        if not current:
            return
        need = sorted(
            {unit_of_storage[s] for i in current for s in ops[i].reads if s in unit_of_storage}
        )
        # A saved value dies after its last reader inside the stage: what is read from
        # each op on, with the largest backward-only bytes over the ops that share it.
        by_op: list[tuple[int, int, tuple[int, ...]]] = []
        read_from_here: set[int] = set()
        for i in reversed(current):
            read_from_here |= {unit_of_storage[s] for s in ops[i].reads if s in unit_of_storage}
            reads = tuple(sorted(read_from_here))
            if by_op and by_op[-1][2] == reads:
                by_op[-1] = (i, max(by_op[-1][1], other_live[i]), reads)
            else:
                by_op.append((i, other_live[i], reads))
        stages.append(
            Stage(
                id=len(stages),
                unit=current_unit,
                ops=tuple(current),
                need=tuple(need),
                grad_bytes=max(other_live[i] for i in current),
                start_bytes=other_no_ws[current[0] - 1] if current[0] > 0 else 0,
                by_op=tuple(reversed(by_op)),
            )
        )

    for op in ops:
        if op.phase != BACKWARD:
            continue
        unit = unit_of_node.get(op.node) if op.node is not None else None
        if unit is not None and unit != current_unit and current:
            close()
            current = []
        if unit is not None:
            current_unit = unit
        current.append(op.index)
    close()
    return stages


def _algorithm_choices(
    graph: Graph, profile, algorithm_ops, unit_of_node, stages, other_no_ws
) -> list[AlgorithmChoice]:
    """Each convolution's algorithm options. An option's time: the op's own time in the
    profiled step (PyTorch's algorithm), times the option's ratio to PyTorch's as
    measured side by side; absolute times of ops run alone are not comparable with the
    step's on a busy machine."""
    stage_of = {i: t for t, st in enumerate(stages) for i in st.ops}
    profiled = {n.node: n for n in profile.nodes}
    algorithms = []
    for site, (fwd_op, bwd_op, options) in algorithm_ops.items():
        node = graph.ops[fwd_op].node
        fwd_s, bwd_s = profiled[node].forward_s, profiled[node].backward_s
        fwd_scale = fwd_s / max(option(options["forward"], -1)[0], 1e-12)
        bwd_scale = bwd_s / max(backward_option(options, -1, -1)[0], 1e-12)
        algorithms.append(
            AlgorithmChoice(
                site=site,
                unit=unit_of_node[node],
                forward_live=other_no_ws[fwd_op],
                forward=_pareto([((a,), t * fwd_scale, ws) for a, t, ws in options["forward"]]),
                forward_default_s=fwd_s,
                stage=stage_of.get(bwd_op) if bwd_op is not None else None,
                backward_live=other_no_ws[bwd_op] if bwd_op is not None else 0,
                backward=(
                    _backward_options(options, bwd_scale, weight_grad_bytes(graph, fwd_op))
                    if bwd_op is not None
                    else ()
                ),
                backward_default_s=bwd_s,
                backward_op=bwd_op,
            )
        )
    return algorithms


def _updates_statistics(op) -> bool:
    return op.target.split(".")[-2] in RUNNING_STAT_WRITERS if "." in op.target else False


def _join_reads_before_writes(
    graph: Graph,
    unit_nodes: list[list[int]],
    unit_storages: list[list[int]],
    side_of: dict[int, int],
) -> tuple[list[list[int]], list[list[int]], dict[int, int], dict[int, str]]:
    """Make every recomputation read what its forward op read.

    A forward op that reads a storage which a later op writes in place (the clone
    autograd takes of a SiLU's input before `silu_` overwrites it) would, recomputed on
    its own, read the written value. Its unit is joined to the unit owning the storage,
    so that both are recomputed together, their ops in forward order. Where the storage
    is no unit's (an input, a buffer), or is written in the backward pass, or belongs
    to a side unit, no recomputation can see the old value: the reader's unit is
    pinned (kept), and so is the owner of a storage the backward pass writes, and a
    unit that writes a buffer or an input in place (run twice, it would write twice).

    Returns the units' nodes and storages after joining, the side units renumbered,
    and the pinned units with the reason, naming the op.
    """
    ops = graph.ops
    unit_of_node = {n: uid for uid, nids in enumerate(unit_nodes) for n in nids}
    unit_of_storage = {s: uid for uid, acts in enumerate(unit_storages) for s in acts}
    last_write: dict[int, int] = {}  # storage -> the last op that writes it in place
    backward_writer: dict[int, int] = {}
    for op in ops:
        for s in op.writes:
            last_write[s] = op.index
            if op.phase == BACKWARD:
                backward_writer.setdefault(s, op.index)

    parent = list(range(len(unit_nodes)))

    def find(u: int) -> int:
        while parent[u] != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    pinned: dict[int, str] = {}
    for s, j in backward_writer.items():
        if s in unit_of_storage:
            pinned[unit_of_storage[s]] = f"the backward op {ops[j].name} writes it in place"
    for op in ops:  # run again, it would write a buffer (or an input) a second time
        if op.phase == FORWARD and op.node in unit_of_node and not _updates_statistics(op):
            outside = [s for s in op.writes if s not in unit_of_storage]
            if outside:
                pinned.setdefault(
                    unit_of_node[op.node],
                    f"{op.name} writes {graph.storages[outside[0]].name} in place",
                )
    for op in ops:
        if op.phase != FORWARD or op.node is None or op.node not in unit_of_node:
            continue
        reader = unit_of_node[op.node]
        for s in op.reads:
            j = last_write.get(s, -1)
            if j <= op.index or s in op.writes:
                continue
            owner = unit_of_storage.get(s)
            if owner is None or owner in side_of or s in backward_writer:
                pinned.setdefault(
                    reader,
                    f"{op.name} reads {graph.storages[s].name}, which {ops[j].name} then "
                    "writes in place",
                )
            elif find(owner) != find(reader):
                parent[find(reader)] = find(owner)

    groups: dict[int, list[int]] = {}
    for uid in range(len(unit_nodes)):
        groups.setdefault(find(uid), []).append(uid)
    if all(len(g) == 1 for g in groups.values()):
        return unit_nodes, unit_storages, side_of, pinned
    new_id: dict[int, int] = {}
    nodes: list[list[int]] = []
    storages: list[list[int]] = []
    for members in sorted(groups.values()):  # by their first unit: forward order
        for uid in members:
            new_id[uid] = len(nodes)
        nodes.append(sorted(n for uid in members for n in unit_nodes[uid]))
        storages.append([s for uid in members for s in unit_storages[uid]])
    reasons: dict[int, str] = {}
    for uid, why in pinned.items():
        reasons.setdefault(new_id[uid], why)
    return nodes, storages, {new_id[a]: new_id[b] for a, b in side_of.items()}, reasons


def _algorithm_ops(graph: Graph, profile) -> dict[str, tuple[int, int | None, dict]]:
    """The convolutions whose algorithm options were measured: site -> (forward op,
    backward op or None, the profile's options)."""
    from monet_like.variants import algorithm_sites

    measured = getattr(profile, "algorithms", None) or {}
    op_index = {op.name: op.index for op in graph.ops}
    found = {}
    for site in algorithm_sites(graph):
        options = measured.get(site["id"])
        fwd = op_index.get(site["forward"][0])
        if options is None or fwd is None:
            continue  # not measured: it runs PyTorch's choice, with the profiled workspace
        found[site["id"]] = (fwd, op_index.get(site["backward"]), options)
    return found


def _pareto(options: list[Option]) -> tuple[Option, ...]:
    """The options no other beats on both time and workspace (ties: the first kept)."""
    front: list[Option] = []
    for o in sorted(options, key=lambda o: (o[1], o[2])):
        if not front or o[2] < front[-1][2]:
            front.append(o)
    return tuple(front)


def _backward_options(options: dict, scale: float, grad_bytes: int) -> tuple[Option, ...]:
    """Every (backward-data, backward-weight) pair of measured algorithms, its time
    multiplied by `scale` (`grad_bytes`: the weight gradient's, `backward_option`)."""
    data = [row[0] for row in options.get("data", [[-1]])]
    weight = [row[0] for row in options.get("weight", [[-1]])]
    pairs = [((d, w), *backward_option(options, d, w, grad_bytes)) for d in data for w in weight]
    return _pareto([(algos, t * scale, ws) for algos, t, ws in pairs])


def _choices(graph: Graph, profile, reference, stages, unit_of_storage):
    """The choosable variant sites as Choices; their stages' `need` keeps only what is
    needed whichever option runs."""
    import dataclasses

    from monet_like.variants import choosable
    from monet_like.variants.sites import encoded_names

    sites = choosable(graph)
    if not sites:
        return stages, []
    op_index = {op.name: op.index for op in graph.ops}
    stage_of = {i: t for t, st in enumerate(stages) for i in st.ops}
    forward_s = {n.name: n.forward_s for n in profile.nodes}
    backward_s = {n.name: n.backward_s for n in profile.nodes}
    reference_backward_s = {n.name: n.backward_s for n in reference.nodes}

    def units_of(storage_ids) -> set[int]:
        return {unit_of_storage[s] for s in storage_ids if s in unit_of_storage}

    by_stage: dict[int, list[tuple[dict, int]]] = {}
    for site in sites:
        i = op_index.get(site["backward"])
        if i is None or i not in stage_of:
            continue
        by_stage.setdefault(stage_of[i], []).append((site, i))
    choices = []
    for t, entries in sorted(by_stage.items()):
        stage = stages[t]
        choice_ops = {i for _, i in entries}
        always = units_of(s for i in stage.ops if i not in choice_ops for s in graph.ops[i].reads)
        either: list[tuple[int, set[int]]] = []  # (the site's op, either option's units)
        for site, i in entries:
            on = units_of(graph.ops[i].reads)
            read = encoded_names(["list", site["original"]["args"]])
            off = units_of(s for name in read for s in graph.values[name])
            optional = units_of(s for n in site["forward"] for s in graph.values.get(n, ()))
            either.append((i, on | (off - always)))
            choices.append(
                Choice(
                    site=site["id"],
                    stage=t,
                    on_units=tuple(sorted(on - always)),
                    off_units=tuple(sorted(off - always)),
                    optional_units=tuple(sorted(optional)),
                    on_s=backward_s.get(site["owner"], 0.0)
                    + sum(forward_s.get(n, 0.0) for n in site["forward"]),
                    off_s=reference_backward_s.get(site["owner"], 0.0),
                )
            )
        # Either option's units count from the site's op back to the stage's start.
        by_op = tuple(
            (first, live, tuple(sorted(set(reads).union(*(u for i, u in either if i >= first)))))
            for first, live, reads in stage.by_op
        )
        stages[t] = dataclasses.replace(stage, need=tuple(sorted(always)), by_op=by_op)
    return stages, choices
