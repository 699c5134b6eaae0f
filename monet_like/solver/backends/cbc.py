"""CBC through cylp: the rows with the running sums substituted out, SIGINT handled,
searches raced on shuffled copies, and bounds read from its log."""

from __future__ import annotations

import re
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp

from monet_like.solver.backends import (
    _NUMBER,
    RawResult,
    _finish,
    abs_gap_ms,
    relative_gap,
    slack_ms,
    tolerance_gap,
    within_tolerance,
)
from monet_like.solver.backends.highs import _binary_bounds
from monet_like.solver.formulation import MS, Formulation, _budget_column
from monet_like.solver.race import race
from monet_like.streams import captured


@dataclass
class _CbcRun:
    status: str  # CBC's own words ("solution", "stopped on time", ...)
    x: np.ndarray | None  # its schedule, if it holds one
    bound: float | None  # a bound it proved (ms; scaled budget when minimizing)
    restarted: bool


def eliminate_sums(
    a_kept: sp.spmatrix, a_sums: sp.spmatrix, rhs: np.ndarray, is_eq: np.ndarray
) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray] | None:
    """The rows `a_kept @ x + a_sums @ s (== or <=) rhs` with the columns `s` substituted
    out, as (matrix over `x`, right-hand sides, the indices of the rows kept); None unless
    each column of `s` is defined by an equality row of its own (a square, nonsingular
    system), as the running sums y, z, b, q (and the full formulation's freed bytes) are.

    Why: CBC's cuts work on rows over the binaries. On ResNet-50 (184) in the full mode
    its root bound at 6 GB rose from 3.071 to 3.267 s (optimum 3.401 s), and at 7 GB it
    found the optimum where with the sums it stood at a 37% gap after 600 s
    (docs/solver.md). HiGHS does better with the sums (its root bound fell from
    3.35 to 3.27 s without them), so only CBC gets this model. The rows grow denser:
    137k nonzeros become about 930k."""
    from scipy.sparse.linalg import splu

    a_kept, a_sums = sp.csr_matrix(a_kept), sp.csr_matrix(a_sums)
    defining = is_eq & (a_sums.getnnz(axis=1) > 0)
    if int(defining.sum()) != a_sums.shape[1]:
        return None
    try:
        lu = splu(a_sums[defining].tocsc())
    except RuntimeError:  # singular: the columns are not sums of the others
        return None
    # sums = D^-1 (rhs_E - A_E x): solved for [A_E | rhs_E] in blocks of columns
    source = sp.hstack([a_kept[defining], sp.csr_matrix(rhs[defining][:, None])]).tocsc()
    blocks = []
    for lo in range(0, source.shape[1], 1024):
        block = lu.solve(source[:, lo : lo + 1024].toarray())
        block[np.abs(block) < 1e-9] = 0.0
        blocks.append(sp.csc_matrix(block))
    solved = sp.hstack(blocks).tocsr()
    rest = ~defining
    through = a_sums[rest]
    a = (a_kept[rest] - through @ solved[:, :-1]).tocsr()
    a.data[np.abs(a.data) < 1e-9] = 0.0
    a.eliminate_zeros()
    b = rhs[rest] - np.asarray(through @ solved[:, -1].toarray()).ravel()
    return a, b, np.flatnonzero(rest)


class CbcRows(NamedTuple):
    """The rows CBC gets: `a` over [binaries, continuous columns (`n_cont`), budget (when
    minimizing it)], `rhs`, which are equalities, and which of the formulation's rows
    each one is (`source`)."""

    a: sp.csr_matrix
    rhs: np.ndarray
    is_eq: np.ndarray
    n_cont: int
    source: np.ndarray


