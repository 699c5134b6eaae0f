"""The solver back ends: each takes a Formulation and its right-hand sides and
returns one RawResult (HiGHS through highspy, CBC through cylp, PuLP's bundled CBC,
any other solver cvxpy knows, Gurobi among them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from monet_like.solver.formulation import MS

_NUMBER = r"([-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"  # a number in a solver's log


@dataclass
class RawResult:
    # "optimal", "feasible" (stopped with a schedule), "stopped" (by the time limit, with
    # no schedule), "infeasible", "error", or "cutoff"
    # (CBC given a cutoff: proved that no schedule is cheaper; no schedule, bound = cutoff)
    status: str
    x_bool: np.ndarray | None
    objective: float | None  # recompute seconds
    bound: float | None
    gap: float | None
    solve_time_s: float
    solver: str
    message: str = ""
    first_feasible_s: float | None = None  # when the first schedule within budget was known
    best_found_s: float | None = None  # when the schedule returned was found (HiGHS only)


def relative_gap(objective: float, bound: float | None) -> float | None:
    """How far `objective` may be above the optimum, given the solver's best `bound`:
    0 for a schedule that recomputes nothing, None without a finite bound."""
    if objective <= 1e-12:
        return 0.0
    if bound is None or not np.isfinite(bound):
        return None
    return max(0.0, objective - bound) / objective


def abs_gap_ms(f, gap: float, minimize_budget: bool = False) -> float:
    """The tolerance handed to a solver as an absolute gap (ms): `gap` of `f`'s fastest
    step (`Formulation.floor_ms`), so that a search stops within `gap` of the step, as
    Checkmate's and MONeT's objectives (the whole step) count it, and not of the
    recomputation alone, a few percent of the step: 0.1% of ResNet-50's (184) was 3 ms of
    a 58 s step, far below its profile's noise, and took CBC 137 s to close on one
    profile where another's closed in 21 s. A budget search's objective is the budget:
    none there."""
    return 0.0 if minimize_budget else gap * getattr(f, "floor_ms", 0.0)


def slack_ms(f, objective_ms: float, gap: float, minimize_budget: bool = False) -> float:
    """How far above the optimum a schedule of objective `objective_ms` may be and count as
    optimal: `gap` of the objective (the recomputation) or `abs_gap_ms`, whichever is
    wider (the solvers stop at either)."""
    return max(gap * objective_ms, abs_gap_ms(f, gap, minimize_budget))


def tolerance_gap(f, objective_s: float, gap: float, minimize_budget: bool = False) -> float:
    """The relative gap that a search finished within its tolerance proves for a schedule
    of objective `objective_s` (> 0), where the solver reports no bound: `slack_ms` of it."""
    return slack_ms(f, objective_s / MS, gap, minimize_budget) / (objective_s / MS)


def within_tolerance(
    f, objective_ms: float, bound_ms: float | None, gap: float, minimize_budget: bool = False
) -> bool:
    """Whether `bound_ms` proves a schedule of objective `objective_ms` optimal (`slack_ms`)."""
    if objective_ms <= 1e-12:
        return True
    if bound_ms is None or not np.isfinite(bound_ms):
        return False
    return objective_ms - bound_ms <= slack_ms(f, objective_ms, gap, minimize_budget) * (1 + 1e-9)


def _finish(f, x_val, status, bound, gap_value, gap, solver, minimize_budget) -> RawResult:
    """Common tail of the solver interfaces: objective in seconds, gap and bound cleaned."""
    objective = float(f.cost @ x_val) * MS
    if minimize_budget:  # the solver's bound is on memory then, not on recomputation
        bound = gap_value = None
    bound = float(bound) * MS if bound is not None and np.isfinite(bound) else None
    if gap_value is not None and not np.isfinite(gap_value):
        gap_value = None
    if objective <= 1e-12:
        gap_value, bound = 0.0, 0.0
    final = "optimal" if status == "optimal" else "feasible"
    if final == "optimal" and gap_value is None:
        # A search that finished within its tolerance (`slack_ms`): that bounds the gap
        # even where the solver reports no bound.
        gap_value = tolerance_gap(f, objective, gap, minimize_budget)
    return RawResult(final, x_val, objective, bound, gap_value, 0.0, solver)
