"""A feasible start for the MILP: a checkpointing schedule that already fits.

The solver is handed a schedule within the budget, so a time-limited solve has a
valid answer from its first seconds, and a solver that takes no start (CBC through
cylp) still has one to fall back on. Every schedule here recomputes each dropped unit
just in time: at every backward stage, what the stage needs is either kept, still in
memory from the previous stage, or recomputed from its inputs (themselves kept,
carried or recomputed). Two ways choose what to keep:

- greedy: units in order of bytes freed per second of recomputation, each dropped
  when that does not raise the exact peak under the MILP's own memory model
  (`evaluate.evaluate`); it stalls at budgets far below the store-all peak;
- LP rounding (after Checkmate): the LP relaxation of the MILP at the budget or a
  little below, its keep columns rounded at a few thresholds; the cheapest rounding
  that fits wins. Where none fits, the greedy's drops go on from the rounding
  closest to fitting. It reaches budgets near the smallest feasible one.

The cheaper of the two is then improved by keeping again, one at a time, the
dropped units whose recomputation costs most, while the peak still fits. Last, its
kept units are pinned and the MILP re-solves the rest: when to recompute each
dropped unit, whether to hold a recomputed value for later stages or recompute it
again. With the keep columns fixed that MILP is small and easy (a fraction of a
second on ResNet-50), and it is solved by the solver the user named where that
solver takes pinned columns (HiGHS, CBC through cylp), else by HiGHS. On ResNet-50
at batch 184 and 5 GB it takes the start from 12.95 to 9.29 s of recomputation
(the optimum: 8.21 s).

A solve at or near a smallest budget searched for before (in this process: the
frontier's smallest point; in an earlier one: solve.py at the budget its infeasible
run printed) also gets that search's schedule (`remember_least_peak`, in memory and
in the cache folder): the heuristics above rarely reach such a budget.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import time
from pathlib import Path

import numpy as np

from monet_like.files import atomic_write, cache_dir
from monet_like.solver.backends.highs import relaxation, relaxation_infeasible
from monet_like.solver.evaluate import evaluate
from monet_like.solver.formulation import Formulation, lean_choices
from monet_like.solver.milp import solve_formulation
from monet_like.solver.neighbourhood import shrink_peak

RESCHEDULE_TIME_LIMIT = 30.0  # seconds for the MILP with the keep columns pinned


class _MustKeep(Exception):
    def __init__(self, unit: int) -> None:
        self.unit = unit


def assignment(f: Formulation, kept: np.ndarray, held: np.ndarray | None = None) -> np.ndarray:
    """The 0/1 columns of the just-in-time schedule that keeps `kept`; a dropped unit
    marked in `held` is, once recomputed, carried on to the last stage that needs it
    for as long as it is a candidate, instead of recomputed again. Raises _MustKeep
    with a dropped unit that no schedule of this shape can do without (a random unit,
    or an input beyond the recomputation depth)."""
    units = f.problem.units
    x = np.zeros(f.n_bool, dtype=int)
    x[f.keep[kept]] = 1
    x[f.on_col] = 1  # every variant runs: what the needs below assume
    variant_needs: dict[int, set[int]] = {}
    for c in f.problem.choices:
        variant_needs.setdefault(c.stage, set()).update(c.on_units)
    last_need = np.full(len(units), -1)
    for t, stage in enumerate(f.problem.stages):
        last_need[[*stage.need, *variant_needs.get(t, ())]] = t
    previous: set[int] = set()  # units present during the previous stage
    for t, stage in enumerate(f.problem.stages):
        cand = set(f.cand[t])
        present = {u for u in f.cand[t] if kept[u]}
        if held is not None:
            present |= {u for u in previous if held[u] and u in cand and last_need[u] >= t}
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


def _fit(f: Formulation, kept: np.ndarray, held: np.ndarray | None = None) -> np.ndarray:
    """The assignment for `kept`, keeping whatever it cannot do without (in place)."""
    while True:
        try:
            return assignment(f, kept, held)
        except _MustKeep as exc:
            kept[exc.unit] = True


def greedy_start(f: Formulation, budget_bytes: int, passes: int = 3) -> np.ndarray | None:
    """Binary columns of a schedule within `budget_bytes`, or None if the greedy finds
    none (the solver then starts from scratch).

    Units are tried in order of bytes per second of recomputation; a drop is kept
    when it does not raise the peak (dropping a value can raise it: recomputing it
    brings its inputs back at a later stage)."""
    kept = np.ones(len(f.problem.units), dtype=bool)
    x, peak = _drop_while_not_higher(f, kept, budget_bytes, passes)
    return x if peak <= budget_bytes else None


def store_all_start(f: Formulation) -> np.ndarray:
    """Binary columns of the schedule that keeps every unit it can (as the formulation
    counts it, with the leanest convolution algorithms): no search for the least peak
    may end above it."""
    return _fit(f, np.ones(len(f.problem.units), dtype=bool))


def least_peak_start(f: Formulation) -> np.ndarray:
    """Binary columns of a low-peak schedule found without a solver: from store-all,
    units dropped one at a time while the peak does not rise. The smallest-budget
    search starts its windows from it when its MILP finds no schedule in its time.
    With bridges, holding recomputed values (see `_drop_while_not_higher`) changes
    which drops follow, for better or worse: both ways are tried, the lower kept."""
    kept = np.ones(len(f.problem.units), dtype=bool)
    runs = [_drop_while_not_higher(f, kept, 0, holds=holds) for holds in {bool(f.hold_only), False}]
    return min(runs, key=lambda run: run[1])[0]


def _drop_while_not_higher(
    f: Formulation,
    kept: np.ndarray,
    budget_bytes: int,
    passes: int = 3,
    holds: bool | None = None,
) -> tuple[np.ndarray, int]:
    """From the schedule that keeps `kept`: units dropped, one at a time, while the peak
    does not rise, and with `holds` (default: where `f` has bridges) dropped units held
    from their recomputation to their last use where that lowers the peak (or, at the
    same peak, the recomputation), until it fits `budget_bytes` or `passes` rounds
    change nothing. The schedule reached, and its peak. Without bridges the holds did
    not lower MobileNetV2's or GoogLeNet's least peak and made the greedy 3-4 times
    slower: off there."""
    if holds is None:
        holds = bool(f.hold_only)
    units = f.problem.units
    kept = kept.copy()
    held = np.zeros(len(units), dtype=bool)
    x = _fit(f, kept)
    peak = evaluate(f, x)["peak_bytes"]
    optional = {u for c in f.problem.choices for u in c.optional_units}
    order = sorted(
        (u.id for u in units if u.recomputable and u.id not in optional),
        key=lambda u: units[u].bytes / (units[u].recompute_s + 1e-9),
        reverse=True,
    )
    for _ in range(passes):
        changed = False
        for u in order:
            if peak <= budget_bytes:
                return x, peak
            if not kept[u]:
                continue
            trial = kept.copy()
            trial[u] = False
            x_trial = _fit(f, trial, held)
            if trial[u]:
                continue  # the unit cannot be dropped
            trial_peak = evaluate(f, x_trial)["peak_bytes"]
            if trial_peak <= peak:
                kept, x, peak, changed = trial, x_trial, trial_peak, True
        # A dropped unit held from its recomputation to its last use: no second
        # recomputation, whose inputs would come back beside later stages' gradients.
        for u in order if holds else ():
            if kept[u] or held[u]:
                continue
            trial = held.copy()
            trial[u] = True
            x_trial = _fit(f, kept, trial)
            trial_peak = evaluate(f, x_trial)["peak_bytes"]
            if trial_peak < peak or (trial_peak == peak and f.cost @ x_trial < f.cost @ x):
                held, x, peak, changed = trial, x_trial, trial_peak, True
        if not changed:
            break
    return x, peak


LP_BUDGET_SCALES = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # LP budgets, fractions of the real one
ROUNDING_THRESHOLDS = (0.9, 0.7, 0.5, 0.3, 0.1, 0.01)  # keep u when its LP keep value is above


def rounded_start(
    f: Formulation, budget_bytes: int, time_limit: float = 60.0, lp_at_budget=None
) -> np.ndarray | None:
    """Binary columns of the cheapest just-in-time schedule within `budget_bytes` whose
    kept units are the LP relaxation's keep columns rounded; None if no rounding fits.

    The LP is solved at the budget and, while no rounding fits, at smaller ones (a
    rounded schedule needs more memory than the LP's fractional one), for at most
    `time_limit` seconds in all. `lp_at_budget`: the binary columns of the LP optimum
    at `budget_bytes`, already solved (the cuts' last LP), used instead of solving it."""
    deadline = time.perf_counter() + time_limit
    best, best_cost = None, np.inf
    nearest = []  # per LP budget: the kept units of the rounding closest to fitting
    for scale in LP_BUDGET_SCALES:
        remaining = deadline - time.perf_counter()
        if scale == 1.0 and lp_at_budget is not None:
            lp = lp_at_budget
        else:
            lp = relaxation(f, budget_bytes * scale, remaining) if remaining > 0 else None
        if lp is None:  # infeasible even fractionally (smaller budgets are too), or slow
            break
        closest, closest_peak = None, np.inf
        for threshold in ROUNDING_THRESHOLDS:
            kept = lp[f.keep] >= threshold
            x = _fit(f, kept)
            cost, peak = float(f.cost @ x), evaluate(f, x)["peak_bytes"]
            if cost < best_cost and peak <= budget_bytes:
                best, best_cost = x, cost
            if peak < closest_peak:
                closest, closest_peak = kept, peak
        if best is not None:
            return best
        nearest.append(closest)
    # Near the smallest budget every rounding may miss: the greedy's drops, from each LP
    # budget's rounding closest to fitting, often close that (ResNet-50 at 184, full
    # mode, 4.4 GB: no rounding fits; these drops reach 4.38 GB from the seventh).
    for kept in nearest:
        x, peak = _drop_while_not_higher(f, kept, budget_bytes)
        if peak <= budget_bytes:
            return x
    return None


def keep_back(f: Formulation, x: np.ndarray, budget_bytes: int) -> np.ndarray:
    """`x` improved: dropped units kept again, costliest recomputation first, while
    the schedule stays within `budget_bytes` and gets cheaper."""
    units = f.problem.units
    kept = x[f.keep].astype(bool)
    cost = float(f.cost @ x)
    order = sorted(
        (u.id for u in units if u.recomputable),
        key=lambda u: units[u].recompute_s,
        reverse=True,
    )
    improved = True
    while improved:
        improved = False
        for u in order:
            if kept[u]:
                continue
            trial = kept.copy()
            trial[u] = True
            x_trial = _fit(f, trial)
            trial_cost = float(f.cost @ x_trial)
            if trial_cost < cost and evaluate(f, x_trial)["peak_bytes"] <= budget_bytes:
                kept, x, cost, improved = trial, x_trial, trial_cost, True
    return x


def reschedule(f: Formulation, x: np.ndarray, budget_bytes: int, solver: str) -> np.ndarray:
    """`x` with its kept units pinned and the rest (recomputations, what is held from
    stage to stage, variant and algorithm choices) re-solved by the MILP; `x` itself
    where that finds nothing cheaper within `RESCHEDULE_TIME_LIMIT`. HiGHS where it is
    installed, whichever `solver` the MILP has: it takes `x` as its start, where CBC
    searches from nothing (ResNet-50 at 184, 10 GB, full mode: 0.6 s against CBC's
    2.8 s, the same schedule)."""
    if importlib.util.find_spec("highspy") is not None or solver not in ("HIGHS", "CBC"):
        solver = "HIGHS"
    pins = (f.keep, x[f.keep])
    raw = solve_formulation(
        f, budget_bytes, solver, RESCHEDULE_TIME_LIMIT, start=x, pins=pins, workers=1
    )  # a small problem once the keep columns are pinned: not raced
    better = raw.x_bool
    if better is None or float(f.cost @ better) >= float(f.cost @ x):
        return x
    return better if evaluate(f, better)["peak_bytes"] <= budget_bytes else x


_REMEMBERED = 16  # formulations whose least-peak schedule is kept
# ... and in the cache folder, the most recently used (a few KB each: a bit per column)
_REMEMBERED_ON_DISK = 256
_least_peak: dict[bytes, np.ndarray] = {}


def _rows_key(f: Formulation) -> bytes:
    """A digest of `f`'s columns and rows (not its costs): the formulations built from
    one problem by the same options share it, whichever object holds them. Kept in
    `f.cache`: a smallest-budget search reads and then writes its schedule by it."""
    if "rows_key" not in f.cache:
        f.cache["rows_key"] = _digest_of_rows(f)
    return f.cache["rows_key"]


def _digest_of_rows(f: Formulation) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.asarray([f.n_bool, f.n_cont]).tobytes())
    for a in (f.a_bool, f.a_cont):
        for part in (a.indptr, a.indices, a.data):
            digest.update(np.ascontiguousarray(part).tobytes())
    for part in (f.rhs, f.is_eq, f.budget_rows, f.budget_const):
        digest.update(np.ascontiguousarray(part).tobytes())
    return digest.digest()


def _least_peak_file(key: bytes) -> Path:
    return cache_dir() / "least_peak" / f"{key.hex()}.npy"


def remember_least_peak(f: Formulation, x: np.ndarray) -> None:
    """Keep `x`, the schedule of least peak found on `f`, for `start_schedule` on a
    formulation with the same rows: in memory (the most recent `_REMEMBERED`) and in
    the cache folder (where it cannot be written, in memory only)."""
    key = _rows_key(f)
    _least_peak.pop(key, None)
    _least_peak[key] = x.copy()
    while len(_least_peak) > _REMEMBERED:
        _least_peak.pop(next(iter(_least_peak)))
    stored = io.BytesIO()
    np.save(stored, np.packbits(np.asarray(x) > 0.5))
    try:
        atomic_write(_least_peak_file(key), stored.getvalue())
        _prune_least_peak_files()
    except OSError:
        pass  # a start saved for later, not a result: the solve goes on without it


def _prune_least_peak_files() -> None:
    """Remove all but the `_REMEMBERED_ON_DISK` most recently used schedule files."""
    files = sorted(
        _least_peak_file(b"").parent.glob("*.npy"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for old in files[_REMEMBERED_ON_DISK:]:
        old.unlink(missing_ok=True)


def remembered_least_peak(f: Formulation) -> np.ndarray | None:
    """The schedule `remember_least_peak` kept for `f`'s rows, or None. Take the key
    before adding cuts: they add rows. A schedule read from the cache is only a start:
    the solve checks it against every row before it takes it."""
    key = _rows_key(f)
    if key in _least_peak:
        return _least_peak[key].copy()
    path = _least_peak_file(key)
    try:
        packed = np.load(path, allow_pickle=False)
        path.touch()  # used: kept by `_prune_least_peak_files`
    except (OSError, ValueError):
        return None
    x = np.unpackbits(packed.astype(np.uint8))[: f.n_bool].astype(int)
    return x if len(x) == f.n_bool else None


def start_schedule(
    f: Formulation,
    budget_bytes: int,
    solver: str = "HIGHS",
    peak_search_s: float = 0.0,
    known: np.ndarray | None = None,
    lp_at_budget: np.ndarray | None = None,
) -> tuple[np.ndarray | None, str]:
    """The cheapest start found (greedy, LP rounding, `known`, then `keep_back` and
    `reschedule` through `solver`), and how it was found; (None, reason) when none fits
    the budget. `lp_at_budget`: `rounded_start`'s, where the LP is already solved.

    Near the smallest feasible budget both heuristics often fail; then, unless `known`
    (a least-peak schedule, `remembered_least_peak`) fits, for up to `peak_search_s`,
    the least-peak search that found that budget (`least_peak_start` and windows
    re-solved) looks for a schedule within it."""
    found = []
    if known is not None and evaluate(f, known)["peak_bytes"] <= budget_bytes:
        found.append((float(f.cost @ known), "smallest-budget search", known))
    greedy = greedy_start(f, budget_bytes)
    if greedy is not None:
        found.append((float(f.cost @ greedy), "greedy", greedy))
    rounded = rounded_start(f, budget_bytes, lp_at_budget=lp_at_budget)
    if rounded is not None:
        found.append((float(f.cost @ rounded), "LP rounding", rounded))
    if not found and peak_search_s > 0:
        # Below the smallest budget the search would use all its time: the LP says so
        # first (MobileNetV2, 64 px, batch 16, at 0.03 GB: 16 s of a 60 s limit).
        if relaxation_infeasible(f, budget_bytes, peak_search_s):
            return None, "the LP relaxation is infeasible at this budget"
        least = _within_by_least_peak(f, budget_bytes, solver, peak_search_s)
        if least is not None:
            found.append((float(f.cost @ least), "least-peak search", least))
    if not found:
        return None, "no heuristic found a schedule within the budget"
    _, how, x = min(found, key=lambda item: item[0])
    x = keep_back(f, x, budget_bytes)
    rescheduled = reschedule(f, x, budget_bytes, solver)
    if rescheduled is not x:
        how += " + recomputation re-solved"
    return rescheduled, how


def _within_by_least_peak(
    f: Formulation, budget_bytes: int, solver: str, seconds: float
) -> np.ndarray | None:
    """A schedule within `budget_bytes` from the least-peak search, or None. The search
    stops at the first one: the MILP, started from it, lowers its cost far sooner than
    windows that go on lowering its peak (MobileNetV2, 64 px, batch 16, at its smallest
    budget, 120 s limit: the start took 61.5 s, 39.2 s with the search stopped so, and
    HiGHS then proved the optimum in under 10 s)."""
    x = least_peak_start(f)
    if evaluate(f, x)["peak_bytes"] > budget_bytes:
        solver = solver if solver in ("HIGHS", "CBC") else "HIGHS"
        x = shrink_peak(f, x, solver, time.perf_counter() + seconds, target_bytes=budget_bytes)
    return x if evaluate(f, x)["peak_bytes"] <= budget_bytes else None