def _cbc_matrix(f, rhs, minimize_budget) -> CbcRows:
    """The rows CBC gets, over [binaries, free columns (full formulation), budget (when
    minimizing it)]: the running sums substituted out (`eliminate_sums`) where they can
    be, every continuous column kept where they cannot."""
    sums = np.setdiff1d(np.arange(f.n_cont), f.free_columns)
    a_c = f.a_cont.tocsc()
    kept = [f.a_bool, a_c[:, f.free_columns]]
    if minimize_budget:
        kept.append(sp.csr_matrix(_budget_column(f)[:, None]))
    a_kept = sp.hstack(kept).tocsr()
    reduced = eliminate_sums(a_kept, a_c[:, sums], rhs, f.is_eq)
    if reduced is None:  # as built: every continuous column stays
        kept = [f.a_bool, a_c] + kept[2:]
        return CbcRows(sp.hstack(kept).tocsr(), rhs, f.is_eq, f.n_cont, np.arange(f.n_rows))
    a, b, kept = reduced
    return CbcRows(a, b, f.is_eq[kept], len(f.free_columns), kept)


def cbc_rows(f, rhs, minimize_budget=False) -> CbcRows:
    """`_cbc_matrix`'s rows, kept on `f` for its last right-hand sides: the window
    searches solve one budget's problem many times with other columns pinned, and
    substituting the sums out takes seconds on a large model (1.7 s on ResNet-50 at
    184). Call it before racers fork: each then shuffles these rows (`_shuffled`)
    instead of substituting again, which two racers did side by side in 33 to 44 s
    where one alone took 1.7 s (their BLAS threads, two each, on two cores)."""
    rows = _rows_held(f, rhs, minimize_budget)
    if rows is None:
        rows = _cbc_matrix(f, rhs, minimize_budget)
        f.cache["cbc_rows"] = (_rows_key(rhs, minimize_budget), rows)
    return rows


def _rows_key(rhs: np.ndarray, minimize_budget: bool) -> tuple:
    return rhs.tobytes(), bool(minimize_budget)


def _rows_held(f, rhs, minimize_budget=False) -> CbcRows | None:
    """The CBC rows `f` holds for these right-hand sides (`cbc_rows`), if any."""
    cached = f.cache.get("cbc_rows")
    key = _rows_key(rhs, minimize_budget)
    return cached[1] if cached is not None and cached[0] == key else None


def _rows_reordered(rows: CbcRows, n_bool: int, order, row_order) -> CbcRows:
    """`rows` of a formulation as its copy with binary column j = column `order[j]` and
    row i = row `row_order[i]` has them (what `_cbc_matrix` gives on that copy)."""
    position = np.full(len(row_order), -1)
    position[rows.source] = np.arange(len(rows.source))
    taken = position[row_order]
    taken = taken[taken >= 0]
    columns = np.concatenate([order, np.arange(n_bool, rows.a.shape[1])])
    source = np.argsort(row_order)[rows.source[taken]]
    a = rows.a[taken].tocsc()[:, columns].tocsr()
    return CbcRows(a, rows.rhs[taken], rows.is_eq[taken], rows.n_cont, source)


STOPPED = ("stopped on time", "stopped on user event")  # CBC's words for a search cut short


@contextmanager
def _cbc_sigint():
    """Around a CBC solve: CBC's driver (cylp runs CbcMain1) installs a SIGINT handler
    that ends the search as its time limit would, and leaves it installed, so that
    afterwards Ctrl-C did nothing in this process. Python's handler is put back; yields
    a test of CBC's status: True where a SIGINT ended the search and Python's handler
    would have raised KeyboardInterrupt (the user's Ctrl-C). A raced search ignores
    SIGINT (race.py), and there a SIGINT is the race's deadline: the search's schedule
    and bound stand."""
    in_main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if in_main else None

    def by_ctrl_c(status: str) -> bool:
        return status == "stopped on user event" and before is signal.default_int_handler

    try:
        yield by_ctrl_c
    finally:
        if in_main and before is not None:
            signal.signal(signal.SIGINT, before)


