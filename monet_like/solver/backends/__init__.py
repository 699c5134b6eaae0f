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
        # A search that finished within the requested relative gap: that tolerance is an
        # upper bound on the gap even where the solver reports no bound.
        gap_value = gap
    return RawResult(final, x_val, objective, bound, gap_value, 0.0, solver)
