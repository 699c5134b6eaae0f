"""Stage 4: from Graph + Solution to an executable Schedule, and the executor that runs it.

A schedule is the captured joint graph's own aten ops, in order: the forward ops,
then for each backward stage the recomputations the solution placed just before
it, then the stage's backward ops. Every value is freed right after its last use
in that order; a value that is recomputed gets a new version, and readers take
the newest version present. So what stays alive after the forward pass is exactly
what the backward pass reads from it: the kept units (and views of parameters),
not the dropped ones.

Recomputation never updates BatchNorm running statistics a second time (a
buffer an op would write is replaced by a throwaway copy during recomputation),
and a unit holding a random op (dropout) is never recomputed: the solver keeps it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from monet_like.graph import BACKWARD, FORWARD, RUNNING_STAT_WRITERS, Graph, tangents_for
from monet_like.solution import Solution
from monet_like.validate import ORIGINAL, ScheduleError, validate
from monet_like.variants import select

if TYPE_CHECKING:
    from monet_like.profile import Profile


@dataclass(frozen=True)
class Step:
    node: str  # fx node name
    version: int  # ORIGINAL, or the stage before which it is recomputed
    stage: int  # -1 in the forward pass
    reads: tuple[tuple[str, int], ...]  # (fx name, version) of its tensor inputs


@dataclass
class Schedule:
    fx: torch.fx.GraphModule  # the module whose nodes the steps name
    steps: list[Step]
    n_forward: int  # steps[:n_forward] run in the forward pass
    free_after: list[list[tuple[str, int]]]  # values dropped after each step
    outputs: list[str | None]  # fx names of the model's output leaves
    grads: list[tuple[str, int] | None]  # (fx name, version) of each gradient; None: unused
    n_params: int
    n_buffers: int
    n_tangents: int
    placeholders: list[str]
    recomputed_units: int
    constants: list[str]  # tensor constants lifted onto `fx` (get_attr), read as they are


def build(graph: Graph, solution: Solution) -> Schedule:
    """Lay out the steps of `solution` over `graph` and where each value dies."""
    if graph.fx is None:
        raise ScheduleError("the graph carries no traced module: capture it again")
    if graph.fingerprint != solution.fingerprint:
        raise ScheduleError(
            f"the solution was solved for graph {solution.fingerprint}, this graph is "
            f"{graph.fingerprint}"
        )
    _check_decisions(graph, solution)
    # Variant sites the solver turned off run the aten op they replaced; the forward
    # ops such a variant added are gone from the module, and skipped below.
    gm = select(graph, solution.variants_off, solution.algorithms).fx
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    getitems: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "getitem":
            getitems.setdefault(n.args[0].name, []).append(n.name)

    def with_getitems(name: str) -> list[str]:
        return [name, *getitems.get(name, [])] if name in fx_nodes else []

    steps: list[Step] = []
    latest: dict[str, int] = {}

    def emit(name: str, version: int, stage: int) -> None:
        reads = tuple((a.name, latest[a.name]) for a in fx_nodes[name].all_input_nodes)
        steps.append(Step(name, version, stage, reads))
        latest[name] = version

    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    constants = [n.name for n in gm.graph.nodes if n.op == "get_attr"]
    for name in placeholders + constants:
        latest[name] = ORIGINAL
    for op in graph.ops:
        if op.phase == FORWARD:
            for name in with_getitems(op.name):
                emit(name, ORIGINAL, -1)
    n_forward = len(steps)

    unit_ops = [
        sorted(i for nid in nodes for i in graph.nodes[nid].ops) for nodes in solution.units
    ]
    unit_names = [[n for i in ops for n in with_getitems(graph.ops[i].name)] for ops in unit_ops]
    recomputed_version: dict[int, int] = {}  # unit -> stage of the version readers take
    recomputed = 0
    for t, stage in enumerate(solution.stages):
        # A recomputed version lasts while the unit stays a candidate (the solver's S
        # variables); outside, readers take the forward pass's value, which the solver
        # then guarantees was kept.
        candidates = set(stage.get("candidates", ()))
        for u in [u for u in recomputed_version if u not in candidates]:
            del recomputed_version[u]
            for name in unit_names[u]:
                latest[name] = ORIGINAL
        for u in stage["recompute"]:
            recomputed_version[u] = t
            recomputed += 1
        # In forward op order, not unit by unit: a unit can read one with a higher id
        # (a residual add_ joins the unit of the BatchNorm it writes into, and reads the
        # shortcut's, numbered later); unit order made it read the stale forward value,
        # held alive, uncounted, all along.
        for i in sorted(i for u in stage["recompute"] for i in unit_ops[u]):
            for name in with_getitems(graph.ops[i].name):
                emit(name, t, t)
        for i in stage["ops"]:
            if graph.ops[i].phase != BACKWARD:
                raise ScheduleError(f"stage {t} lists forward op {graph.ops[i].name}")
            for name in with_getitems(graph.ops[i].name):
                emit(name, ORIGINAL, t)

    out_args = list(gm.graph.output_node().args[0])
    n_leaves = graph.out_spec.num_leaves
    outputs = [a.name if isinstance(a, torch.fx.Node) else None for a in out_args[:n_leaves]]
    grads = [
        (a.name, latest[a.name]) if isinstance(a, torch.fx.Node) else None
        for a in out_args[n_leaves:]
    ]

    # Liveness: a value dies after its last reader; gradients and outputs are read at the
    # end of their pass.
    last: dict[tuple[str, int], int] = {}
    for k, step in enumerate(steps):
        last.setdefault((step.node, step.version), k)
        for key in step.reads:
            last[key] = k
    never = len(steps)  # gradients are handed to autograd, never freed here
    for g in grads:
        if g is not None:
            last[g] = never
    for o in outputs:  # handed to the user at the end of the forward pass
        if o is not None:
            last[(o, ORIGINAL)] = max(last.get((o, ORIGINAL), 0), n_forward - 1)
    free_after: list[list[tuple[str, int]]] = [[] for _ in steps]
    held = set(placeholders) | set(constants)
    for key, k in last.items():
        if key[0] not in held and k < never:
            free_after[k].append(key)

    n_tangents = sum(s.kind == "seed" for s in graph.storages)
    n_params = sum(1 for s in graph.storages if s.kind == "param")
    n_buffers = len(placeholders) - n_params - 1 - n_tangents
    schedule = Schedule(
        fx=gm,
        steps=steps,
        n_forward=n_forward,
        free_after=free_after,
        outputs=outputs,
        grads=grads,
        n_params=n_params,
        n_buffers=n_buffers,
        n_tangents=n_tangents,
        placeholders=placeholders,
        recomputed_units=recomputed,
        constants=constants,
    )
    validate(schedule)
    return schedule


def _check_decisions(graph: Graph, solution: Solution) -> None:
    """The decisions fit this graph: node ids in range, each node in one unit at most,
    and the stages' ops the backward pass's, each once and in order."""
    n_nodes = len(graph.nodes)
    seen: set[int] = set()
    for u, nodes in enumerate(solution.units):
        bad = [n for n in nodes if n >= n_nodes or n in seen]
        if bad:
            raise ScheduleError(
                f"unit {u} names node {bad[0]}, which is out of range or in another unit"
            )
        seen.update(nodes)
    backward = [op.index for op in graph.ops if op.phase == BACKWARD]
    listed = [i for stage in solution.stages for i in stage["ops"]]
    if listed != backward:
        where = next(
            (k for k, (a, b) in enumerate(zip(listed, backward, strict=False)) if a != b),
            min(len(listed), len(backward)),
        )
        raise ScheduleError(
            f"the stages list {len(listed)} backward ops where the graph runs {len(backward)}"
            f" (they part at position {where}): each must run once, in eager order"
        )


def check_budget(graph: Graph, schedule: Schedule, solution: Solution) -> int:
    """The schedule's peak simulated on fake tensors with the workspace the file records;
    ScheduleError when it exceeds the solution's budget. Returns the peak."""
    op_index = {op.name: op.index for op in graph.ops}
    workspace = {op_index[n]: b for n, b in solution.workspace.items() if n in op_index}
    peak = simulate(graph, schedule, workspace)
    if peak > solution.budget_bytes:
        raise ScheduleError(
            f"the schedule's simulated peak, {peak} bytes, exceeds its budget of "
            f"{solution.budget_bytes}: the file's decisions do not fit; solve again"
        )
    return peak