def _cbc_run(f, rows, time_limit, gap, verbose, minimize_budget, pins, cutoff) -> _CbcRun:
    """One CBC solve through cylp, on `rows` (`_cbc_matrix`'s); `cutoff` (ms) adds the
    row cost <= cutoff."""
    from cylp.cy import CyClpSimplex
    from cylp.py.modeling.CyLPModel import CyLPArray, CyLPModel

    a, rhs, is_eq, n_cont, _ = rows
    model = CyLPModel()
    x = model.addVariable("x", f.n_bool, isInt=True)
    variables = [(x, slice(0, f.n_bool))]
    if n_cont:
        y = model.addVariable("y", n_cont)
        variables.append((y, slice(f.n_bool, f.n_bool + n_cont)))
    objective = CyLPArray(f.cost) * x
    if minimize_budget:
        budget = model.addVariable("budget", 1)
        variables.append((budget, slice(f.n_bool + n_cont, f.n_bool + n_cont + 1)))
        objective = CyLPArray([1.0]) * budget + CyLPArray(1e-6 * f.cost) * x
    a = a.tocsc()
    blocks = [(var, a[:, cols].tocsr()) for var, cols in variables]
    for rows, sense in ((is_eq, "=="), (~is_eq, "<=")):
        if not rows.any():
            continue
        lhs = None
        for var, block in blocks:
            term = block[rows] * var
            lhs = term if lhs is None else lhs + term
        model += (lhs == CyLPArray(rhs[rows])) if sense == "==" else (lhs <= CyLPArray(rhs[rows]))
    if cutoff is not None:
        model += sp.csr_matrix(f.cost[None, :]) * x <= CyLPArray([cutoff])
    low, high = _binary_bounds(f.n_bool, pins=pins)
    model += CyLPArray(low) <= x <= CyLPArray(high)
    model.objective = objective
    clp = CyClpSimplex(model)
    clp.logLevel = 0
    cbc = clp.getCbcModel()
    cbc.logLevel = 1  # its log says whether it restarted (see below)
    cbc.allowableFractionGap = float(gap)
    cbc.allowableGap = abs_gap_ms(f, gap, minimize_budget)
    if time_limit:
        cbc.maximumSeconds = float(time_limit)
    with captured(1) as log, _cbc_sigint() as stopped_by_sigint:
        cbc.solve()
    if stopped_by_sigint(cbc.status):
        raise KeyboardInterrupt  # the user's Ctrl-C, which CBC's handler took for itself
    if verbose:
        print(log[0], end="", flush=True)
    # After fixing columns by reduced cost, CBC 2.10 may restart its search on the smaller
    # model; on ResNet-50 it then proved "optimal" schedules 0.5% and 3.3% costlier than
    # HiGHS's optimum (its root bound jumped to ten times the schedule's cost). Only the
    # bound it had before a restart is trusted.
    restarted = "Cbc0044I" in log[0]
    status = cbc.status
    if status in ("relaxation infeasible", "problem proven infeasible"):
        return _CbcRun("infeasible", None, None, restarted)
    bound = _cbc_bound_before_restart(log[0]) if restarted else cbc.bestPossibleObjValue
    if bound is not None and abs(bound) >= 1e40:
        bound = None
    # solutionCount misses a solution found in preprocessing; CBC's objective stays at
    # its "infinity" (1e50) while it holds no incumbent.
    if status != "solution" and not cbc.objectiveValue < 1e40:
        return _CbcRun(status, None, bound, restarted)
    x_val = np.round(np.asarray(cbc.primalVariableSolution["x"])).astype(int)
    if status == "solution" and not restarted and not minimize_budget:
        # A finished search reports its own schedule as the bound; what it proved is that
        # nothing is cheaper by more than the tolerance it pruned with.
        cost_ms = float(f.cost @ x_val)
        bound = min(bound, cost_ms - slack_ms(f, cost_ms, gap))
    return _CbcRun(status, x_val, bound, restarted)


def _solve_cbc(
    f, rhs, time_limit, gap, verbose, minimize_budget=False, pins=None, workers=1, cutoff=None
) -> RawResult:
    """`workers` CBC searches raced (see race.py), each on the problem with its columns
    and rows in another order: CBC through cylp takes no random seed, and the order
    steers its search as a seed would (ResNet-50 at 8 GB, 600 CPU seconds each: 1.18%
    gap in the given order, 0.97% in a shuffled one). The first to prove its schedule
    wins; stopped by their time limits, the best schedule and the best bound count."""
    if minimize_budget or workers <= 1:
        return _cbc_search(f, rhs, time_limit, gap, verbose, minimize_budget, pins, cutoff)

    def run(seed, stop):
        return cbc_seeded(f, rhs, time_limit, gap, verbose and seed == 0, pins, cutoff, seed)

    cbc_rows(f, rhs)  # once, before the racers fork
    deadline = None if not time_limit else time.perf_counter() + time_limit
    outcomes = race(run, workers, lambda r: r.status in CBC_FINISHED, False, deadline)
    return merge_cbc_outcomes(f, outcomes, gap)


