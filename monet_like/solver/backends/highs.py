"""HiGHS through highspy: the model built from the sparse matrix, searches raced with
seeds, the LP relaxation for the start heuristics and cuts, and a feasibility check
of a fixed schedule."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from monet_like.solver.backends import (
    RawResult,
    _finish,
    abs_gap_ms,
    relative_gap,
    within_tolerance,
)
from monet_like.solver.formulation import MIB, MS, Formulation, _budget_column, _rhs_for
from monet_like.solver.race import RACE_GRACE_S, available_cores, race, signals_held
from monet_like.streams import silenced
from monet_like.units import GIB


def _fresh_thread_pool() -> None:
    """In a forked process: HiGHS's thread pool is global, and the fork copied it without
    its worker threads, so a search there waited on them for ever wherever the parent had
    run HiGHS on two threads or more (its default on 4 cores or more: half of them). The
    copy is dropped without waiting on them; the next run makes a pool of its own."""
    highspy = sys.modules.get("highspy")  # not imported: no pool to drop
    if highspy is not None:
        highspy.Highs.resetGlobalScheduler(False)


os.register_at_fork(after_in_child=_fresh_thread_pool)  # the racers and watched searches


def _binary_bounds(n_bool: int, fixed=None, pins=None) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper bounds of the binary columns: 0 and 1, or `fixed` (all pinned);
    `pins` = (columns, values) pins some of them."""
    low = np.zeros(n_bool) if fixed is None else np.array(fixed, dtype=float)
    high = np.ones(n_bool) if fixed is None else low.copy()
    if pins is not None:
        low[pins[0]] = high[pins[0]] = pins[1]
    return low, high


def _highs_model(f: Formulation, rhs: np.ndarray, minimize_budget: bool, fixed=None, pins=None):
    """A highspy model of the formulation; `fixed` pins the binary columns (an LP),
    `pins` = (columns, values) some of them."""
    import highspy

    with silenced(1):  # highspy >= 1.16 prints its banner from the constructor
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)  # before passModel: no banner
    n_b, n_c = f.n_bool, f.n_cont
    n_cols = n_b + n_c + (1 if minimize_budget else 0)
    a = sp.hstack([f.a_bool, f.a_cont], format="csc")
    cost = np.concatenate([f.cost, np.zeros(n_c)])
    if minimize_budget:
        a = sp.hstack([a, sp.csc_matrix(_budget_column(f)[:, None])], format="csc")
        cost = np.concatenate([1e-6 * cost, [1.0]])  # smallest memory, then least recompute
    inf = highspy.kHighsInf
    low_b, high_b = _binary_bounds(n_b, fixed, pins)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n_cols, f.n_rows
    lp.col_cost_ = cost
    lp.col_lower_ = np.concatenate([low_b, np.full(n_cols - n_b, -inf)])
    lp.col_upper_ = np.concatenate([high_b, np.full(n_cols - n_b, inf)])
    lp.row_lower_, lp.row_upper_ = np.where(f.is_eq, rhs, -inf), rhs
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
    if fixed is None:
        integer, continuous = highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous
        lp.integrality_ = [integer] * n_b + [continuous] * (n_cols - n_b)
    h.passModel(lp)
    return h


def solved_relaxation(f: Formulation, budget_bytes: float, time_limit: float = 60.0):
    """The LP relaxation at `budget_bytes` (least recomputation) as a highspy model, run
    for at most `time_limit` seconds, and whether it reached its optimum. A budget proved
    infeasible is remembered in `f.cache` (`known_infeasible`)."""
    import highspy

    h = _highs_model(f, _rhs_for(f, budget_bytes), False)
    h.setOptionValue("solve_relaxation", True)
    h.setOptionValue("time_limit", float(time_limit))
    h.run()
    if h.getModelStatus() == highspy.HighsModelStatus.kInfeasible:
        largest = f.cache.get("lp_infeasible_at", -np.inf)
        f.cache["lp_infeasible_at"] = max(largest, float(budget_bytes))
    return h, h.getModelStatus() == highspy.HighsModelStatus.kOptimal


