"""A feasible start for the MILP: a greedy checkpointing schedule.

The solver is handed a schedule that already fits, so a time-limited solve has a
valid answer from its first second. The heuristic tries units in order of bytes
freed per second of recomputation and recomputes each dropped unit just in time:
at every backward stage, what the stage needs is either kept, still in memory from
the previous stage, or recomputed from its inputs (themselves kept, carried or
recomputed). A drop stays when it does not raise the exact peak under the MILP's
own memory model (`milp.evaluate`); the heuristic stops as soon as the peak fits
the budget, or after a few passes over the order.
"""

from __future__ import annotations

import numpy as np

from monet_like.solver.milp import Formulation, evaluate, lean_choices


class _MustKeep(Exception):
    def __init__(self, unit: int) -> None:
        self.unit = unit


def assignment(f: Formulation, kept: np.ndarray) -> np.ndarray:
    """The 0/1 columns of the just-in-time schedule that keeps `kept`. Raises _MustKeep
    with a dropped unit that no schedule of this shape can do without (a random unit,
    or an input beyond the recomputation depth)."""
    units = f.problem.units
    x = np.zeros(f.n_bool, dtype=int)
    x[f.keep[kept]] = 1
    x[f.on_col] = 1  # every variant runs: what the needs below assume
    variant_needs: dict[int, set[int]] = {}
    for c in f.problem.choices:
        variant_needs.setdefault(c.stage, set()).update(c.on_units)
    previous: set[int] = set()  # units present during the previous stage
    for t, stage in enumerate(f.problem.stages):
        cand = set(f.cand[t])
        present = {u for u in f.cand[t] if kept[u]}
        needs = set(stage.need) | variant_needs.get(t, set())
        stack = [u for u in needs if u not in present]
        recompute: set[int] = set()
        while stack:
            u = stack.pop()
            if u in present:
                continue
            present.add(u)
            if u in previous:  # still there: carry it over
                continue
            if (t, u) not in f.r_index:
                raise _MustKeep(u)
            recompute.add(u)
            for v in units[u].inputs:
                if v in cand:
                    stack.append(v)
                elif not kept[v]:
                    raise _MustKeep(v)
        for u in present:
            x[f.r_index[t, u] if u in recompute else f.s_index[t, u]] = 1
        previous = present
    _lean_algorithms(f, x)
    return x


def _lean_algorithms(f: Formulation, x: np.ndarray) -> None:
    """Every convolution runs its least-workspace options, recomputations included."""
    cols, values = lean_choices(f)
    x[cols] = values
    chosen = f.chosen_options(x)
    for (t, u), options in f.rec_alg.items():
        if x[f.r_index[t, u]]:
            x[options[chosen[f.algorithm_of[u]][0]]] = 1


def _fit(f: Formulation, kept: np.ndarray) -> np.ndarray:
    """The assignment for `kept`, keeping whatever it cannot do without (in place)."""
    while True:
        try:
            return assignment(f, kept)
        except _MustKeep as exc:
            kept[exc.unit] = True


def greedy_start(f: Formulation, budget_bytes: int, passes: int = 3) -> np.ndarray | None:
    """Binary columns of a schedule within `budget_bytes`, or None if the greedy finds
    none (the solver then starts from scratch).

    Units are tried in order of bytes per second of recomputation; a drop is kept
    when it does not raise the peak (dropping a value can raise it: recomputing it
    brings its inputs back at a later stage)."""
    units = f.problem.units
    kept = np.ones(len(units), dtype=bool)
    x = _fit(f, kept)
    peak = evaluate(f, x)["peak_bytes"]
    optional = {u for c in f.problem.choices for u in c.optional_units}
    order = sorted(
        (u.id for u in units if not u.random and u.side_of is None and u.id not in optional),
        key=lambda u: units[u].bytes / (units[u].recompute_s + 1e-9),
        reverse=True,
    )
    for _ in range(passes):
        changed = False
        for u in order:
            if peak <= budget_bytes:
                return x
            if not kept[u]:
                continue
            trial = kept.copy()
            trial[u] = False
            x_trial = _fit(f, trial)
            if trial[u]:
                continue  # the unit cannot be dropped
            trial_peak = evaluate(f, x_trial)["peak_bytes"]
            if trial_peak <= peak:
                kept, x, peak, changed = trial, x_trial, trial_peak, True
        if not changed:
            break
    return x if peak <= budget_bytes else None