def _no_autocast():
    """Autocast off on every device type it may be on, for the duration."""
    import contextlib

    stack = contextlib.ExitStack()
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


class _Program:
    """Python source for steps [start, stop) of a schedule, compiled once.

    Each value is a local variable; a free is `del`, so a step costs one call and no
    lookups (the replay's Python cost is paid on every training step). Values from
    earlier segments are read from `env` at the top, and those alive at the end are
    stored back into it."""

    def __init__(
        self, executor: Executor, start: int, stop: int, handed: frozenset, hooked: bool
    ) -> None:
        s = executor.schedule
        self.names: dict = {}  # (fx name, version) -> local
        self.globals: dict = {}
        lines = []
        created = {(s.steps[k].node, s.steps[k].version) for k in range(start, stop)}
        loaded: set = set()
        for k in range(start, stop):
            for key in s.steps[k].reads:
                if key not in created and key not in loaded:
                    loaded.add(key)
                    lines.append(f"{self._local(key)} = env[{self._const(key)}]")
        freed_here: set = set()
        for k in range(start, stop):
            step = s.steps[k]
            node = executor.fx_nodes[step.node]
            version = dict(step.reads)
            protect = step.version != ORIGINAL and executor.writes_buffers(node)
            buffers = executor.buffer_names if protect else set()
            args = [self._expr(a, version, buffers) for a in node.args]
            again = "" if step.version == ORIGINAL else f", recomputed for stage {step.version}"
            local = self._local((step.node, step.version))
            if node.target is operator.getitem and not node.kwargs:
                # a subscript, not a call: a third of a network's steps take an output
                lines.append(f"{local} = {args[0]}[{args[1]}]  # {step.node}{again}")
            else:
                call = ", ".join(
                    args + [f"{name}={self._expr(a, version)}" for name, a in node.kwargs.items()]
                )
                target = self._const(node.target)
                lines.append(f"{local} = {target}({call})  # {step.node}{again}")
            if hooked:
                lines.append(f"hook({k})")
            for key in s.free_after[k]:
                local = self._local(key)
                if key in handed:
                    lines.append(f"handed_out[{self._const(key)}] = {local}")
                if key in loaded:
                    lines.append(f"env.pop({self._const(key)}, None)")
                lines.append(f"del {local}")
                freed_here.add(key)
        for key in created - freed_here:
            lines.append(f"env[{self._const(key)}] = {self._local(key)}")
        body = "".join(f"    {line}\n" for line in lines) or "    pass\n"
        source = f"def segment(env, handed_out, hook):\n{body}"
        self.globals["_clone"] = _clone
        exec(compile(source, f"<schedule steps {start}-{stop}>", "exec"), self.globals)
        self.run = self.globals["segment"]
        self.source = source

    def _expr(self, a, version: dict, buffers: set = frozenset()) -> str:
        """Source for argument `a`: a local for a node (a copy for a buffer in
        `buffers`), a global for a constant, literals for the containers holding nodes."""
        if isinstance(a, torch.fx.Node):
            local = self._local((a.name, version[a.name]))
            return f"_clone({local})" if a.name in buffers else local
        if not _holds_node(a):
            return self._const(a)
        if isinstance(a, (list, tuple)):
            items = "".join(f"{self._expr(b, version)}, " for b in a)
            return f"[{items}]" if isinstance(a, list) else f"({items})"
        if isinstance(a, dict):
            items = ", ".join(f"{self._const(k)}: {self._expr(b, version)}" for k, b in a.items())
            return f"{{{items}}}"
        if isinstance(a, slice):
            parts = (self._expr(b, version) for b in (a.start, a.stop, a.step))
            return f"slice({', '.join(parts)})"
        raise ScheduleError(f"an op takes an argument of type {type(a).__name__} holding values")

    def _local(self, key) -> str:
        return self.names.setdefault(key, f"v{len(self.names)}")

    def _const(self, value) -> str:
        if value is None or type(value) in (bool, int):
            return repr(value)
        name = f"c{len(self.globals)}"
        self.globals[name] = value
        return name