def known_infeasible(f: Formulation, budget_bytes: float) -> bool:
    """Whether an LP relaxation of `f` already solved proved `budget_bytes` infeasible:
    at that budget or a larger one (the budget only bounds memory rows from above, so
    a smaller one is infeasible too). The cuts' LP, the LP rounding's and the start's
    check all ask at the same budget: one solve answers them."""
    return budget_bytes <= f.cache.get("lp_infeasible_at", -np.inf)


def relaxation(f: Formulation, budget_bytes: float, time_limit: float = 60.0) -> np.ndarray | None:
    """The binary columns' values in the LP relaxation at `budget_bytes` (least
    recomputation), or None when even the relaxation is infeasible (or not solved
    within `time_limit` seconds)."""
    if known_infeasible(f, budget_bytes):
        return None
    h, solved = solved_relaxation(f, budget_bytes, time_limit)
    return np.asarray(h.getSolution().col_value[: f.n_bool]) if solved else None


def relaxation_infeasible(f: Formulation, budget_bytes: float, time_limit: float = 60.0) -> bool:
    """Whether HiGHS proves the LP relaxation at `budget_bytes` infeasible within
    `time_limit` seconds: then no schedule fits that budget."""
    if not known_infeasible(f, budget_bytes):
        solved_relaxation(f, budget_bytes, time_limit)
    return known_infeasible(f, budget_bytes)


def is_feasible(f: Formulation, x_bool: np.ndarray, budget_bytes: int) -> bool:
    """Whether the binary columns `x_bool` satisfy every row within `budget_bytes` (the
    continuous columns completed by an LP)."""
    import highspy

    h = _highs_model(f, _rhs_for(f, budget_bytes), False, fixed=x_bool)
    h.run()
    return h.getModelStatus() == highspy.HighsModelStatus.kOptimal


@dataclass
class _HighsOutcome:
    """One HiGHS search, as plain values (a racer sends it through a pipe)."""

    status: str  # "optimal", "feasible", "infeasible", "stopped" (limit, no schedule), "error"
    x: np.ndarray | None
    objective: float  # HiGHS's objective and dual bound, in the model's own units
    bound: float
    message: str
    first_s: float | None  # when it found its first schedule
    seed: int
    best_s: float | None = None  # when it found its last improved one (a start's: at once)


# Racing a second search only pays on problems that take seconds or more:
# ResNet-50 (184) has 9,936 binaries, ResNet-18 at 64 px 1,963 (the test suite's
# GoogLeNet at 64 px, 13,939, and DenseNet at depth 2, 5,558, race).
RACE_MIN_BINARIES = 4000


def race_workers(f: Formulation) -> int:
    """How many HiGHS or CBC searches to race on `f` (see race.py): one per core, up to
    two, on a large problem; one otherwise."""
    return min(2, available_cores()) if f.n_bool >= RACE_MIN_BINARIES else 1


