"""Any MILP solver cvxpy knows (Gurobi with a licence): no start, no progress."""

from __future__ import annotations

import numpy as np

from monet_like.solver.backends import RawResult, _finish, abs_gap_ms
from monet_like.solver.formulation import _budget_column


def _solve_cvxpy(f, rhs, solver, time_limit, gap, verbose, minimize_budget=False) -> RawResult:
    import cvxpy as cp

    x = cp.Variable(f.n_bool, boolean=True)
    y = cp.Variable(f.n_cont)
    eq, le = f.is_eq, ~f.is_eq
    lhs = f.a_bool @ x + f.a_cont @ y
    objective = f.cost @ x
    if minimize_budget:
        budget = cp.Variable()
        lhs = lhs + cp.multiply(_budget_column(f), budget)
        objective = budget + 1e-6 * objective  # smallest memory, then least recomputation
    cons = []
    if eq.any():
        cons.append(lhs[eq] == rhs[eq])
    if le.any():
        cons.append(lhs[le] <= rhs[le])
    prob = cp.Problem(cp.Minimize(objective), cons)
    opts: dict = {}
    if solver == "GUROBI":
        opts = {"MIPGap": gap, "MIPGapAbs": abs_gap_ms(f, gap, minimize_budget)}
        if time_limit:
            opts["TimeLimit"] = float(time_limit)
    try:
        prob.solve(solver=getattr(cp, solver), verbose=verbose, **opts)
    except cp.error.SolverError as exc:
        return RawResult("error", None, None, None, None, 0.0, solver, str(exc))
    status = prob.status
    bound = gap_value = None
    stats = prob.solver_stats.extra_stats if prob.solver_stats else None
    if solver == "GUROBI" and stats is not None:
        bound = getattr(stats, "ObjBound", None)
        gap_value = getattr(stats, "MIPGap", None)
    if status in ("infeasible", "infeasible_inaccurate"):
        return RawResult("infeasible", None, None, None, None, 0.0, solver)
    if x.value is None:
        return RawResult("error", None, None, None, None, 0.0, solver, f"solver status {status}")
    x_val = np.round(x.value).astype(int)
    return _finish(f, x_val, status, bound, gap_value, gap, solver, minimize_budget)