def _clone(a):
    return None if a is None else a.clone()


def _holds_node(value) -> bool:
    found: list = []
    torch.fx.node.map_arg(value, found.append)
    return bool(found)


class Executor:
    """Runs a Schedule's steps on tensors (real, or fake for simulation)."""

    def __init__(self, graph: Graph, schedule: Schedule) -> None:
        self.schedule = schedule
        self.fx_nodes = {n.name: n for n in schedule.fx.graph.nodes}
        self.on_step = None  # called after each step with its index (simulation hooks in)
        first = schedule.n_params
        self.buffer_names = set(schedule.placeholders[first : first + schedule.n_buffers])
        self._programs: dict = {}

    def writes_buffers(self, node: torch.fx.Node) -> bool:
        """Whether the op may write a buffer it reads (BatchNorm's running statistics):
        recomputed, it is given copies. `native_batch_norm` writes its running stats
        without declaring it in its schema, so it is named here; other ops are caught
        by their schema."""
        schema = getattr(node.target, "_schema", None)
        name = getattr(node.target, "__name__", "").split(".")[0]
        return name in RUNNING_STAT_WRITERS or (schema is not None and schema.is_mutable)

    def run(self, env: dict, start: int, stop: int, handed_out: dict | None = None) -> None:
        """Run steps [start, stop). Values in `handed_out` are stored there before our
        own reference to them is dropped (the model's outputs go to the user)."""
        handed = frozenset(handed_out or ())
        hooked = self.on_step is not None
        key = (start, stop, handed, hooked)
        if key not in self._programs:
            self._programs[key] = _Program(self, start, stop, handed, hooked)
        with _no_autocast():  # the graph's ops are post-autocast: its casts are steps
            self._programs[key].run(env, handed_out, self.on_step)

    def constant_values(self) -> list[torch.Tensor]:
        """The tensor constants the traced module holds, in `schedule.constants` order."""
        from functools import reduce

        fx = self.schedule.fx
        return [
            reduce(getattr, self.fx_nodes[n].target.split("."), fx) for n in self.schedule.constants
        ]

    def forward(self, params, buffers, x) -> tuple[dict, list]:
        """Run the forward steps; return what the backward pass needs, and the outputs."""
        s = self.schedule
        env: dict = {}
        for name, v in zip(s.placeholders, [*params, *buffers, x], strict=False):
            env[(name, ORIGINAL)] = v
        for name, v in zip(s.constants, self.constant_values(), strict=True):
            env[(name, ORIGINAL)] = v
        handed_out = {(o, ORIGINAL): None for o in s.outputs if o}
        self.run(env, 0, s.n_forward, handed_out)
        outputs = [
            env.get((o, ORIGINAL), handed_out.get((o, ORIGINAL))) if o else None for o in s.outputs
        ]
        return env, outputs

    def backward(self, env: dict, tangents: list[torch.Tensor]) -> list:
        s = self.schedule
        for name, t in zip(s.placeholders[-s.n_tangents :], tangents, strict=True):
            env[(name, ORIGINAL)] = t
        self.run(env, s.n_forward, len(s.steps))
        grads = [env.get(g) if g is not None else None for g in s.grads]
        env.clear()
        return grads