def _highs_search(
    f, rhs, time_limit, gap, verbose, minimize_budget, start, pins, seed, progress, stop,
    found=None,
) -> _HighsOutcome:  # fmt: skip
    """One HiGHS search with random seed `seed`; `stop()` (polled) interrupts it;
    `found(outcome)` receives each improved schedule as a "feasible" outcome."""
    import highspy

    h = _highs_model(f, rhs, minimize_budget, pins=pins)
    h.setOptionValue("output_flag", bool(verbose) and seed == 0)
    h.setOptionValue("mip_rel_gap", float(gap))
    h.setOptionValue("mip_abs_gap", abs_gap_ms(f, gap, minimize_budget))
    h.setOptionValue("random_seed", seed)
    if time_limit:
        h.setOptionValue("time_limit", float(time_limit))
    n_b = f.n_bool
    if start is not None:
        h.setSolution(n_b, np.arange(n_b, dtype=np.int32), start.astype(np.float64))

    first, latest, shown = [None], [None], [None]
    started = time.perf_counter()

    def improved(event) -> None:
        out = event.data_out
        latest[0] = time.perf_counter() - started
        if first[0] is None:
            first[0] = latest[0]
        x = np.round(np.asarray(out.mip_solution[:n_b]))
        # The schedule's own cost: HiGHS's objective figure can be off its columns (with
        # the frees on ResNet-50, 16 x 128 px, it said 162.9 ms for the start's 179.2 ms).
        cost_ms = float(f.cost @ x)
        if found is not None:
            value = out.objective_function_value if minimize_budget else cost_ms
            bound = out.mip_dual_bound if np.isfinite(out.mip_dual_bound) else -np.inf
            x8 = x.astype(np.int8)  # int8 columns: an eighth of the bytes through a pipe
            found(_HighsOutcome("feasible", x8, value, bound, "", first[0], seed, latest[0]))
        if progress is None:
            return
        bound = out.mip_dual_bound
        known = np.isfinite(bound) and np.isfinite(out.mip_gap)
        if minimize_budget:  # the objective is the peak in MiB (plus a tiny time term)
            line = f"smallest budget so far {out.objective_function_value * MIB / GIB:.4f} GB" + (
                f"; bound {bound * MIB / GIB:.4f} GB" if known else ""
            )
            if line != shown[0]:  # not again for less recomputation at the same peak
                shown[0] = line
                progress(f"[{out.running_time:6.1f} s] {line}")
            return
        progress(
            f"[{out.running_time:6.1f} s] schedule with {cost_ms * MS:.3f} s of recomputation"
            + (f"; bound {bound * MS:.3f} s, gap {out.mip_gap:.2%}" if known else "")
        )

    h.cbMipImprovingSolution.subscribe(improved)
    run_interruptible(h, stop)
    model_status = h.getModelStatus()
    message = h.modelStatusToString(model_status)
    info = h.getInfo()
    if model_status == highspy.HighsModelStatus.kInfeasible:
        return _HighsOutcome("infeasible", None, np.inf, np.inf, message, first[0], seed)
    if info.primal_solution_status != 2:  # no feasible point
        limited = model_status in (
            highspy.HighsModelStatus.kTimeLimit,
            highspy.HighsModelStatus.kInterrupt,
        )
        status = "stopped" if limited else "error"
        return _HighsOutcome(status, None, np.inf, info.mip_dual_bound, message, first[0], seed)
    x_val = np.round(np.asarray(h.getSolution().col_value[:n_b])).astype(int)
    # the columns' cost, not HiGHS's figure (see `improved`): the races compare it
    objective = info.objective_function_value if minimize_budget else float(f.cost @ x_val)
    status = "optimal" if model_status == highspy.HighsModelStatus.kOptimal else "feasible"
    return _HighsOutcome(
        status, x_val, objective, info.mip_dual_bound, message, first[0], seed, latest[0],
    )  # fmt: skip


def run_interruptible(h, stop: Callable[[], bool] | None = None) -> None:
    """`h.run()`, interrupted when `stop()` (polled) says so or a SIGINT or SIGTERM
    arrives; such a signal is raised once HiGHS has returned (`race.signals_held`)."""
    with signals_held() as signalled:
        checks = [c for c in (signalled, stop) if c is not None]
        if checks:
            h.cbMipInterrupt.subscribe(
                lambda event: event.interrupt() if any(c() for c in checks) else None
            )
        h.run()


def _solve_highs(
    f, rhs, time_limit, gap, verbose, minimize_budget, start, progress, pins=None, workers=1
):
    """HiGHS through highspy (cvxpy's interface takes no start and reports no progress),
    `workers` searches raced with different seeds: the first to finish wins; stopped by
    the time limit, the best schedule and the best bound of all count.

    A whole problem with a time limit is searched in forked processes, watched (see
    race.py): HiGHS does not look at its limit everywhere (a restart's presolve ran past
    it for minutes), so a search still running `RACE_GRACE_S` after the limit is killed
    and the last schedule it found kept. Windows (`pins`) are small and many: a fork
    each would cost more than they do, so they run here."""
    if time_limit and pins is None:
        return _solve_highs_watched(
            f, rhs, time_limit, gap, verbose, minimize_budget, start, progress, workers
        )

    def run(seed, stop):
        return _highs_search(
            f, rhs, time_limit, gap, verbose, minimize_budget, start, pins, seed,
            progress if seed == 0 else None, stop,
        )  # fmt: skip

    outcomes = race(run, workers, _proved)
    return _merged(f, outcomes, gap, minimize_budget, progress)


