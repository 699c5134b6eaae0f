"""The mixed-integer program solved: `solve_formulation` hands a Formulation
(solver/formulation.py) to a back end (solver/backends/) and returns its RawResult."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable

import numpy as np

from monet_like.errors import UserError
from monet_like.solver.backends import RawResult
from monet_like.solver.backends.cbc import _solve_cbc
from monet_like.solver.backends.cvxpy import _solve_cvxpy
from monet_like.solver.backends.highs import _solve_highs, race_workers
from monet_like.solver.backends.pulp import _solve_pulp
from monet_like.solver.formulation import Formulation, _rhs_for

STARTABLE = ("HIGHS", "PULP")  # take a start schedule (cylp's CBC interface has no MIP start)


def solve_formulation(
    f: Formulation,
    budget_bytes: int | None,
    solver: str,
    time_limit: float | None,
    gap: float = 1e-3,
    verbose: bool = False,
    start: np.ndarray | None = None,
    progress: Callable[[str], None] | None = None,
    pins: tuple[np.ndarray, np.ndarray] | None = None,
    workers: int | None = None,
    cutoff_ms: float | None = None,
) -> RawResult:
    """Solve for the least recomputation within `budget_bytes`; with `budget_bytes=None`,
    for the smallest budget (then the least recomputation among equals).

    `start`: binary columns of a schedule within the budget, handed to the solvers
    that take one (HiGHS, PuLP's CBC); with a start the first feasible time is 0.
    `progress` receives one line per improved schedule where the solver reports them.
    `pins` = (columns, values) fixes some binary columns (HiGHS and CBC).
    `workers`: HiGHS or CBC searches raced with different seeds, or the threads of PuLP's
    CBC (default `race_workers(f)`).
    `cutoff_ms`: CBC (through cylp, which takes no start) searches only for schedules
    cheaper than this, the row cost <= cutoff added; proving there is none, it returns
    no schedule, status "cutoff", with the cutoff as its bound.
    The other solvers ignore it (HiGHS and PuLP's CBC take `start` instead).
    """
    rhs = _rhs_for(f, budget_bytes)
    workers = race_workers(f) if workers is None else workers  # races; PuLP: threads
    started = time.perf_counter()
    if solver == "PULP":
        if budget_bytes is None:
            raise ValueError("the min-memory problem is solved through HiGHS or cvxpy")
        res = _solve_pulp(f, rhs, time_limit, gap, verbose, start, progress, workers)
    elif solver == "HIGHS":
        minimize_budget = budget_bytes is None
        res = _solve_highs(
            f, rhs, time_limit, gap, verbose, minimize_budget, start, progress, pins, workers
        )
    elif solver == "CBC":
        res = _solve_cbc(
            f, rhs, time_limit, gap, verbose, budget_bytes is None, pins, workers, cutoff_ms
        )
    else:
        res = _solve_cvxpy(f, rhs, solver, time_limit, gap, verbose, budget_bytes is None)
    res.solve_time_s = time.perf_counter() - started
    if start is not None and solver in STARTABLE:
        res.first_feasible_s = 0.0
    return res


def check_solver(solver: str) -> None:
    """Raise a UserError saying how to install `solver` when it is not usable."""
    if solver == "PULP":
        try:
            import pulp

            if not pulp.PULP_CBC_CMD().available():
                raise UserError("PuLP's bundled CBC is not available: pip install pulp")
        except ImportError:
            raise UserError("solver PULP is not installed: pip install pulp") from None
        return
    # HiGHS and CBC are called through their own bindings, the others through cvxpy
    module = {"HIGHS": ("highspy", "pip install highspy"), "CBC": ("cylp", "pip install cylp")}
    if solver in module:
        name, how = module[solver]
        try:
            importlib.import_module(name)
        except ImportError:
            raise UserError(f"solver {solver} is not installed: {how}") from None
        return
    try:
        import cvxpy as cp
    except ImportError:
        raise UserError(f"solver {solver} is reached through cvxpy: pip install cvxpy") from None

    if solver not in cp.installed_solvers():
        how = "pip install gurobipy (and a Gurobi licence)" if solver == "GUROBI" else ""
        raise UserError(f"solver {solver} is not installed for cvxpy: {how}".rstrip(": "))
