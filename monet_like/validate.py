"""The schedule validator: a replay reads exactly what eager PyTorch's step reads.

Every schedule is checked here when it is built, whether the solver just made it or
it was loaded from a file. The check walks the schedule's steps over the storages of
the traced module (from its fake values, aliasing included) and holds each read to
the eager step's:

- every value a step reads was computed (or recomputed) before it and not yet freed;
- each storage it reads has had exactly as many in-place writes as in eager order
  (a recomputation that reads a value an op has since overwritten, a backward op
  moved before or after a write, are refused);
- no op that draws random numbers (dropout, drop_path's `bernoulli_`, `rand`) runs
  twice;
- the gradients and outputs handed back are the final versions of their storages.

A failure raises `ScheduleError` with one line that names the op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_flatten

from monet_like.errors import UserError
from monet_like.graph import RUNNING_STAT_WRITERS, written_args

if TYPE_CHECKING:
    from monet_like.schedule import Schedule


ORIGINAL = -1  # version of a value computed in the forward pass (schedule.Step.version)


class ScheduleError(UserError):
    """A schedule that would not replay the eager step exactly on this graph."""


def _storages(node: torch.fx.Node) -> tuple:
    from torch.multiprocessing.reductions import StorageWeakRef

    return tuple(
        StorageWeakRef(t.untyped_storage())
        for t in tree_flatten(node.meta.get("val"))[0]
        if isinstance(t, torch.Tensor)
    )


def is_random(node: torch.fx.Node) -> bool:
    """Whether the op draws from the random number generator."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _eager_facts(gm: torch.fx.GraphModule):
    """Per call_function node in eager order: the storages of each input node, the
    storages it writes in place, and for each storage it reads, how many in-place
    writes it has had before; and the final write count of every storage."""
    writes_so_far: dict = {}
    expected: dict[str, dict] = {}
    written: dict[str, list] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        seen = {}
        for arg in n.all_input_nodes:
            for s in _storages(arg):
                seen[s] = writes_so_far.get(s, 0)
        expected[n.name] = seen
        w = [s for arg in written_args(n) for s in _storages(arg)]
        written[n.name] = w
        for s in dict.fromkeys(w):
            writes_so_far[s] = writes_so_far.get(s, 0) + 1
    return expected, written, writes_so_far


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every step of `schedule` reads what eager reads."""
    gm = schedule.fx
    nodes = {n.name: n for n in gm.graph.nodes}
    expected, written, final = _eager_facts(gm)
    storages = {name: _storages(n) for name, n in nodes.items()}
    # (fx name, version) -> {storage: instance}; an instance is one physical copy of a
    # storage (the forward pass's, or one recomputation's), with its own write count
    instance: dict[tuple[str, int], dict] = {}
    count: dict[int, int] = {}
    next_id = 0

    def fresh() -> int:
        nonlocal next_id
        next_id += 1
        count[next_id] = 0
        return next_id

    held: set = set()  # storages of placeholders and constants
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            instance[(n.name, ORIGINAL)] = {s: fresh() for s in storages[n.name]}
            held.update(storages[n.name])
    alive = set(instance)
    for k, step in enumerate(schedule.steps):
        node = nodes.get(step.node)
        if node is None:
            raise ScheduleError(f"step {k} runs {step.node}, which this graph does not have")
        where = f"{step.node} ({'forward' if step.stage < 0 else f'stage {step.stage}'})"
        if step.version != ORIGINAL and is_random(node):
            raise ScheduleError(f"{where} would recompute a random op: its draw would differ")
        # BatchNorm's running statistics never reach its outputs in training, and a
        # recomputation updates copies of them (schedule.Executor): not held to eager's.
        stats = getattr(node.target, "__name__", "").split(".")[0] in RUNNING_STAT_WRITERS
        by_storage: dict = {}
        for key in step.reads:
            if key not in alive:
                raise ScheduleError(
                    f"{where} reads {key[0]} (version {key[1]}), which is not computed or"
                    " already freed at that point"
                )
            for s, inst in instance[key].items():
                want = expected.get(step.node, {}).get(s, 0)
                if count[inst] != want and not (stats and s in held):
                    raise ScheduleError(
                        f"{where} reads {key[0]} after {count[inst]} in-place writes to its"
                        f" storage, where eager PyTorch reads it after {want}"
                    )
                by_storage[s] = inst
        for s in dict.fromkeys(written.get(step.node, ())):
            if not (stats and s in held and step.version != ORIGINAL):
                count[by_storage[s]] += 1
        if getattr(node.target, "__name__", "") == "getitem":
            parent = instance[step.reads[0]] if step.reads else {}
            instance[(step.node, step.version)] = {
                s: parent[s] if s in parent else fresh() for s in storages[step.node]
            }
        else:
            instance[(step.node, step.version)] = {
                s: by_storage[s] if s in by_storage else fresh() for s in storages[step.node]
            }
        alive.add((step.node, step.version))
        for key in schedule.free_after[k]:
            alive.discard(key)
    handed = [(o, ORIGINAL) for o in schedule.outputs if o] + [g for g in schedule.grads if g]
    for key in handed:
        if key not in instance:
            raise ScheduleError(f"the schedule never computes {key[0]}, an output or gradient")
        for s, inst in instance[key].items():
            if count[inst] != final.get(s, 0):
                raise ScheduleError(f"{key[0]} is handed back before its last in-place write")