CBC_FINISHED = ("optimal", "infeasible", "cutoff")  # a raced CBC search that ends the race


def merge_cbc_outcomes(
    f, outcomes: list[RawResult], gap: float, solve_time_s: float = 0.0
) -> RawResult:
    """One answer from raced CBC searches: a proof that nothing (cheaper than the
    cutoff) fits, else the cheapest schedule with the highest bound (each search's
    bound holds), "optimal" when a search finished its own."""
    if not outcomes:
        return RawResult("error", None, None, None, None, solve_time_s, "CBC", "every search died")
    for status in ("infeasible", "cutoff"):
        proof = next((r for r in outcomes if r.status == status), None)
        if proof is not None:
            return proof
    bounds = [r.bound for r in outcomes if r.bound is not None]
    bound = max(bounds) if bounds else None
    found = [r for r in outcomes if r.x_bool is not None]
    if not found:
        message = outcomes[0].message
        return RawResult("error", None, None, bound, None, solve_time_s, "CBC", message)
    best = min(found, key=lambda r: r.objective)
    # best is at most a finished search's; or one search's schedule and another's bound
    # together prove it (both stopped by the limit), as HiGHS's race does
    proved = any(r.status == "optimal" for r in found) or within_tolerance(
        f, best.objective / MS, None if bound is None else bound / MS, gap
    )
    gap_value = relative_gap(best.objective, bound)
    if proved and gap_value is None:
        gap_value = tolerance_gap(f, best.objective, gap)
    return RawResult("optimal" if proved else "feasible", best.x_bool, best.objective, bound,
                     gap_value, solve_time_s, "CBC", best.message)  # fmt: skip


def cbc_seeded(f, rhs, time_limit, gap, verbose, pins, cutoff, seed: int) -> RawResult:
    """One CBC search (through cylp) on `f` with its columns and rows in the order drawn
    from `seed` (0: as built), its schedule back in `f`'s column order."""
    g, rhs_g, pins_g, order = _shuffled(f, rhs, pins, seed)
    res = _cbc_search(g, rhs_g, time_limit, gap, verbose, False, pins_g, cutoff)
    if order is not None and res.x_bool is not None:
        res.x_bool = res.x_bool[np.argsort(order)]  # back to f's column order
    return res


def _shuffled(f: Formulation, rhs: np.ndarray, pins, seed: int):
    """`f` with its binary columns and its rows in a random order drawn from `seed`
    (seed 0: as given), with `rhs` and `pins` to match, and the column order (None
    for seed 0): column j of the result is column order[j] of `f`. The CBC rows `f`
    holds for `rhs` (`cbc_rows`) come with it, reordered."""
    if seed == 0:
        return f, rhs, pins, None
    rng = np.random.default_rng(seed)
    order, rows = rng.permutation(f.n_bool), rng.permutation(f.n_rows)
    row_of = np.argsort(rows)  # where each of f's rows went
    g = replace(
        f, a_bool=f.a_bool.tocsc()[:, order].tocsr()[rows], a_cont=f.a_cont.tocsr()[rows],
        cost=f.cost[order], rhs=f.rhs[rows], is_eq=f.is_eq[rows],
        budget_rows=row_of[f.budget_rows], columns=None, cache={},
    )  # fmt: skip
    if pins is not None:
        pins = (np.argsort(order)[pins[0]], pins[1])
    rhs_g = rhs[rows]
    held = _rows_held(f, rhs)
    if held is not None:
        reordered = _rows_reordered(held, f.n_bool, order, rows)
        g.cache["cbc_rows"] = (_rows_key(rhs_g, False), reordered)
    return g, rhs_g, pins, order


