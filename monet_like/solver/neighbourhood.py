"""Large-neighbourhood search: a schedule improved one place of the network at a time.

A MILP over a large model is hard for a branch and bound, but most of its binaries are
tied to one place in the network, and a schedule is improved one place at a time: pin
every unit's keep decision (and its variant and algorithm choices) outside a window of
consecutive units to the best schedule's, and the rest is a small MILP that the solver
solves in seconds, from the best schedule (as its start, or as the cost to beat where
the solver takes no start). Two searches use it:

- `shrink_peak`, for the smallest budget. The min-memory MILP of ResNet-50 at batch
  184 in the full mode went from 3.93 to 3.62 GB in 19 minutes with HiGHS; on another
  profile of the same model windows took the schedule of the MILP with its choices
  pinned from 3.95 to 3.39 GB in 84 s.
- `lower_cost`, for the least recomputation within a budget, used where the solver
  takes no start (CBC through cylp): on the same model at 6 GB, CBC's windows took the
  start from 4.73 to 3.51 s of recomputation in 300 s (docs/solver.md).

Windows of `width` units slide in steps of half a window, in a shuffled order drawn
from a fixed seed (so a run is repeatable up to the solver's time limits); a sweep that
improves nothing doubles the width, and once a window covers every unit the last solve
is the whole problem, from the best schedule, for the time left (`shrink_peak`; after
`lower_cost` the caller's own search solves it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from monet_like.solver.backends import RawResult
from monet_like.solver.evaluate import evaluate
from monet_like.solver.formulation import Formulation
from monet_like.solver.milp import solve_formulation
from monet_like.units import GIB

WIDTH = 40  # units per window at first (ResNet-50 has about 200 to 260 units)
SUB_TIME_LIMIT = 30.0  # seconds per window's solve


def _pins_outside(f: Formulation, window: range, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(columns, values) pinning to `x` the decisions of every unit outside `window`:
    its keep column, and the variant and algorithm choices placed at it."""
    inside = set(window)
    problem = f.problem
    cols = [f.keep[u] for u in range(len(problem.units)) if u not in inside]
    for k, choice in enumerate(problem.choices):
        units = (*choice.on_units, *choice.off_units, *choice.optional_units)
        if not inside.intersection(units):
            cols.extend((f.on_col[k], f.off_col[k]))
    for k, algorithm in enumerate(problem.algorithms):
        if algorithm.unit not in inside:
            cols.extend(f.fwd_cols[k])
            cols.extend(f.bwd_cols[k])
    cols = np.asarray(cols, dtype=int)
    return cols, x[cols].astype(float)


def _search(
    f: Formulation,
    x: np.ndarray,
    score: Callable[[np.ndarray], tuple],
    solve: Callable[[float | None, tuple | None, np.ndarray], RawResult],
    deadline: float | None,
    width: int,
    sub_time_limit: float,
    report: Callable[[tuple, str], None],
    whole_last: bool = True,
    good_enough: Callable[[tuple], bool] | None = None,
) -> np.ndarray:
    """The window search: `solve(time_limit, pins, best)` re-solves a window (pins None:
    the whole problem); a schedule of lower `score` replaces the best, and `report` is
    told of each one whose score's first entry is lower (with where it was found).
    Without `whole_last` it ends where a window would cover every unit; it ends at once
    when `good_enough(best score)`."""
    n_units = len(f.problem.units)
    best, best_score = x, score(x)
    if good_enough is not None and good_enough(best_score):
        return best
    rng = np.random.default_rng(0)
    width = max(1, width)
    while True:
        whole = width >= n_units
        if whole and not whole_last:
            return best
        starts = [0] if whole else list(range(0, n_units - width // 2, max(1, width // 2)))
        rng.shuffle(starts)
        improved = False
        for lo in starts:
            remaining = None if deadline is None else deadline - time.perf_counter()
            if remaining is not None and remaining < 1.0:
                return best
            limit = remaining if whole else min(sub_time_limit, remaining or sub_time_limit)
            pins = None if whole else _pins_outside(f, range(lo, lo + width), best)
            raw = solve(limit, pins, best)
            if raw.x_bool is None:
                continue
            new_score = score(raw.x_bool)
            if new_score < best_score:
                lower = new_score[0] < best_score[0]
                improved = improved or lower
                best, best_score = raw.x_bool, new_score
                if lower:
                    where = "" if whole else f" (units {lo} to {min(lo + width, n_units) - 1})"
                    report(new_score, where)
                if good_enough is not None and good_enough(best_score):
                    return best
        if whole:
            return best
        if not improved:
            width *= 2


def shrink_peak(
    f: Formulation,
    x: np.ndarray,
    solver: str,
    deadline: float | None,
    progress: Callable[[str], None] | None = None,
    width: int = WIDTH,
    sub_time_limit: float = SUB_TIME_LIMIT,
    target_bytes: int | None = None,
) -> np.ndarray:
    """The schedule of least peak (then least recomputation) found from `x` by windows
    re-solved in turn until `deadline` (a `time.perf_counter()` value; None: until the
    whole problem has been solved once), or until one peaks at most `target_bytes`.
    Never worse than `x`."""

    def score(y: np.ndarray) -> tuple[int, float]:  # the peak, then the recomputation
        return evaluate(f, y)["peak_bytes"], float(f.cost @ y)

    def solve(limit, pins, best) -> RawResult:
        return solve_formulation(
            f, None, solver, time_limit=limit, gap=1e-4, start=best, pins=pins, workers=1
        )

    def report(new_score, where) -> None:  # not for less recomputation alone
        if progress is not None:
            progress(f"smallest budget: {new_score[0] / GIB:.4f} GB{where}")

    def reached(best_score) -> bool:
        return target_bytes is not None and best_score[0] <= target_bytes

    return _search(f, x, score, solve, deadline, width, sub_time_limit, report, good_enough=reached)


def lower_cost(
    f: Formulation,
    x: np.ndarray,
    budget_bytes: int,
    solver: str,
    deadline: float | None,
    progress: Callable[[str], None] | None = None,
    width: int = WIDTH,
    sub_time_limit: float = SUB_TIME_LIMIT,
) -> np.ndarray:
    """The schedule of least recomputation within `budget_bytes` found from `x` (which
    fits it) by windows re-solved in turn until `deadline`, or until a window would
    cover the whole network (the caller's own search solves the whole problem). Never
    worse than `x`. Each window's solve asks for a schedule cheaper than the best
    (`cutoff_ms`), so a solver that takes no start does not search among the costlier
    ones."""

    def score(y: np.ndarray) -> tuple[float]:
        fits = evaluate(f, y)["peak_bytes"] <= budget_bytes
        return (float(f.cost @ y) if fits else np.inf,)

    def solve(limit, pins, best) -> RawResult:
        cutoff = float(f.cost @ best) * (1 - 1e-6)
        return solve_formulation(
            f, budget_bytes, solver, time_limit=limit, gap=1e-4, start=best, pins=pins,
            workers=1, cutoff_ms=cutoff,
        )  # fmt: skip

    def report(new_score, where) -> None:
        if progress is not None:
            progress(f"schedule improved: {new_score[0] * 1e-3:.3f} s of recomputation{where}")

    return _search(f, x, score, solve, deadline, width, sub_time_limit, report, False)