def _solve_highs_watched(
    f, rhs, time_limit, gap, verbose, minimize_budget, start, progress, workers
) -> RawResult:
    """`_solve_highs` with every search forked and watched: their progress lines and
    schedules come through the race's pipes; a search left out past its limit counts
    with the last schedule it told."""
    last: dict[int, _HighsOutcome] = {}

    def heard(seed: int, message) -> None:
        kind, value = message
        if kind == "line":
            progress(value)
        else:  # its columns came as int8
            value.x = value.x.astype(int)
            last[seed] = value

    def run(seed, stop, tell):
        return _highs_search(
            f, rhs, time_limit, gap, verbose, minimize_budget, start, None, seed,
            (lambda line: tell(("line", line))) if seed == 0 and progress else None, stop,
            lambda outcome: tell(("schedule", outcome)),
        )  # fmt: skip

    deadline = time.perf_counter() + time_limit
    workers = max(1, workers)
    outcomes = race(run, workers, _proved, deadline=deadline, heard=heard)
    answered = {o.seed for o in outcomes}
    if not any(_proved(o) for o in outcomes):
        for seed in sorted(set(range(workers)) - answered):
            left = last.get(seed) or _HighsOutcome("stopped", None, np.inf, -np.inf, "", None, seed)
            left.message = f"still running {RACE_GRACE_S:.0f} s past its time limit: stopped"
            outcomes.append(left)
            if progress is not None:
                kept = "its last schedule kept" if left.x is not None else "no schedule found"
                progress(f"HiGHS (random seed {seed}) ran past its time limit: stopped, {kept}")
    return _merged(f, outcomes, gap, minimize_budget, progress)


def _proved(o: _HighsOutcome) -> bool:
    """Whether a search finished (ends a race): its schedule proved, or none exists."""
    return o.status in ("optimal", "infeasible")


def _merged(f, outcomes: list[_HighsOutcome], gap, minimize_budget, progress) -> RawResult:
    """One result from the raced searches' outcomes."""
    if any(o.status == "infeasible" for o in outcomes):
        return RawResult("infeasible", None, None, None, None, 0.0, "HIGHS")
    found = [o for o in outcomes if o.x is not None]
    if not found:
        stopped = all(o.status == "stopped" for o in outcomes)
        status, message = ("stopped", "") if stopped else ("error", outcomes[0].message)
        # A bound without a schedule is kept (as CBC's is): a returned start is measured by it.
        bounds = [o.bound for o in outcomes if np.isfinite(o.bound)] if stopped else []
        bound = max(bounds) * MS if bounds and not minimize_budget else None
        return RawResult(status, None, None, bound, None, 0.0, "HIGHS", message)
    best = min(found, key=lambda o: o.objective)
    bounds = [o.bound for o in outcomes if np.isfinite(o.bound)]
    bound = max(bounds) if bounds else None  # each search's bound holds: the best counts
    if progress is not None and best.seed != 0:
        progress(f"the search with random seed {best.seed}, raced on another core, won")
    # best is at most an optimal one's; or, on the step, one search's schedule and
    # another's bound together prove it (each stopped at its time limit). Not for the
    # smallest budget: one stopped is improved by window searches (`_min_schedule`)
    proved = any(o.status == "optimal" for o in found) or (
        not minimize_budget and within_tolerance(f, best.objective, bound, gap)
    )
    res = _finish(
        f, best.x, "optimal" if proved else "feasible", bound,
        relative_gap(best.objective, bound), gap, "HIGHS", minimize_budget,
    )  # fmt: skip
    firsts = [o.first_s for o in outcomes if o.first_s is not None]
    res.first_feasible_s = min(firsts) if firsts else None
    res.best_found_s = best.best_s
    return res