def simulate(graph: Graph, schedule: Schedule, workspace: dict[int, int] | None = None) -> int:
    """Peak bytes of one scheduled training step, run on fake tensors (nothing allocated).

    Every storage is counted once while alive, and each op's profiled workspace is
    added while it runs: the prediction a real step is measured against.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from monet_like.memory import LiveStorageTracker

    workspace = workspace or {}
    op_index = {op.name: op.index for op in graph.ops}
    metas = [n.meta["val"] for n in graph.fx.graph.nodes if n.op == "placeholder"]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        values = [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype) for m in metas]
        tangents = tangents_for(graph)
        # the user's loss, a scalar alive through the backward pass (counted throughout,
        # as the memory model does)
        loss = [torch.empty((), dtype=tangents[0].dtype)] if tangents else []
    p, b = schedule.n_params, schedule.n_buffers
    params, buffers, x = values[:p], values[p : p + b], values[p + b]
    executor = Executor(graph, schedule)
    constants = executor.constant_values()
    tracker = LiveStorageTracker([*params, *buffers, x, *constants, *tangents, *loss])
    peak = tracker.current

    def on_step(k: int) -> None:
        nonlocal peak
        extra = workspace.get(op_index.get(schedule.steps[k].node, -1), 0)
        peak = max(peak, tracker.peak, tracker.current + extra)

    executor.on_step = on_step
    with fake_mode, tracker:
        env, outputs = executor.forward(params, buffers, x)
        if not graph.outputs_held:
            del outputs  # the loop computes its loss from them and drops them
        executor.backward(env, tangents)
    return max(peak, tracker.peak)


def finalize(graph: Graph, solution: Solution, profile: Profile | None = None) -> int:
    """Set the solution's predicted peak to its simulated schedule's, with each op's
    workspace from `profile` (a monet_like.profile.Profile of `graph`; the chosen
    convolution algorithms' own); keep the MILP's bound beside it. Returns the
    simulated peak."""
    workspace = None if profile is None else profile.workspace_by_op(graph, solution.algorithms)
    simulated = simulate(graph, build(graph, solution), workspace)
    solution.workspace = {graph.ops[i].name: int(b) for i, b in (workspace or {}).items() if b}
    solution.extra["milp_peak_bound_bytes"] = solution.predicted_peak_bytes
    solution.predicted_peak_bytes = simulated
    solution.predicted_peak_at = "simulated schedule"
    return simulated
