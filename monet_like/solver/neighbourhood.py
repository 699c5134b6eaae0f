"""Large-neighbourhood search for the min-memory problem.

The min-memory MILP of a large model is hard for a branch and bound: on ResNet-50 at
batch 184 in the full mode, HiGHS went from 3.93 to 3.62 GB in 19 minutes. Most of its
binaries are tied to one place in the network, though, and a schedule is improved one
place at a time: pin every unit's keep decision (and its variant and algorithm
choices) outside a window of consecutive units to the best schedule's, and the rest
is a small MILP that HiGHS solves in seconds, from the best schedule as its start. On
another profile of the same model such windows took the schedule of the MILP with its
choices pinned from 3.95 to 3.39 GB in 84 s.

Windows of `width` units slide in steps of half a window, in a shuffled order drawn
from a fixed seed (so a run is repeatable up to the solver's time limits); a sweep that
improves nothing doubles the width, and once a window covers every unit the last solve
is the whole problem, from the best schedule, for the time left (it may prove it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from monet_like.solver.milp import Formulation, evaluate, solve_formulation
from monet_like.units import GIB

WIDTH = 40  # units per window at first (ResNet-50 has about 200 to 260 units)
SUB_TIME_LIMIT = 30.0  # seconds per window's solve


def _score(f: Formulation, x: np.ndarray) -> tuple[int, float]:
    """What the min-memory problem minimizes: the peak, then the recomputation."""
    return evaluate(f, x)["peak_bytes"], float(f.cost @ x)


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


def shrink_peak(
    f: Formulation,
    x: np.ndarray,
    solver: str,
    deadline: float | None,
    progress: Callable[[str], None] | None = None,
    width: int = WIDTH,
    sub_time_limit: float = SUB_TIME_LIMIT,
) -> np.ndarray:
    """The schedule of least peak (then least recomputation) found from `x` by windows
    re-solved in turn until `deadline` (a `time.perf_counter()` value; None: until the
    whole problem has been solved once). Never worse than `x`."""
    n_units = len(f.problem.units)
    best, best_score = x, _score(f, x)
    rng = np.random.default_rng(0)
    width = max(1, width)

    def left() -> float | None:
        return None if deadline is None else deadline - time.perf_counter()

    while True:
        whole = width >= n_units
        starts = [0] if whole else list(range(0, n_units - width // 2, max(1, width // 2)))
        rng.shuffle(starts)
        improved = False
        for lo in starts:
            remaining = left()
            if remaining is not None and remaining < 1.0:
                return best
            limit = remaining if whole else min(sub_time_limit, remaining or sub_time_limit)
            pins = None if whole else _pins_outside(f, range(lo, lo + width), best)
            raw = solve_formulation(
                f, None, solver, time_limit=limit, gap=1e-4, start=best, pins=pins, workers=1
            )
            if raw.x_bool is None:
                continue
            score = _score(f, raw.x_bool)
            if score < best_score:
                lower = score[0] < best_score[0]
                improved = improved or lower
                best, best_score = raw.x_bool, score
                if progress is not None and lower:  # not for less recomputation alone
                    progress(
                        f"smallest budget: {score[0] / GIB:.4f} GB"
                        + ("" if whole else f" (units {lo} to {min(lo + width, n_units) - 1})")
                    )
        if whole:
            return best
        if not improved:
            width *= 2