def _cbc_search(
    f, rhs, time_limit, gap, verbose, minimize_budget=False, pins=None, cutoff=None
) -> RawResult:
    """CBC through cylp directly (the library cvxpy itself calls for CBC): cvxpy's
    interface does not pass on CBC's best bound, so it could report no gap.

    With `cutoff` (ms) only schedules cheaper than it are searched for; a search that
    proves there is none returns status "cutoff", no schedule and the cutoff as bound.

    When CBC restarted (see _cbc_run), its claim is not taken: it solves again for a
    schedule cheaper than its own by more than the tolerance, and again, until a run
    that did not restart finishes (a run that finds nothing below the cutoff holds no
    schedule to fix columns by, so it cannot restart) or the time runs out."""
    started = time.perf_counter()
    rows = cbc_rows(f, rhs, minimize_budget)  # each re-solve below reuses them
    run = _cbc_run(f, rows, time_limit, gap, verbose, minimize_budget, pins, cutoff)
    if run.status == "infeasible" and not run.restarted:
        if cutoff is not None:
            return RawResult("cutoff", None, None, cutoff * MS, None, 0.0, "CBC",
                             "nothing cheaper than the cutoff")  # fmt: skip
        return RawResult("infeasible", None, None, None, None, 0.0, "CBC")
    best, lower = run.x, run.bound
    if cutoff is not None and lower is not None:
        lower = min(lower, cutoff)  # what the cut problem's bound says of the whole one
    if best is None:  # a bound without a schedule is kept: a returned start is measured by it
        known = run.status in STOPPED and not minimize_budget
        return RawResult(
            "error", None, None, lower * MS if known and lower is not None else None, None,
            0.0, "CBC", f"no schedule ({run.status})",
        )  # fmt: skip
    while run.restarted and not minimize_budget:
        objective = float(f.cost @ best)
        remaining = None if not time_limit else time_limit - (time.perf_counter() - started)
        if within_tolerance(f, objective, lower, gap) or (remaining is not None and remaining < 1):
            break
        cutoff = objective - slack_ms(f, objective, gap)
        run = _cbc_run(f, rows, remaining, gap, verbose, False, pins, cutoff)
        if run.x is not None:
            best = run.x
        # The optimum is above the cutoff, or within the cut problem and so above its bound.
        if run.status == "infeasible" and not run.restarted:
            cut_bound = cutoff
        else:
            cut_bound = None if run.bound is None else min(cutoff, run.bound)
        if cut_bound is not None:
            lower = cut_bound if lower is None else max(lower, cut_bound)
        if run.x is None and run.restarted:  # nothing new: the same run again would repeat
            break
    objective = float(f.cost @ best)
    gap_value = relative_gap(objective, lower)
    finished = run.status in ("solution", "infeasible") and not run.restarted
    proven = within_tolerance(f, objective, lower, gap, minimize_budget)
    final = "optimal" if finished or (proven and not minimize_budget) else "feasible"
    return _finish(f, best, final, lower, gap_value, gap, "CBC", minimize_budget)


def _cbc_bound_before_restart(log: str) -> float | None:
    """The best bound CBC's log shows before its first restart (None: none shown): the
    LP relaxation, the root bound after cuts, the tree's best possible; each taken as
    the least value that prints so (the log rounds them)."""
    before = log.split("Cbc0044I", 1)[0]
    patterns = (
        rf"Continuous objective value is {_NUMBER}",
        rf"Cbc0013I At root node, .*? to {_NUMBER} in",
        _CBC_POSSIBLE.pattern,
    )
    found = [_least_printed_as(v) for p in patterns for v in re.findall(p, before)]
    return max(found) if found else None


def _least_printed_as(printed: str) -> float:
    """The least value that rounds to `printed`: CBC's summary prints its bound to a few
    digits ("Lower bound: 2.861" for a bound of 2.86055 ms), which can put it above the
    optimum."""
    mantissa, _, exponent = printed.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return float(printed) - 0.5 * 10.0 ** (int(exponent or 0) - decimals)


_CBC_POSSIBLE = re.compile(rf"best possible {_NUMBER}")
