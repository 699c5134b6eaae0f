"""The MILP: optimal on tiny problems (checked by brute force), safe on real graphs."""

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import monet_like.solver as solver_module
import monet_like.solver.backends.highs as highs_module
import monet_like.solver.cuts as cuts_module
import monet_like.solver.neighbourhood as neighbourhood_module
import monet_like.solver.start as start_module
from monet_like.errors import UserError
from monet_like.graph import capture
from monet_like.memory import last_uses
from monet_like.models import parse_model
from monet_like.profile import profile
from monet_like.schedule import finalize
from monet_like.solution import SolutionFileError, load
from monet_like.solver import (
    DEFAULT_DEPTH,
    InfeasibleBudget,
    min_feasible_budget,
    solve,
)
from monet_like.solver.backends import RawResult, abs_gap_ms, within_tolerance
from monet_like.solver.backends.cbc import (
    _cbc_bound_before_restart,
    _cbc_matrix,
    _shuffled,
    cbc_rows,
    merge_cbc_outcomes,
)
from monet_like.solver.backends.highs import is_feasible, relaxation, relaxation_infeasible
from monet_like.solver.backends.pulp import _CbcLogWatch, _pulp_bound, children_running
from monet_like.solver.cuts import CutSeparator, root_cuts, with_cuts
from monet_like.solver.evaluate import evaluate
from monet_like.solver.formulation import MS, _rhs_for, carried_over, formulate
from monet_like.solver.milp import solve_formulation
from monet_like.solver.neighbourhood import lower_cost, shrink_peak
from monet_like.solver.problem import AlgorithmChoice, Problem, Stage, Unit, build_problem
from monet_like.solver.start import (
    _fit,
    greedy_start,
    least_peak_start,
    remember_least_peak,
    remembered_least_peak,
    rounded_start,
    start_schedule,
)
from monet_like.units import GIB, gb_at_least
from monet_like.variants import apply as apply_variants

MIB = 2**20
ROOT = Path(__file__).resolve().parents[1]
SOLVERS = ["HIGHS", "CBC", "PULP"]


def between(low: int, problem, fraction: float) -> int:
    """The budget `fraction` of the way from the smallest feasible one to store-all's."""
    return int(low + fraction * (problem.store_all_peak_bytes - low))


def toy_problem(
    edges: dict[int, tuple[int, ...]], sizes, times, stage_needs, grad=1, grad_at_start=False
) -> Problem:
    """A hand-made problem: units with inputs, and backward stages needing units (with
    `grad` MiB of gradients at their ops, and also while they recompute if
    `grad_at_start`)."""
    n = len(sizes)
    last_fwd = [max([u] + [v for v in range(n) if u in edges.get(v, ())]) for u in range(n)]
    units = [
        Unit(u, (u,), (u,), sizes[u] * MIB, times[u], 0, tuple(edges.get(u, ())), last_fwd[u])
        for u in range(n)
    ]
    start = grad * MIB if grad_at_start else 0
    stages = [
        Stage(t, need[-1], (), tuple(need), grad * MIB, start_bytes=start)
        for t, need in enumerate(stage_needs)
    ]
    return Problem(units, stages, 0, [0] * n, 0, 1.0, 0)


CHAIN = toy_problem(
    {1: (0,), 2: (1,)}, sizes=[4, 3, 2], times=[3e-3, 1e-3, 2e-3], stage_needs=[[2, 1], [1, 0], [0]]
)
DIAMOND = toy_problem(
    {1: (0,), 2: (0,), 3: (1, 2)},
    sizes=[4, 2, 3, 1],
    times=[5e-3, 1e-3, 2e-3, 1e-3],
    stage_needs=[[3, 2], [2, 0], [1, 0]],
)
# The last stage needs unit 2, dropped: recomputing it needs unit 1 and so unit 0 too,
# and only freeing unit 0 once unit 1 is back fits that in 9 MiB.
FREED = toy_problem(
    {1: (0,), 2: (1,)},
    sizes=[2, 3, 4],
    times=[4e-3, 1e-3, 1e-3],
    stage_needs=[[0], [1, 0], [2]],
    grad_at_start=True,
)


# A dropped unit (1) recomputed for its reader (2) in one stage and needed itself in a
# later one: the LP relaxation recomputes and holds halves of them (recompute-count cuts,
# solver/cuts.py, lift its bound at 11 MiB: 4.467 to 5.300 ms).
MIXED = toy_problem(
    {1: (0,), 2: (1,), 3: (2,)},
    sizes=[3, 5, 4, 5],
    times=[5e-3, 1e-3, 1e-3, 3e-3],
    stage_needs=[[2], [2, 1], [0]],
)


def feasible_assignments(f, budget_bytes):
    """Every 0/1 assignment of the binary columns that satisfies every row, as the
    columns of a matrix (by enumeration)."""
    rhs = f.rhs.copy()
    rhs[f.budget_rows] = budget_bytes / MIB - f.budget_const
    ab, ac = f.a_bool.toarray(), f.a_cont.toarray()
    eq, le = f.is_eq, ~f.is_eq
    xs = np.array(list(itertools.product([0, 1], repeat=f.n_bool)), dtype=float).T
    ys = np.zeros((f.n_cont, xs.shape[1]))
    # The full formulation's frees only lower memory: each takes the largest value its
    # own rows (one continuous term: free <= R, free <= 1 - R, ...) allow.
    for j in f.free_columns:
        own = le & (ac[:, j] == 1) & (np.count_nonzero(ac, axis=1) == 1)
        assert own.any()
        ys[j] = np.min(rhs[own][:, None] - ab[own] @ xs, axis=0)
    # Every other continuous column is a running sum, fixed by its own equality row.
    sums = np.setdiff1d(np.arange(f.n_cont), f.free_columns)
    defining = eq & np.any(ac != 0, axis=1)
    assert defining.sum() == len(sums)
    known = rhs[defining][:, None] - ab[defining] @ xs - ac[defining] @ ys
    ys[sums] = np.linalg.solve(ac[defining][:, sums], known)
    ok = np.all(ab[le] @ xs + ac[le] @ ys <= rhs[le][:, None] + 1e-9, axis=0)
    return xs[:, ok]


def brute_force(f, budget_bytes):
    """Cheapest 0/1 assignment satisfying every row, by enumeration (None: infeasible)."""
    xs = feasible_assignments(f, budget_bytes)
    if xs.shape[1] == 0:
        return None
    return float((f.cost @ xs).min()) * 1e-3


@pytest.mark.parametrize(
    "problem, depth", [(CHAIN, None), (DIAMOND, 1), (FREED, None), (MIXED, None)]
)
@pytest.mark.parametrize("budget_mib", [5, 7, 9, 12, 20])
def test_solvers_find_the_brute_force_optimum(problem, depth, budget_mib):
    f = formulate(problem, depth)
    assert f.n_bool <= 20, "keep the enumeration small"
    best = brute_force(f, budget_mib * MIB)
    for solver in SOLVERS:
        raw = solve_formulation(f, budget_mib * MIB, solver, time_limit=30)
        if best is None:
            assert raw.status == "infeasible", solver
            continue
        assert raw.status == "optimal", solver
        assert raw.objective == pytest.approx(best, abs=1e-9), solver
        assert evaluate(f, raw.x_bool)["peak_bytes"] <= budget_mib * MIB


def test_the_full_formulation_frees_a_recomputations_inputs():
    full, compact = formulate(FREED, None), formulate(FREED, 3)  # the same candidates
    assert full.n_bool == compact.n_bool and len(full.free_columns) > 0
    best_full, best_compact = brute_force(full, 9 * MIB), brute_force(compact, 9 * MIB)
    assert best_full < best_compact
    raw = solve_formulation(full, 9 * MIB, "HIGHS", time_limit=30)
    assert raw.objective == pytest.approx(best_full, abs=1e-9)
    assert evaluate(full, raw.x_bool)["peak_bytes"] <= 9 * MIB
    # the same schedule, its inputs held until the recomputations end, does not fit
    assert evaluate(compact, raw.x_bool)["peak_bytes"] > 9 * MIB


def test_the_full_smallest_budget_falls_back_to_the_compact_one(monkeypatch):
    full = min_feasible_budget(FREED, None, False, "HIGHS")
    compact = min_feasible_budget(FREED, DEFAULT_DEPTH, False, "HIGHS")
    assert full <= compact  # every compact schedule is one of the full formulation's

    # A full min-memory solve that its time limit stops before any schedule (GoogLeNet
    # at 64 px, 300 s): the compact formulation's smallest budget, an upper bound.
    solved = solver_module._min_budget

    depths = []

    def stopped_when_full(problem, depth, *args, **kwargs):
        depths.append(depth)
        if depth is None:
            raise UserError("could not solve the min-memory problem")
        return solved(problem, depth, *args, **kwargs)

    monkeypatch.setattr(solver_module, "_min_budget", stopped_when_full)
    assert min_feasible_budget(FREED, None, False, "HIGHS") == compact
    assert depths == [DEFAULT_DEPTH, None]


def test_the_compact_search_gets_the_whole_limit_before_the_full_one(monkeypatch):
    # Given half the limit, GoogLeNet's compact search (196 s of 300) stopped above its
    # own answer: it now has the whole limit, and the full search what is left.
    solved = solver_module._min_budget
    calls = []

    def recorded(problem, depth, ablation, solver, time_limit, *args, **kwargs):
        calls.append((depth, time_limit))
        return solved(problem, depth, ablation, solver, time_limit, *args, **kwargs)

    monkeypatch.setattr(solver_module, "_min_budget", recorded)
    min_feasible_budget(FREED, None, False, "HIGHS", time_limit=100.0)
    (first_depth, first_limit), (second_depth, second_limit) = calls
    assert (first_depth, first_limit) == (DEFAULT_DEPTH, 100.0)
    assert second_depth is None and 1.0 <= second_limit < 100.0

    calls.clear()  # under a second left: no full search, the compact answer stands
    compact = solved(FREED, DEFAULT_DEPTH, False, "HIGHS", 0.5)
    assert min_feasible_budget(FREED, None, False, "HIGHS", time_limit=0.5) == compact
    assert calls == [(DEFAULT_DEPTH, 0.5)]


def test_the_time_limit_is_shared_by_the_graphs_a_mode_solves(monkeypatch):
    """With a baseline, up to three graphs are solved: `time_limit` bounds them all, the
    mode's graph getting all but a fifth of it per graph after it."""
    limits = []

    def timed_solve(graph, prof, budget, reference, problem, **options):
        limits.append(options["time_limit"])
        time.sleep(0.3)
        return SimpleNamespace(predicted_time_s=float(len(limits)), extra={})

    graph = SimpleNamespace(variants=("inplace",))
    three = [(what, graph, None, None) for what in ("mode", "captured", "algorithms")]
    monkeypatch.setattr(solver_module, "_solve", timed_solve)
    monkeypatch.setattr(solver_module, "align_times", lambda prof, *graphs: prof)
    monkeypatch.setattr(solver_module, "candidate_graphs", lambda *args: three)
    eager = SimpleNamespace(store_all_time_s=1.0, store_all_peak_bytes=1)
    monkeypatch.setattr(solver_module, "build_problem", lambda *_args, **_kw: eager)
    monkeypatch.setattr(solver_module, "_fastest_step_s", lambda _problem: 0.0)  # each may win
    monkeypatch.setattr(solver_module, "_step_bound_before_solve", lambda *_args: (0.0, None))
    best = solve(graph, None, 1, mode="inplace_normal", time_limit=100.0, baseline=(graph, None))
    assert best.predicted_time_s == 1.0
    assert limits[0] == pytest.approx(100.0 * (1 - 2 * solver_module.OTHER_GRAPH_SHARE), abs=0.1)
    assert limits[1] == pytest.approx((100.0 - 0.3) / 2, abs=0.2)
    assert limits[2] == pytest.approx(100.0 - 0.6, abs=0.3)  # the last: all that is left


def test_the_graph_with_the_lowest_bound_is_solved_first(monkeypatch):
    """The graphs a mode weighs are solved lowest step bound first (a tie keeps the mode's
    graph, then the algorithms alone, then the captured graph), so that the schedule in
    hand lets the others' bounds skip their MILPs; the fastest schedule is kept."""
    calls, lines = [], []
    bounds = {"mode": 3.0, "captured": 2.0, "algorithms": 2.0}

    def fake_solve(graph, prof, budget, reference, problem, **options):
        calls.append(graph.name)
        return SimpleNamespace(predicted_time_s=bounds[graph.name] + 1.0, extra={})

    three = [
        (what, SimpleNamespace(name=what, variants=variants), None, None)
        for what, variants in (
            ("mode", ("inplace", "conv")),
            ("captured", ()),
            ("algorithms", ("conv",)),
        )
    ]
    monkeypatch.setattr(solver_module, "_solve", fake_solve)
    monkeypatch.setattr(solver_module, "align_times", lambda prof, *graphs: prof)
    monkeypatch.setattr(solver_module, "candidate_graphs", lambda *args: three)
    problems = {
        what: SimpleNamespace(name=what, store_all_time_s=1.0, store_all_peak_bytes=1)
        for what in bounds
    }
    monkeypatch.setattr(solver_module, "build_problem", lambda g, *_args, **_kw: problems[g.name])
    monkeypatch.setattr(solver_module, "_fastest_step_s", lambda _problem: 0.0)
    monkeypatch.setattr(
        solver_module,
        "_step_bound_before_solve",
        lambda problem, *_args: (bounds[problem.name], None),
    )
    best = solve(
        three[0][1], None, 1, mode="inplace_conv", baseline=(three[1][1], None),
        progress=lines.append,
    )  # fmt: skip
    assert calls == ["algorithms", "captured", "mode"]
    assert best.predicted_time_s == 3.0
    assert lines[0].startswith(
        "solving algorithms first: its LP relaxation bounds its step at 2.0000 s"
    )


@pytest.fixture(scope="module")
def resnet18():
    torch.manual_seed(0)
    model = parse_model("torchvision.models.resnet18()").build()
    graph = capture(model, (3, 64, 64), 16)
    prof = profile(model, graph, repeats=1, progress=False)
    return graph, prof, build_problem(graph, prof)


@pytest.fixture(scope="module")
def resnet18_full_low(resnet18):
    """The full formulation's smallest budget, searched once for the tests that start
    from it (the four tests that each searched it took 183 to 209 s apiece in one CI
    check's run, under 30 s in another: the search's time depends on the profile)."""
    return min_feasible_budget(resnet18[2], None, False, "HIGHS")


def test_the_smallest_budget_is_never_above_store_alls(resnet18, monkeypatch, nothing_remembered):
    """A search stopped with a schedule above store-all's peak (every recomputation
    column on, standing in for a poor incumbent) and windows that cannot improve it:
    the smallest budget is store-all's, not that schedule's (the greedy schedule, which
    would replace it, made as poor too)."""
    from monet_like.solver.start import store_all_start

    _, _, problem = resnet18
    f = formulate(problem, DEFAULT_DEPTH)
    poor = store_all_start(f)
    poor[list(f.r_index.values())] = 1
    kept_all = evaluate(f, store_all_start(f))["peak_bytes"]
    assert evaluate(f, poor)["peak_bytes"] > kept_all
    monkeypatch.setattr(
        solver_module, "solve_formulation",
        lambda f_, *a, **k: RawResult("feasible", poor.copy(), 1.0, None, None, 0.0, "HIGHS"),
    )  # fmt: skip
    monkeypatch.setattr(solver_module, "least_peak_start", lambda f_: poor.copy())
    monkeypatch.setattr(solver_module, "shrink_peak", lambda f_, x, *a, **k: x)
    lines = []
    low = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS", progress=lines.append)
    assert low == kept_all
    assert any("start from store-all" in line for line in lines)


@pytest.fixture(scope="module")
def resnet18_full_mode():
    """ResNet-18 (32 px, batch 2) in the full mode, with its captured graph's profile as
    the reference: convolution algorithms and variant choices in the problem."""
    torch.manual_seed(0)
    model = parse_model("torchvision.models.resnet18()").build()
    captured = capture(model, (3, 32, 32), 2)
    graph = apply_variants(capture(model, (3, 32, 32), 2), "inplace_conv_multiway_newnode")
    reference = profile(model, captured, repeats=1, progress=False)
    return build_problem(
        graph, profile(model, graph, repeats=1, progress=False), reference=reference
    )


@pytest.mark.parametrize("depth", [DEFAULT_DEPTH, 2])
def test_the_peak_evaluated_is_the_one_the_budget_rows_count(resnet18_full_mode, depth):
    """`evaluate` (every stage at once, in array operations) and the formulation's own
    memory rows, the running sums substituted out, give the same peak for schedules
    with random kept units, algorithm options and variant choices."""
    problem = resnet18_full_mode
    assert problem.algorithms and problem.choices
    f = formulate(problem, depth)
    rows = cbc_rows(f, _rhs_for(f, 0))  # at a budget of 0: each row's need is its excess
    budget_rows = np.isin(rows.source, f.budget_rows)
    a, b = rows.a[budget_rows][:, : f.n_bool], rows.rhs[budget_rows]
    rng = np.random.default_rng(0)
    peaks = set()
    for share_kept in (0.1, 0.5, 0.9) * 4:
        x = _fit(f, rng.random(len(problem.units)) < share_kept)
        for cols in [*f.fwd_cols, *f.bwd_cols]:
            if len(cols):
                x[cols] = 0
                x[rng.choice(cols)] = 1
        for (t, u), cols in f.rec_alg.items():  # a recomputation runs the option chosen
            x[cols] = 0
            if x[f.r_index[t, u]]:
                x[cols[int(np.argmax(x[f.fwd_cols[f.algorithm_of[u]]]))]] = 1
        for on, off in zip(f.on_col, f.off_col, strict=True):
            x[on] = rng.random() < 0.5
            x[off] = 1 - x[on]
        peak = evaluate(f, x)["peak_bytes"]
        assert peak == pytest.approx(float((a @ x - b).max()) * MIB, abs=16)
        peaks.add(peak)
    assert len(peaks) > 6  # the schedules differ


def test_windows_shrink_the_peak_down_to_the_smallest_budget(resnet18):
    # From the store-all schedule, windows of 8 units re-solved in turn lower the peak,
    # widening until one covers the network: the MILP's own smallest budget at the end,
    # within the 0.1% to which that search proves it (one run ended 0.06% below it).
    graph, prof, problem = resnet18
    f = formulate(problem, DEFAULT_DEPTH)
    store_all = solve_formulation(f, problem.store_all_peak_bytes, "HIGHS", 60).x_bool
    assert evaluate(f, store_all)["peak_bytes"] == problem.store_all_peak_bytes
    lines = []
    x = shrink_peak(f, store_all, "HIGHS", time.perf_counter() + 120, lines.append, width=8)
    smallest = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS")
    assert abs(evaluate(f, x)["peak_bytes"] - smallest) <= 1e-3 * smallest
    assert any("units" in line for line in lines)  # a window, not the whole solve, improved


def test_windows_lower_a_starts_cost_to_the_optimum_with_cbc(resnet18):
    # CBC through cylp takes no start: each window asks it for a schedule cheaper than
    # the best one (a cutoff), and the windows widen until one would cover the network
    # (the whole problem is left to the search that follows): here that reaches the
    # optimum, within CBC's 0.1%.
    graph, prof, problem = resnet18
    f = formulate(problem, DEFAULT_DEPTH)
    low = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS")
    budget = between(low, problem, 0.5)
    # The optimum at the smallest budget fits this one, recomputing more than it need
    # (three times as much in one run).
    start = solve_formulation(f, low, "HIGHS", 120).x_bool
    optimum = solve_formulation(f, budget, "HIGHS", 120, gap=1e-4).objective  # seconds
    assert float(f.cost @ start) * MS > optimum * 1.1  # something to improve
    lines = []
    x = lower_cost(f, start, budget, "CBC", time.perf_counter() + 180, lines.append, width=8)
    assert evaluate(f, x)["peak_bytes"] <= budget
    assert float(f.cost @ x) * MS <= optimum * (1 + 1e-3) + 1e-9
    assert any("units" in line for line in lines)  # a window, not the whole solve, improved


def test_cbc_with_a_cutoff_returns_only_a_cheaper_schedule_or_proves_there_is_none(resnet18):
    graph, prof, problem = resnet18
    f = formulate(problem, DEFAULT_DEPTH)
    low = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS")
    budget = between(low, problem, 0.3)
    optimum = solve_formulation(f, budget, "HIGHS", 120, gap=1e-4).objective  # seconds
    above = solve_formulation(f, budget, "CBC", 120, cutoff_ms=optimum * 1.05 / MS)
    assert above.status == "optimal" and above.objective <= optimum * 1.05
    assert evaluate(f, above.x_bool)["peak_bytes"] <= budget
    below = solve_formulation(f, budget, "CBC", 120, cutoff_ms=optimum * 0.9 / MS)
    assert below.status == "cutoff" and below.x_bool is None
    assert below.bound == pytest.approx(optimum * 0.9)


@pytest.fixture
def nothing_remembered(monkeypatch, tmp_path):
    """No earlier smallest-budget search's schedule, in memory or in the cache folder
    (`start.remember_least_peak`): another test's search on the same rows may have left
    one, and the search would start from it."""
    monkeypatch.setattr(start_module, "_least_peak", {})
    monkeypatch.setenv("MONET_LIKE_CACHE", str(tmp_path))


@pytest.mark.parametrize("status", ["feasible", "optimal", "none"])
def test_a_stopped_min_memory_search_is_followed_by_windows(
    resnet18, monkeypatch, nothing_remembered, status
):
    # Normal mode: the MILP has two thirds of the limit; stopped with a schedule (here
    # made to stop with the store-all one), the windows take it on for the rest.
    # ResNet-50 at 184: the MILP stopped at 4.355 GB, the windows reached the proved
    # optimum, 4.2826 GB, in 17 s. A proved answer is returned as it is. Stopped with
    # no schedule at all (GoogLeNet at 320 after 200 s), the windows start from a
    # greedy one.
    graph, prof, problem = resnet18
    f = formulate(problem, DEFAULT_DEPTH)
    store_all = solve_formulation(f, problem.store_all_peak_bytes, "HIGHS", 60).x_bool
    limits, lines = [], []

    def stopped(f_, budget, solver, time_limit=None, **options):
        limits.append(time_limit)
        if status == "none":
            return RawResult("feasible", None, None, None, None, time_limit, solver)
        return RawResult(status, store_all, float(f.cost @ store_all) * MS, None, None, 0, solver)

    monkeypatch.setattr(solver_module, "solve_formulation", stopped)
    x = solver_module._min_schedule(f, "HIGHS", 60.0, None, lines.append)
    assert limits == [pytest.approx(40.0)]
    peak = evaluate(f, x)["peak_bytes"]
    if status == "none":
        assert any("greedy schedule" in li and "the MILP found no schedule" in li for li in lines)
    if status == "optimal":
        assert peak == problem.store_all_peak_bytes
    else:
        smallest = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS")
        assert abs(peak - smallest) <= 1e-3 * smallest


@pytest.mark.parametrize("fraction", [0.9, 0.6, 0.3])
def test_every_solution_fits_its_budget(resnet18, resnet18_full_low, fraction):
    graph, prof, problem = resnet18
    budget = between(resnet18_full_low, problem, fraction)
    sol = solve(graph, prof, budget, solver="HIGHS", time_limit=60)
    assert sol.status == "optimal"
    assert sol.predicted_peak_bytes <= budget
    assert sol.predicted_time_s >= sol.store_all_time_s
    assert sol.fingerprint == graph.fingerprint and len(sol.keep) == len(problem.units)


def test_a_graph_whose_lp_bound_cannot_beat_the_schedule_in_hand_is_not_solved(resnet18):
    """Given the predicted step of a schedule in hand (another graph's), `_solve` raises
    `_CannotWin` before its MILP where the graph's fastest step plus its LP relaxation's
    recomputation is no less; the bound is a true one (at most the optimum), and one
    above the optimum never stops the solve. With the frees left to the solve (the
    default) the bound is their LP's, no higher than the one without them."""
    graph, prof, problem = resnet18
    budget = between(problem.fixed_bytes, problem, 0.85)
    options = dict(
        mode="normal", solver="HIGHS", time_limit=60.0, formulation="compact", depth=None,
        ablation=False, gap=1e-4, verbose=False, progress=None, reference=None,
    )  # fmt: skip

    def solved(beat_s=None, frees=None):
        return solver_module._solve(
            graph, prof, budget, problem=problem, beat_s=beat_s, frees=frees, **options
        )

    optimum = solved()
    assert optimum.status == "optimal"
    fastest = solver_module._fastest_step_s(problem)
    assert optimum.predicted_time_s > fastest  # recomputation needed: the LP sees some
    again = solved(beat_s=optimum.predicted_time_s + 1e-9)
    assert again.predicted_time_s == pytest.approx(optimum.predicted_time_s)
    bounds = {}
    for frees in (None, False):
        with pytest.raises(solver_module._CannotWin) as stopped:
            solved(beat_s=fastest, frees=frees)
        bounds[frees] = stopped.value.bound_s
        assert fastest < bounds[frees] <= optimum.predicted_time_s + 1e-9
    assert bounds[None] <= bounds[False]


def test_budget_above_store_all_returns_store_all_without_solving(resnet18):
    graph, prof, problem = resnet18
    sol = solve(graph, prof, problem.store_all_peak_bytes + 1, solver="HIGHS")
    assert sol.status == "store-all" and sol.stats == {} and sol.solve_time_s == 0
    assert not any(s["recompute"] for s in sol.stages)
    assert sol.predicted_peak_bytes == problem.store_all_peak_bytes


def test_infeasible_budgets_report_the_smallest_feasible_one(resnet18):
    # The compact formulation: its search proves the smallest budget in seconds, where
    # the full one's took 378 s for the two calls in a CI check's run, and a search its
    # time limit stops need not land on the same budget twice.
    graph, prof, problem = resnet18
    with pytest.raises(InfeasibleBudget) as below_fixed:
        solve(graph, prof, problem.fixed_bytes // 2, solver="HIGHS")
    assert "fixed part" in str(below_fixed.value)
    smallest = below_fixed.value.min_budget_bytes
    assert problem.fixed_bytes < smallest < problem.store_all_peak_bytes
    with pytest.raises(InfeasibleBudget) as just_below:
        solve(graph, prof, smallest - MIB, solver="HIGHS")
    assert just_below.value.min_budget_bytes == smallest
    sol = solve(graph, prof, smallest, solver="HIGHS", formulation="full", time_limit=60)
    assert sol.predicted_peak_bytes <= smallest
    # The budget the message prints, typed back as solve.py reads it, fits: rounded up.
    typed = re.search(r"smallest feasible budget is ([0-9.]+) GB", str(just_below.value))
    budget = int(float(typed.group(1)) * GIB)
    assert smallest <= budget < smallest + GIB // 10**4 + 1
    assert solve(graph, prof, budget, solver="HIGHS", time_limit=30).predicted_peak_bytes <= budget
    assert gb_at_least(60471528) == "0.0564" and gb_at_least(GIB) == "1.0000"  # 0.05632 GB


def test_ablation_forbids_recomputation(resnet18, resnet18_full_low):
    graph, prof, problem = resnet18
    with_recompute = resnet18_full_low
    without = min_feasible_budget(problem, None, True, "HIGHS")
    assert without > with_recompute
    sol = solve(graph, prof, without, solver="HIGHS", ablation=True)
    assert not any(s["recompute"] for s in sol.stages)


SMALL_GRAPHS = [
    ("torchvision.models.resnet18()", (3, 64, 64), 16),
    ("torchvision.models.mobilenet_v2()", (3, 64, 64), 8),
    ("torchvision.models.googlenet()", (3, 64, 64), 8),
    ("unet(base=8)", (3, 64, 64), 4),
    ("gpt(depth=2, dim=64)", (64,), 8),
]
# Where the compact formulation is more than 2% off the full one (docs/benchmarks.md): a
# GPT block is a long chain, recomputed whole, and the compact formulation holds each
# recomputed unit until the stage's recomputations end, where the full one frees it
# after its last reader. Its smallest budget is 16% lower in the full formulation, and
# near it the compact optimum was 72% costlier in one profile, equal in another. The
# UNet's smallest budget is 3% lower in the full formulation, and in one fresh-clone
# run its compact optimum was 3.8% costlier (8.65 against 8.33 ms) at 20% or 50%.
LONG_CHAINS = {"gpt(depth=2, dim=64)", "unet(base=8)"}


def _outputs_freed_a_stage_early(graph, problem) -> int:
    """Bytes of the units' outputs whose last reader runs in an earlier backward stage
    than their unit's last reader (a max pool's output, read by the next convolution's
    backward, against its indices, read by its own): the formulation counts them on."""
    stage_of = {i: t for t, stage in enumerate(problem.stages) for i in stage.ops}
    last = last_uses(graph)
    early = 0
    for unit in problem.units:
        stages = [stage_of.get(last[s], -1) for s in unit.storages]
        early += sum(
            graph.storages[s].nbytes
            for s, t in zip(unit.storages, stages, strict=True)
            if t < max(stages)
        )
    return early


@pytest.mark.parametrize("expression, shape, batch", SMALL_GRAPHS)
def test_store_all_is_exact_and_compact_is_within_two_percent_of_full(expression, shape, batch):
    torch.manual_seed(0)
    model = parse_model(expression).build()
    graph = capture(model, shape, batch)
    prof = profile(model, graph, repeats=1, progress=False)
    problem = build_problem(graph, prof)
    # Without recomputation the model's bytes are the store-all step's: a saved value
    # counts until its last reader inside a stage, not to the stage's end. Exactly, but
    # for the outputs of a unit last read a stage before its others (docs/solver.md).
    no_recompute = min_feasible_budget(problem, DEFAULT_DEPTH, True, "HIGHS")
    early = _outputs_freed_a_stage_early(graph, problem)
    assert problem.store_all_peak_bytes <= no_recompute <= problem.store_all_peak_bytes + early, (
        no_recompute,
        problem.store_all_peak_bytes,
        early,
    )
    # The compact formulation's smallest budget is feasible for the full one too, which
    # contains it. 60 s: GoogLeNet's search takes 195 s to prove 107.62 MiB, and stopped
    # at 60 s it holds 107.92 MiB, a feasible budget 0.3% higher: as good a place to start
    # the 20% and 50% budgets from, and two to three minutes less.
    low = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS", time_limit=60)
    for fraction in (0.2, 0.5):
        budget = between(low, problem, fraction)
        # 60 s: GoogLeNet's full solves take 60-110 s alone (a 5-minute test beside
        # another worker at 120 s); stopped, the full formulation's schedule is only
        # costlier, and its bound still holds.
        full = solve(graph, prof, budget, solver="HIGHS", formulation="full", time_limit=60)
        # the compact formulation itself: the default would try the frees after it
        compact = solve(graph, prof, budget, solver="HIGHS", time_limit=120, frees=False)
        assert compact.stats["variables"] <= full.stats["variables"]
        # Every compact schedule is one of the full formulation's: never below its bound.
        # A full solve whose limit fell before its root LP ended (under load) has none.
        if full.bound_s is not None:
            assert compact.objective_s >= full.bound_s - 1e-6
        else:
            assert full.status != "optimal", full.stats
        if expression in LONG_CHAINS:
            # With the frees tried (the default): no costlier, and its schedule, built and
            # simulated on fake tensors, within the budget. (It can cost less than the
            # full formulation's bound: the bridges hold values across stages that read
            # nothing, which the full formulation cannot: UNet at 20%, one profile, 4.32 ms
            # with them, 5.00 ms without, as the full formulation's optimum.)
            default = solve(graph, prof, budget, solver="HIGHS", time_limit=120)
            first = default.stats["first_search"]
            assert default.objective_s <= first["recompute_s"] + 1e-9, (default.stats, first)
            # Its first search is the compact one again, both "optimal" within 0.1% of the
            # step, cuts and starts cut short by load: they may differ by that (GPT in a
            # loaded suite once 2.48 against 1.81 ms; one repeat under load can time a
            # step of this GPT at 0.32 s, its quiet 13 ms).
            if first["status"] == compact.status == "optimal":
                tolerance = 1e-3 * problem.fastest_step_s
                assert first["recompute_s"] <= compact.objective_s + tolerance + 1e-9
            assert finalize(graph, default, prof) <= budget
        if expression not in LONG_CHAINS:
            # A compact solve stopped by its limit (beside other work) may hold a costlier
            # schedule than its optimum; its bound is what it proves (MobileNetV2 failed
            # once beside a second suite, 17.00 against 6.85 ms, the status not recorded).
            # "optimal" is within 0.1% of the step (solver.md), a few percent of the
            # recomputation: GoogLeNet's, proved so, was 2.6% above the full optimum
            proved = compact.status == "optimal"
            tolerance = 1e-3 * problem.fastest_step_s
            assert (compact.objective_s if proved else compact.bound_s) <= (
                1.02 * full.objective_s + tolerance + 1e-6
            ), (compact.status, compact.objective_s, compact.bound_s, full.objective_s)
    if expression in LONG_CHAINS:
        # The full formulation reaches 2% below the compact one's smallest budget (UNet
        # 3.1%, 7748232 against 7999080 bytes, one thread). Its own smallest-budget search
        # mostly finds that, but in a test worker beside another it returned the compact
        # one's budget in 2 of about 10 runs (cause not found): checked here is only that
        # it never returns more.
        below = int(0.98 * low)
        full_f = formulate(problem, None, True)
        witness = solve_formulation(full_f, below, "HIGHS", time_limit=120)
        assert witness.x_bool is not None, witness.status
        assert evaluate(full_f, witness.x_bool)["peak_bytes"] <= below
        assert min_feasible_budget(problem, None, False, "HIGHS") <= low


def _profiled(expression: str, shape: tuple, batch: int):
    """(graph, profile, problem) of a small model built from `expression`, seed 0."""
    torch.manual_seed(0)
    model = parse_model(expression).build()
    graph = capture(model, shape, batch, model_name=expression)
    prof = profile(model, graph, repeats=1, progress=False)
    return graph, prof, build_problem(graph, prof)


def test_the_frees_are_tried_from_the_schedule_without_them_where_their_lp_leaves_room(
    monkeypatch,
):
    """FREED at 9 MiB: without the frees the optimum recomputes 5 ms, with them 3 ms
    (unit 0 freed once unit 1 is back). The default solve's second step, from the first
    one's schedule, finds the cheaper one; it is not tried where the saving the frees'
    LP allows is below FREES_WORTH of the store-all step (here 1 s: 50 ms). With a
    solver that takes no start, HiGHS searches from it."""
    budget = 9 * MIB
    plain = formulate(FREED, DEFAULT_DEPTH, True)
    first = solve_formulation(plain, budget, "HIGHS", 10)
    assert first.status == "optimal" and first.objective == pytest.approx(5e-3)

    def refined(solver: str = "HIGHS"):
        return solver_module._refined_with_frees(
            FREED, DEFAULT_DEPTH, plain, first.x_bool, budget, solver, 1e-3, False, None, None
        )

    assert refined() == (None, None)  # 5 ms recomputed: below 5% of the step
    monkeypatch.setattr(solver_module, "FREES_WORTH", 1e-3)
    _, through_cbc = refined("CBC")
    assert through_cbc["improved"] and through_cbc["solver"] == "HIGHS"
    (with_frees, raw, x, peak), tried = refined()
    assert with_frees.free_plans is not None and raw.status == "optimal"
    assert float(with_frees.cost @ x) == pytest.approx(3.0) and peak["peak_bytes"] <= budget
    assert tried["improved"] and tried["cost_ms"] == pytest.approx(5.0)
    assert 0.0 <= tried["best_found_s"] <= tried["seconds"]  # when the cheaper one came
    assert tried["lp_bound_ms"] <= 3.0 + 1e-6
    # Where the frees' LP leaves less than FREES_WORTH below the schedule: not solved.
    monkeypatch.setattr(solver_module, "FREES_WORTH", (5.0 - tried["lp_bound_ms"]) / 1e3 + 1e-4)
    none, tried = refined()
    assert none is None and not tried["improved"]


def test_frees_lower_the_compact_formulations_smallest_budget():
    # A GPT block is a chain recomputed whole: holding each recomputed unit to the end
    # of the recomputations costs memory that freeing it after its last reader saves.
    graph, prof, problem = _profiled("gpt(depth=2, dim=64)", (64,), 8)
    held = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS")
    # Left to the search (solve.py's default), the frees are tried after the plain
    # search, their LP reaching lower; for at most a fifth of the limit.
    lines: list[str] = []
    default_low = min_feasible_budget(
        problem, DEFAULT_DEPTH, False, "HIGHS", time_limit=30, frees=None, progress=lines.append
    )
    assert default_low < 0.95 * held and "the same with the frees, from that schedule" in lines
    # 30 s: the windows from the greedy schedule go on lowering it by a percent or so
    freed = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS", time_limit=30, frees=True)
    assert freed < 0.95 * held
    sol = solve(graph, prof, freed, solver="HIGHS", frees=True, time_limit=30)
    assert sol.stats["frees"] and sol.predicted_peak_bytes <= freed
    # The search's schedule is kept for that solve, whose start then needs no search of
    # its own (the heuristics rarely reach such a budget; where one does, the cheaper).
    with_frees = formulate(problem, DEFAULT_DEPTH, True, frees=True)
    known = remembered_least_peak(with_frees)
    assert known is not None and evaluate(with_frees, known)["peak_bytes"] == freed
    assert not sol.stats["start"].startswith("least-peak search"), sol.stats["start"]
    # Without the frees (--no_frees) the same budget is out of reach, and the message
    # says why; by default (frees=None) the solve then takes them.
    with pytest.raises(InfeasibleBudget, match="--frees") as without:
        solve(graph, prof, freed, solver="HIGHS", time_limit=120, frees=False)
    assert without.value.min_budget_bytes == pytest.approx(held, rel=2e-3)
    default = solve(graph, prof, freed, solver="HIGHS", time_limit=30)
    assert default.stats["frees"] and default.predicted_peak_bytes <= freed


def test_a_least_peak_schedule_is_found_again_by_a_formulation_with_its_rows(
    monkeypatch, tmp_path, nothing_remembered
):
    """The smallest-budget search's schedule is kept by its formulation's rows, in memory
    and in the cache folder: the same formulation built again from a problem built again
    finds it (in a later process too), another does not. And a window search whose
    start meets its target solves no window."""
    graph, prof, problem = _profiled("gpt(depth=2, dim=32, heads=4, max_len=128)", (128,), 4)
    f = formulate(problem, DEFAULT_DEPTH, True)
    x = least_peak_start(f)
    remember_least_peak(f, x)
    again = formulate(build_problem(graph, prof), DEFAULT_DEPTH, True)
    assert again is not f and np.array_equal(remembered_least_peak(again), x)
    monkeypatch.setattr(start_module, "_least_peak", {})  # as a later process finds it
    assert np.array_equal(remembered_least_peak(again), x)
    assert remembered_least_peak(formulate(problem, DEFAULT_DEPTH, True, frees=True)) is None
    assert remembered_least_peak(formulate(problem, None, True)) is None

    # The folder keeps the most recently used: one read is kept, one not read is removed.
    monkeypatch.setattr(start_module, "_REMEMBERED_ON_DISK", 2)
    with_frees = formulate(problem, DEFAULT_DEPTH, True, frees=True)
    remember_least_peak(with_frees, least_peak_start(with_frees))
    folder = tmp_path / "least_peak"
    read, unread = (folder / f"{start_module._rows_key(g).hex()}.npy" for g in (f, with_frees))
    os.utime(read, (time.time() - 100,) * 2)
    os.utime(unread, (time.time() - 50,) * 2)
    monkeypatch.setattr(start_module, "_least_peak", {})
    assert np.array_equal(remembered_least_peak(again), x)
    full = formulate(problem, None, True)
    remember_least_peak(full, least_peak_start(full))
    assert read.exists() and not unread.exists() and len(list(folder.glob("*.npy"))) == 2

    def no_window(*args, **kwargs):
        raise AssertionError("a window was solved")

    monkeypatch.setattr(neighbourhood_module, "solve_formulation", no_window)
    peak = evaluate(f, x)["peak_bytes"]
    assert shrink_peak(f, x, "HIGHS", None, target_bytes=peak) is x
    with pytest.raises(AssertionError, match="a window"):
        shrink_peak(f, x, "HIGHS", None, target_bytes=peak - 1)


def test_a_smallest_budget_search_starts_from_an_earlier_searchs_schedule(
    monkeypatch, nothing_remembered
):
    """A budget tried again (or another one below the smallest) searches for the smallest
    budget again: its MILP starts from the schedule the last search found for these rows
    (MobileNetV2, 64 px, batch 16, solve.py at 0.03 GB run twice: 22.7 -> 9.3 s), and a
    remembered schedule that breaks a row is not handed over."""
    _, _, problem = _profiled("gpt(depth=2, dim=32, heads=4, max_len=128)", (128,), 4)
    first = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS", time_limit=60)
    starts = []

    def recorded(f, budget_bytes, *args, start=None, **kwargs):
        if budget_bytes is None:
            starts.append(start)
        return milp_solve(f, budget_bytes, *args, start=start, **kwargs)

    milp_solve = solver_module.solve_formulation
    monkeypatch.setattr(solver_module, "solve_formulation", recorded)
    assert min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS", time_limit=60) <= first
    f = formulate(problem, DEFAULT_DEPTH, True)
    assert starts[0] is not None and evaluate(f, starts[0])["peak_bytes"] == first

    broken = np.zeros(f.n_bool, dtype=int)
    assert not is_feasible(f, broken, problem.store_all_peak_bytes)
    start_module._least_peak[start_module._rows_key(f)] = broken
    starts.clear()
    assert min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS", time_limit=60) <= first
    assert starts[0] is None


def test_no_least_peak_search_for_a_start_where_the_lp_proves_the_budget_infeasible(
    monkeypatch,
):
    """Both heuristics fail below the smallest budget; where the LP relaxation is
    infeasible there, the least-peak search (a quarter of the time limit) is skipped."""
    graph, prof, problem = _profiled("gpt(depth=2, dim=32, heads=4, max_len=128)", (128,), 4)
    f = formulate(problem, DEFAULT_DEPTH, True)
    below = problem.fixed_bytes + MIB
    assert relaxation_infeasible(f, below)
    assert not relaxation_infeasible(f, problem.store_all_peak_bytes)

    def searched(*args, **kwargs):
        raise AssertionError("the least-peak search ran")

    monkeypatch.setattr(start_module, "_within_by_least_peak", searched)
    x, how = start_schedule(f, below, "HIGHS", peak_search_s=30.0)
    assert x is None and "LP relaxation is infeasible" in how

    # A whole solve there: the cuts', the rounding's and the start's questions are one
    # LP solve, and no MILP runs after it.
    lps, milps = [], []

    def counted_lp(f, budget_bytes, *args, **kwargs):
        lps.append(budget_bytes)
        return lp_solve(f, budget_bytes, *args, **kwargs)

    def counted_milp(f, budget_bytes, *args, **kwargs):
        milps.append(budget_bytes)
        return milp_solve(f, budget_bytes, *args, **kwargs)

    lp_solve, milp_solve = highs_module.solved_relaxation, solver_module.solve_formulation
    monkeypatch.setattr(highs_module, "solved_relaxation", counted_lp)
    monkeypatch.setattr(cuts_module, "solved_relaxation", counted_lp)
    monkeypatch.setattr(solver_module, "solve_formulation", counted_milp)
    with pytest.raises(InfeasibleBudget):
        solve(graph, prof, below, solver="HIGHS", time_limit=30, frees=False)
    assert lps.count(below) == 1 and below not in milps, (lps, milps)
    # By default, one LP more: the frees' relaxation, infeasible too, before the error.
    lps.clear()
    with pytest.raises(InfeasibleBudget):
        solve(graph, prof, below, solver="HIGHS", time_limit=30)
    assert lps.count(below) == 2 and below not in milps, (lps, milps)


def test_the_smallest_budget_search_starts_from_the_greedy_schedule_where_it_is_lower(
    monkeypatch, nothing_remembered
):
    """A search stopped with a schedule that peaks above the greedy least-peak one
    (the GPT of the benchmarks with the frees: 0.1105 GB after 120 s against the
    greedy's 0.1056 GB) has its windows start from the greedy one."""
    _, _, problem = _profiled("gpt(depth=2, dim=64)", (64,), 8)
    f = formulate(problem, DEFAULT_DEPTH, True, frees=True)
    greedy = evaluate(f, least_peak_start(f))["peak_bytes"]
    stopped = solver_module.store_all_start(f)  # what a search stopped early may hold
    assert evaluate(f, stopped)["peak_bytes"] > greedy
    found = RawResult("feasible", stopped, None, None, None, 0.0, "HIGHS")
    monkeypatch.setattr(solver_module, "solve_formulation", lambda *a, **k: found)
    monkeypatch.setattr(solver_module, "shrink_peak", lambda f, x, *a, **k: x)
    lines = []
    x = solver_module._min_schedule(f, "HIGHS", 10.0, None, lines.append)
    assert evaluate(f, x)["peak_bytes"] == greedy
    assert any("greedy schedule" in line and "lower than" in line for line in lines), lines


def test_a_recomputed_value_is_held_across_a_stage_that_reads_nothing():
    """With the frees, the value clone's backward (it reads nothing) sits between the
    attention's second matmul's backward and the softmax's, both reading the softmax
    output: bridged, the output is held across it, not recomputed again beside the
    gradients of the scores (on the benchmarks' GPT that recomputation set the smallest
    budget with the frees: docs/solver.md, bridges)."""
    _, _, problem = _profiled("gpt(depth=2, dim=32, heads=4, max_len=128, dropout=0.0)", (128,), 4)
    bridged = formulate(problem, DEFAULT_DEPTH, True, frees=True)
    plain = formulate(problem, DEFAULT_DEPTH, True, frees=True, bridges=False)
    assert bridged.hold_only and not plain.hold_only
    assert not formulate(problem, DEFAULT_DEPTH, True).hold_only  # compact with frees only
    assert not formulate(problem, None, True).hold_only
    for t in bridged.hold_only:
        assert not problem.stages[t].need and not plain.cand[t]
        assert all((t, u) not in bridged.r_index for u in bridged.cand[t])  # held only
    # Every block recomputed from the kept values; what the stages on both sides of a
    # bridged one read (the softmax output) held across it: only bridged can it be.
    only_fixed = np.array([not u.recomputable for u in problem.units])
    around = np.zeros(len(problem.units), dtype=bool)
    reads = [set(stage.need) for stage in problem.stages]
    for t in bridged.hold_only:
        before = next(r for r in reversed(reads[:t]) if r)
        after = next(r for r in reads[t + 1 :] if r)
        around[list(before & after)] = True
    assert around.any()
    x = _fit(bridged, only_fixed.copy(), around)
    held = [
        u
        for t in bridged.hold_only
        for u in bridged.cand[t]
        if x[bridged.s_index[t, u]] and not x[bridged.keep[u]]
    ]
    assert held
    x_plain = _fit(plain, only_fixed.copy(), around)
    # One recomputation of the chain fewer, at no more memory (on the benchmarks' GPT,
    # where the second recomputation set the peak, 0.1056 -> 0.1018 GB).
    assert bridged.cost @ x < plain.cost @ x_plain
    assert evaluate(bridged, x)["peak_bytes"] <= evaluate(plain, x_plain)["peak_bytes"]
    # A schedule of the plain formulation (the frees' search starts from one) is one of
    # the bridged formulation's, at the same peak, breaking none of its rows.
    plain_x = least_peak_start(plain)
    peak = evaluate(plain, plain_x)["peak_bytes"]
    same = carried_over(plain_x, plain, bridged)
    assert evaluate(bridged, same)["peak_bytes"] == peak
    assert is_feasible(bridged, same, peak) and not is_feasible(bridged, same, peak - 4096)


def test_gurobi_when_installed():
    cvxpy = pytest.importorskip("cvxpy")
    if "GUROBI" not in cvxpy.installed_solvers():
        pytest.skip("Gurobi is not installed (no licence on this machine)")
    f = formulate(CHAIN, None)
    raw = solve_formulation(f, 9 * MIB, "GUROBI", time_limit=30)
    assert raw.objective == pytest.approx(brute_force(f, 9 * MIB))


def test_solution_file_roundtrip_and_refusals(resnet18, tmp_path):
    graph, prof, problem = resnet18
    budget = (
        min_feasible_budget(problem, None, False, "HIGHS") + problem.store_all_peak_bytes
    ) // 2
    sol = solve(graph, prof, budget, solver="HIGHS")
    path = sol.save(tmp_path / "s.json")
    again = load(path)
    assert again == sol
    text = path.read_text()
    (tmp_path / "cut.json").write_text(text[: len(text) // 2])
    with pytest.raises(SolutionFileError, match="truncated"):
        load(tmp_path / "cut.json")
    newer = json.loads(text)
    newer["format_version"] = 99
    (tmp_path / "new.json").write_text(json.dumps(newer))
    with pytest.raises(SolutionFileError, match="newer"):
        load(tmp_path / "new.json")
    with pytest.raises(SolutionFileError, match="no such"):
        load(tmp_path / "missing.json")


@pytest.fixture(scope="module")
def resnet18_problem():
    model = parse_model("torchvision.models.resnet18()").build()
    graph = capture(model, (3, 64, 64), 16)
    prof = profile(model, graph, repeats=1, progress=False)
    problem = build_problem(graph, prof)
    low = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS")
    return graph, prof, problem, low


def test_the_start_rounds_the_cuts_last_lp_instead_of_solving_it_again(
    resnet18_problem, monkeypatch
):
    """The cuts' last LP is the start's LP at the budget (the formulation with the cut
    rows): the solve hands its columns to the LP rounding, which then solves LPs only at
    smaller budgets, and they are an optimum of that LP."""
    graph, prof, problem, low = resnet18_problem
    f = formulate(problem, DEFAULT_DEPTH)
    budget = between(low, problem, 0.5)
    cut_rows, stats = root_cuts(f, budget, time_limit=60.0)
    columns = stats["lp_columns"]
    assert columns is not None and len(columns) == f.n_bool
    solved_again = relaxation(with_cuts(f, cut_rows), budget)
    assert float(f.cost @ columns) == pytest.approx(float(f.cost @ solved_again), rel=1e-6)
    assert float(f.cost @ columns) == pytest.approx(stats["lp_after_s"] * 1e3, rel=1e-6)
    asked, solve_lp = [], start_module.relaxation

    def counted(f, budget_bytes, *args):
        asked.append(budget_bytes)
        return solve_lp(f, budget_bytes, *args)

    monkeypatch.setattr(start_module, "relaxation", counted)
    sol = solve(graph, prof, budget, solver="HIGHS")
    assert sol.stats["start"] is not None
    assert budget not in asked  # smaller budgets only, where no rounding fitted


def test_start_schedules_are_feasible_down_near_the_smallest_budget(resnet18_problem):
    """Both heuristics' schedules satisfy every row at their budget; LP rounding reaches
    budgets near the smallest feasible one, where the greedy stalls; the start handed
    over is the cheaper one, improved, and the solver never returns worse."""
    graph, prof, problem, low = resnet18_problem
    f = formulate(problem, DEFAULT_DEPTH)
    found = {"greedy": 0, "LP rounding": 0}
    for fraction in (0.9, 0.6, 0.3, 0.1):
        budget = between(low, problem, fraction)
        costs = []
        for name, x in (
            ("greedy", greedy_start(f, budget)),
            ("LP rounding", rounded_start(f, budget)),
        ):
            if x is None:
                continue
            found[name] += 1
            costs.append(float(f.cost @ x))
            assert evaluate(f, x)["peak_bytes"] <= budget
            assert is_feasible(f, x, budget)
            # the check can fail: not below the schedule's own peak (`low` is the smallest
            # budget within the search's 0.1%, so a schedule may fit just under it)
            assert not is_feasible(f, x, evaluate(f, x)["peak_bytes"] - 1)
        # the start as the solve takes it: on the formulation with its cut rows
        cut_rows, cut_stats = root_cuts(f, budget, time_limit=60.0)
        known = remembered_least_peak(f)  # the smallest-budget search's, as solve() takes it
        if known is not None and evaluate(f, known)["peak_bytes"] <= budget:
            costs.append(float(f.cost @ known))
        x, how = start_schedule(
            with_cuts(f, cut_rows), budget, known=known, lp_at_budget=cut_stats["lp_columns"]
        )
        if x is None and fraction == 0.1:
            # Both are heuristics on the profile's times: in one fresh-clone run (before
            # the greedy's drops were added after LP rounding) neither reached 10% of the
            # way from the smallest budget, 0.7% above it.
            continue
        assert x is not None and how.split(" + ")[0] in (*found, "smallest-budget search")
        assert is_feasible(f, x, budget) and float(f.cost @ x) <= min(costs)
        sol = solve(graph, prof, budget, solver="HIGHS")
        assert sol.stats["start"] == how and sol.stats["first_feasible_s"] is not None
        assert sol.objective_s <= sol.stats["start_objective_s"] + 1e-9  # never worse
    # A heuristic: LP rounding missed one of the four budgets once, with a profile taken
    # beside a second test suite (its LP's costs are the profile's times).
    assert found["LP rounding"] >= 3 and found["greedy"] >= 2, found


def test_lp_rounding_goes_on_with_the_greedys_drops_when_no_rounding_fits(
    resnet18_problem, monkeypatch
):
    from monet_like.solver import start

    _, _, problem, low = resnet18_problem
    f = formulate(problem, DEFAULT_DEPTH)
    budget = between(low, problem, 0.9)
    assert greedy_start(f, budget) is not None
    # Every rounding keeps every unit: the store-all schedule, above the budget.
    monkeypatch.setattr(start, "ROUNDING_THRESHOLDS", (-1.0,))
    x = rounded_start(f, budget)
    assert x is not None and is_feasible(f, x, budget)
    assert not x[f.keep].all()


@pytest.mark.parametrize("solver", ["HIGHS", "CBC", "PULP"])  # PuLP: CBC's own threads
def test_raced_searches_agree_with_one_search_and_keep_a_bound_that_holds(resnet18_problem, solver):
    _, _, problem, low = resnet18_problem
    f = formulate(problem, DEFAULT_DEPTH)
    budget = between(low, problem, 0.3)
    alone = solve_formulation(f, budget, solver, 120, workers=1)
    raced = solve_formulation(f, budget, solver, 120, workers=2)
    # CBC with threads is not deterministic: where it restarts its search, the bound
    # before the restart is all its log proves, so a finished search may say "feasible".
    proved = ("optimal", "feasible") if solver == "PULP" else ("optimal",)
    assert alone.status in proved and raced.status in proved, (alone, raced)
    assert _within_one_tolerance(f, raced.objective, alone.objective)
    for result, other in ((raced, alone), (alone, raced)):
        if solver != "CBC":  # HiGHS and PuLP's log always give one; cylp's CBC may not
            assert result.bound is not None
        assert result.bound is None or result.bound <= other.objective + 1e-9
    assert evaluate(f, raced.x_bool)["peak_bytes"] <= budget
    if solver == "HIGHS":  # min-memory: raced with HiGHS only
        smallest = [solve_formulation(f, None, "HIGHS", 120, workers=w) for w in (1, 2)]
        peaks = [evaluate(f, r.x_bool)["peak_bytes"] for r in smallest]
        assert peaks[1] == pytest.approx(peaks[0], rel=2e-3)


def _within_one_tolerance(f, a_s: float, b_s: float) -> bool:
    """Whether two searches' recomputation (s) can both be within the solve's tolerance of
    one optimum: the lesser, taken as a bound, proves the greater (`within_tolerance`:
    0.1% of the step, where the recomputation is smaller), so two proved schedules may
    differ by up to one tolerance (ResNet-18 here: 0.3 ms of an 8 ms recomputation in a
    0.7 s step, under load)."""
    return within_tolerance(f, max(a_s, b_s) / MS, min(a_s, b_s) / MS, 1e-3)


def test_a_shuffled_copy_solves_to_the_same_schedules(resnet18_problem):
    """CBC takes no random seed: a raced CBC search solves the problem with its columns
    and rows in another order; its schedule comes back in the problem's own order,
    pinned columns pinned."""
    _, _, problem, low = resnet18_problem
    f = formulate(problem, DEFAULT_DEPTH)
    budget = between(low, problem, 0.3)
    alone = solve_formulation(f, budget, "HIGHS", 120, workers=1)
    pins = (f.keep[:8], alone.x_bool[f.keep[:8]])
    g, rhs_g, pins_g, order = _shuffled(f, _rhs_for(f, budget), pins, seed=1)
    assert not np.array_equal(order, np.arange(f.n_bool))
    assert np.array_equal(rhs_g, _rhs_for(g, budget))
    shuffled = solve_formulation(g, budget, "HIGHS", 120, pins=pins_g, workers=1)
    x = shuffled.x_bool[np.argsort(order)]
    assert np.array_equal(x[pins[0]], pins[1])
    assert float(f.cost @ x) * MS == pytest.approx(shuffled.objective)
    assert _within_one_tolerance(f, shuffled.objective, alone.objective)
    assert evaluate(f, x)["peak_bytes"] <= budget


@pytest.mark.parametrize("depth", [DEFAULT_DEPTH, None])
def test_a_shuffled_copy_takes_the_cbc_rows_reordered(resnet18_problem, depth):
    """A raced CBC search reorders the rows its problem holds (substituted once, before
    the racers fork) instead of substituting the sums out again: they are the rows its
    shuffled copy would get."""
    _, _, problem, low = resnet18_problem
    f = formulate(problem, depth)
    rhs = _rhs_for(f, between(low, problem, 0.3))
    assert "cbc_rows" not in _shuffled(f, rhs, None, seed=1)[0].cache  # none to reorder
    cbc_rows(f, rhs)
    for seed in (1, 2):
        g, rhs_g, _, _ = _shuffled(f, rhs, None, seed)
        assert "cbc_rows" in g.cache
        reordered = cbc_rows(g, rhs_g)
        built = _cbc_matrix(replace(g, cache={}), rhs_g, minimize_budget=False)
        assert (reordered.a != built.a).nnz == 0 and reordered.a.shape == built.a.shape
        for got, want in zip(reordered[1:], built[1:], strict=True):
            assert np.array_equal(got, want)


@pytest.mark.parametrize("depth", [DEFAULT_DEPTH, None])
def test_cbc_rows_without_the_running_sums_are_the_rows_as_built(resnet18_problem, depth):
    """CBC gets the rows with the running sums substituted out (all continuous columns
    in the compact formulation, all but the frees in the full one). For any binaries
    and frees, with the sums that their own equality rows give, every other row's left
    side less its right side is the same in both; and the schedules that fit are the
    same."""
    from scipy.sparse.linalg import spsolve

    _, _, problem, low = resnet18_problem
    f = formulate(problem, depth)
    budget = between(low, problem, 0.3)
    rhs = _rhs_for(f, budget)
    a, b, is_eq, n_cont, source = _cbc_matrix(f, rhs, minimize_budget=False)
    assert n_cont == len(f.free_columns) and a.shape[1] == f.n_bool + n_cont
    sums = np.setdiff1d(np.arange(f.n_cont), f.free_columns)
    a_c = f.a_cont.tocsc()
    defining = f.is_eq & (f.a_cont.getnnz(axis=1) > 0)
    assert a.shape[0] == f.n_rows - defining.sum()
    assert np.array_equal(source, np.flatnonzero(~defining))
    best = solve_formulation(f, budget, "HIGHS", 120, workers=1).x_bool
    rng = np.random.default_rng(0)
    for trial in range(6):
        x = best if trial == 0 else rng.integers(0, 2, f.n_bool)
        frees = rng.random(len(f.free_columns))
        known = f.a_bool @ x + a_c[:, f.free_columns] @ frees
        y = np.zeros(f.n_cont)
        y[f.free_columns] = frees
        y[sums] = spsolve(a_c[defining][:, sums].tocsc(), rhs[defining] - known[defining])
        built = (f.a_bool @ x + f.a_cont @ y - rhs)[~defining]
        reduced = a @ np.concatenate([x, frees]) - b
        assert np.allclose(reduced, built, rtol=1e-9, atol=1e-6), trial
    assert not np.all(reduced <= 1e-6)  # the random schedules break rows


def test_cbc_reports_a_bound_that_holds(resnet18_problem):
    """CBC's bound is at most the optimum (HiGHS's schedule), its gap is measured against
    it, and it says "optimal" only for a schedule within 0.1% of the step of that optimum."""
    graph, prof, problem, low = resnet18_problem
    budget = between(low, problem, 0.3)
    sol = solve(graph, prof, budget, solver="CBC")
    best = solve(graph, prof, budget, solver="HIGHS")
    assert sol.predicted_peak_bytes <= budget
    assert sol.bound_s is not None and sol.bound_s <= best.objective_s + 1e-9
    # the solve time is the whole of it: cuts, start and search
    parts = sol.stats["cut_s"] + sol.stats["start_s"] + sol.stats["search_s"]
    assert parts <= sol.solve_time_s <= parts + 5.0
    assert sol.gap == pytest.approx((sol.objective_s - sol.bound_s) / sol.objective_s, abs=1e-9)
    lost = sol.objective_s - sol.bound_s
    assert sol.step_gap == pytest.approx(lost / sol.predicted_time_s, abs=1e-12)
    if sol.status == "optimal":
        assert sol.step_gap <= 1e-3 and sol.predicted_time_s * (1 - 1e-3) <= best.predicted_time_s
    else:
        assert sol.step_gap > 1e-3


def test_ctrl_c_reaches_python_after_a_cbc_solve_in_this_process():
    """CBC's driver installs a SIGINT handler of its own and leaves it: without Python's
    put back, a Ctrl-C after any CBC solve in the process (solve.py's start heuristic
    runs one) was swallowed."""
    f = formulate(CHAIN, None)
    got = []
    previous = signal.signal(signal.SIGINT, lambda *_: got.append(1))
    try:
        assert solve_formulation(f, 9 * MIB, "CBC", time_limit=30).status == "optimal"
        os.kill(os.getpid(), signal.SIGINT)
        waited = time.perf_counter()
        while not got and time.perf_counter() - waited < 5:
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert got == [1]


def _market_split(h) -> None:
    """A market-split instance (equalities over random weights): hard for branch and
    bound at any size, so a search on it runs until it is stopped."""
    import highspy

    rng = np.random.default_rng(0)
    n = 40
    columns = np.arange(n, dtype=np.int32)
    for _ in range(n):
        h.addVar(0, 1)
    h.changeColsIntegrality(n, columns, np.array([highspy.HighsVarType.kInteger] * n))
    for _ in range(5):
        w = rng.integers(0, 100, n).astype(float)
        h.addRow(w.sum() // 2, w.sum() // 2, n, columns, w)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_highs_search_is_raised_once_it_stops(sig):
    """Python's handler raised in our HiGHS callbacks and HiGHS swallowed the exception
    (its run ended in "Solve error"), so a Ctrl-C during a HiGHS search was lost and the
    start schedule written. The signal is held, stops the search, and is raised after."""
    import threading

    import highspy

    from monet_like.solver.backends.highs import run_interruptible

    class Stopped(Exception):
        pass

    def stopped(*_):
        raise Stopped

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", 60.0)
    _market_split(h)
    polls = []
    previous = signal.signal(sig, stopped if sig == signal.SIGTERM else signal.default_int_handler)
    try:
        timer = threading.Timer(0.5, os.kill, (os.getpid(), sig))
        started = time.perf_counter()
        timer.start()
        expected = KeyboardInterrupt if sig == signal.SIGINT else Stopped
        with pytest.raises(expected):
            run_interruptible(h, stop=lambda: polls.append(1) or False)
        took = time.perf_counter() - started
        timer.join()
        assert signal.getsignal(sig) in (signal.default_int_handler, stopped)  # put back
    finally:
        signal.signal(sig, previous)
    assert polls, "the caller's stop() was not polled"
    assert 0.5 <= took < 20, f"the search went on {took:.1f} s"
    assert h.getModelStatus() == highspy.HighsModelStatus.kInterrupt


def _cbc_children() -> list[int]:
    """This process's live children that run PuLP's CBC binary."""
    import pulp

    return children_running(os.path.realpath(pulp.PULP_CBC_CMD(msg=False).path))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_signal_during_a_pulp_solve_stops_its_cbc_process():
    """PuLP waits on its CBC binary; a SIGTERM sent to solve.py alone stopped the wait and
    left CBC running to its time limit."""
    import threading

    from monet_like.solver.backends.pulp import _solve_pulp

    class Stopped(Exception):
        pass

    def stopped(*_):
        raise Stopped

    rng = np.random.default_rng(0)
    n, m = 50, 6  # market split (see _market_split): CBC runs until stopped
    a = rng.integers(0, 100, (m, n)).astype(float)
    f = SimpleNamespace(
        n_bool=n, n_cont=0, n_rows=m, cost=np.zeros(n), is_eq=np.ones(m, dtype=bool),
        a_bool=sp.csr_matrix(a), a_cont=sp.csr_matrix((m, 0)),
    )  # fmt: skip

    def signal_once_cbc_runs():
        waited = time.perf_counter()
        while not _cbc_children() and time.perf_counter() - waited < 30:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, stopped)
    sender = threading.Thread(target=signal_once_cbc_runs)
    try:
        sender.start()
        with pytest.raises(Stopped):
            _solve_pulp(f, a.sum(axis=1) // 2, 60, 1e-3, False, None, None, 1)
        sender.join()
        time.sleep(1.0)
        left = _cbc_children()
    finally:
        signal.signal(signal.SIGTERM, previous)
        for pid in _cbc_children():
            os.kill(pid, signal.SIGKILL)
    assert not left, "PuLP's CBC was left running"


# CBC 2.10's log on ResNet-50 at 7 GB (184, normal), shortened: after its restart the
# root bound jumped to ten times the schedule's cost and the search "completed" at a
# schedule 3.3% costlier than HiGHS's optimum.
CBC_RESTART_LOG = """Continuous objective value is 2972.82 - 0.27 seconds
Cbc0013I At root node, 6 cuts changed objective from 2972.8206 to 2996.2341 in 18 passes
Cbc0010I After 0 nodes, 1 on tree, 1e+50 best solution, best possible 2996.2341 (7.69 seconds)
Cbc0004I Integer solution of 3148.1152 found after 5722 iterations and 49 nodes (14.18 seconds)
Cbc0044I Reduced cost fixing - 16903 rows, 7216 columns - restarting search
Cbc0013I At root node, 39 cuts changed objective from 2972.8206 to 30834.636 in 1 passes
Cbc0001I Search completed - best objective 3148.115221170883, took 5133 iterations and 0 nodes
"""


def test_cbc_bound_is_read_from_before_its_restart():
    # Printed to 4 decimals: the least value that prints so is what the log proves.
    assert _cbc_bound_before_restart(CBC_RESTART_LOG) == pytest.approx(2996.23405, abs=1e-9)
    no_restart = CBC_RESTART_LOG.split("Cbc0044I")[0]
    assert _cbc_bound_before_restart(no_restart) == pytest.approx(2996.23405, abs=1e-9)
    relaxation_only = "Continuous objective value is 2.86 - 0.1 seconds"
    assert _cbc_bound_before_restart(relaxation_only) == pytest.approx(2.855, abs=1e-12)
    assert _cbc_bound_before_restart("") is None


def test_the_tolerance_is_a_share_of_the_step_not_of_the_recomputation():
    """0.1% of a 1 s step is 1 ms: a schedule recomputing 10 ms 0.5 ms above its bound (5%
    of its recomputation) is proved, 2 ms above is not. Recomputation longer than the step
    keeps 0.1% of itself; a budget search's objective is the budget: 0.1% of it."""
    f = SimpleNamespace(floor_ms=1000.0)
    assert abs_gap_ms(f, 1e-3) == pytest.approx(1.0)
    assert within_tolerance(f, 10.0, 9.5, 1e-3)
    assert not within_tolerance(f, 10.0, 8.0, 1e-3)
    assert not within_tolerance(f, 10.0, None, 1e-3)
    assert within_tolerance(f, 5000.0, 4995.5, 1e-3)
    assert not within_tolerance(f, 5000.0, 4994.0, 1e-3)
    assert abs_gap_ms(f, 1e-3, minimize_budget=True) == 0.0
    assert not within_tolerance(f, 10.0, 9.5, 1e-3, minimize_budget=True)


def test_pulp_bound_is_the_summary_s_unless_it_restarted_or_finished():
    stopped = "Result - Stopped on time limit\n\nObjective value: 2556.14\nLower bound: 2511.257\n"
    # The summary prints a rounded bound: the least value that prints so is taken.
    assert _pulp_bound(stopped, False, 2556.14, 1e-3) == pytest.approx(2511.2565, abs=1e-9)
    rounded_up = (
        "Result - Stopped on time limit\n\nObjective value: 2.86055499\nLower bound: 2.861\n"
    )
    assert _pulp_bound(rounded_up, False, 2.86055499, 1e-3) == pytest.approx(2.8605, abs=1e-12)
    assert _pulp_bound("Lower bound: 1.5e+03\n", False, 2e3, 1e-3) == pytest.approx(1450)
    assert _pulp_bound(CBC_RESTART_LOG, True, 3148.1152, 1e-3) == pytest.approx(2996.23405)
    assert _pulp_bound("Result - Optimal solution found\n", True, 100.0, 0.1) == 99.9


def test_cbc_log_watch_shows_each_better_schedule_with_the_bound(tmp_path):
    """PuLP's CBC runs in a child process: its progress is read from the log it writes,
    to the last line (written without a newline) once it ends."""
    path = tmp_path / "cbc.log"
    lines = []
    watch = _CbcLogWatch(str(path), lines.append)
    path.write_text(
        "Cbc0010I After 0 nodes, 1 on tree, 1e+50 best solution, best possible 2000.4"
        " (3.10 seconds)\n"
        "Cbc0012I Integer solution of 2600.9784 found by feasibility pump after 0 iterations"
        " and 0 nodes (13.04 seconds)\n"
        "Cbc0012I Integer solution of 2600.9784 found by heuristic after 9 iterations and 0 nodes"
        " (13.12 seconds)\n"
        "Cbc0004I Integer solution of 2580.4 found after 2661 iterations and 7 nodes"
        " (23.43 seconds)\n"
        "Cbc0016I Integer solution of 2570.1 found by strong branching after 2900 iterations"
        " and 9 nodes (25.01 seconds)"
    )
    assert watch.close().endswith("(25.01 seconds)")
    assert watch.first_s == pytest.approx(13.04)
    # The schedule returned, if no line showed it (nor one as good), is shown at the end.
    watch.show(2570.1, None)
    watch.show(2561.0, None)
    assert lines == [
        "[  13.0 s] schedule with 2.601 s of recomputation; bound 2.000 s, gap 23.09%",
        "[  23.4 s] schedule with 2.580 s of recomputation; bound 2.000 s, gap 22.48%",
        "[  25.0 s] schedule with 2.570 s of recomputation; bound 2.000 s, gap 22.17%",
        "[   end  ] schedule with 2.561 s of recomputation; bound 2.000 s, gap 21.89%",
    ]


@pytest.mark.parametrize("time_limit", [0.5, 1, 120])
def test_pulp_stopped_or_finished_keeps_a_bound_that_holds(resnet18_problem, time_limit):
    """PuLP's CBC on two threads, stopped early or not: a schedule it returns fits and
    costs at least the optimum, its bound is at most the optimum, and "optimal" means
    within the tolerance. CBC stopped before its first schedule returns none (it writes
    the relaxation's point then, which a schedule must not be taken for)."""
    _, _, problem, low = resnet18_problem
    f = formulate(problem, DEFAULT_DEPTH)
    budget = between(low, problem, 0.05)
    best = solve_formulation(f, budget, "HIGHS", 120, workers=1).objective
    lines = []
    res = solve_formulation(f, budget, "PULP", time_limit, workers=2, progress=lines.append)
    if res.x_bool is None:
        assert res.status == "error" and time_limit < 120, res
        return
    assert evaluate(f, res.x_bool)["peak_bytes"] <= budget
    assert res.objective >= best * (1 - 1e-3) - 1e-9
    assert res.bound is not None and res.bound <= best + 1e-9
    # the tolerance: 0.1% of the recomputation or of the fastest step, the wider
    lost, tolerance = res.objective - res.bound, 1e-3 * max(res.objective, f.floor_ms * MS)
    assert (res.status == "optimal") == (lost <= tolerance * (1 + 1e-9))
    assert any(f"{res.objective:.3f} s of recomputation" in line for line in lines), lines


@pytest.mark.parametrize("bound_fraction", [None, 0.5, "within the step's tolerance"])
def test_cbc_stopped_without_a_schedule_returns_the_start(
    resnet18_problem, monkeypatch, bound_fraction
):
    """CBC through cylp takes no start: when its time limit stops it before any schedule
    (as it does at low budgets on ResNet-50), the heuristic's schedule is the answer,
    its gap measured against CBC's bound where CBC had one: proved optimal where that
    bound is within 0.1% of the step below it, though further below in recomputation."""
    from monet_like import solver as solver_module
    from monet_like.solver import milp

    graph, prof, problem, low = resnet18_problem
    # 30% of the way from the smallest budget: at 10%, in one fresh-clone run, neither
    # heuristic found the start this test is about.
    budget = between(low, problem, 0.3)
    stopped = [RawResult("error", None, None, None, None, 0.0, "CBC", "no schedule")]
    # Every CBC solve stops without a schedule, the start's re-solve included.
    monkeypatch.setattr(milp, "_solve_cbc", lambda *args, **kwargs: stopped[0])
    # CBC's bound, where it has one: a fraction of the start solve() finds (on the
    # formulation with its cuts, found within a time limit: not known beforehand).
    real_start = solver_module.start_schedule
    starts, floors = [], []

    def start_then_bound(f, budget_bytes, solver, peak_search_s=0.0, known=None, lp=None):
        x, how = real_start(f, budget_bytes, solver, peak_search_s, known, lp)
        starts.append(float(f.cost @ x) * MS)
        floors.append(f.floor_ms * MS)
        if bound_fraction is not None:
            if isinstance(bound_fraction, str):  # half the tolerance below
                bound = starts[-1] - 0.5e-3 * (floors[-1] + starts[-1])
            else:
                bound = bound_fraction * starts[-1]
            stopped[0] = RawResult("error", None, None, bound, None, 0.0, "CBC", "stopped on time")
        return x, how

    monkeypatch.setattr(solver_module, "start_schedule", start_then_bound)
    lines = []
    sol = solve(graph, prof, budget, solver="CBC", time_limit=1, progress=lines.append)
    assert starts and starts[-1] > 0  # a schedule that recomputes: its gap is not 0 by definition
    if isinstance(bound_fraction, str):
        assert sol.status == "optimal" and sol.step_gap == pytest.approx(0.5e-3)
        assert floors[-1] > starts[-1] and sol.gap > 1e-3  # not within 0.1% of the recomputation
    else:
        assert sol.status == "feasible"
    if bound_fraction is None:
        assert sol.gap is None
    elif isinstance(bound_fraction, str):
        assert sol.bound_s == pytest.approx(starts[-1] - 0.5e-3 * (floors[-1] + starts[-1]))
    else:
        assert sol.gap == pytest.approx(1 - bound_fraction)
        assert sol.bound_s == pytest.approx(bound_fraction * starts[-1])
    assert sol.predicted_peak_bytes <= budget
    assert sol.objective_s == pytest.approx(sol.stats["start_objective_s"])
    assert sol.stats["returned_start"]
    assert any("kept as fallback" in line for line in lines)


def test_highs_stopped_by_its_time_limit_without_a_schedule_says_so(resnet18_problem, monkeypatch):
    """A search that its time limit stops before any schedule, with no start to fall back
    on, is named a time limit (give it more time), not a solver failure."""
    graph, prof, problem, low = resnet18_problem
    budget = between(low, problem, 0.3)
    monkeypatch.setattr(solver_module, "start_schedule", lambda *a, **k: (None, "none found"))
    monkeypatch.setattr(
        solver_module, "solve_formulation",
        lambda *a, **k: RawResult("stopped", None, None, None, None, 0.0, "HIGHS"),
    )  # fmt: skip
    with pytest.raises(UserError, match=r"stopped at the time limit .*--time_limit\)$"):
        solve(graph, prof, budget, solver="HIGHS", time_limit=1)


def test_highs_stopped_without_a_schedule_keeps_its_bound(monkeypatch):
    """Raced HiGHS searches that all stop without a schedule: status "stopped", the best
    of their bounds kept (in seconds), so that a returned start is measured by it."""
    from monet_like.solver.backends import highs

    def stopped(f, rhs, time_limit, gap, verbose, minimize_budget, start, pins, seed, *rest):
        return highs._HighsOutcome("stopped", None, np.inf, 4000.0 + seed, "", None, seed)

    monkeypatch.setattr(highs, "_highs_search", stopped)
    raw = highs._solve_highs(None, None, 1, 1e-3, False, False, None, None, workers=2)
    assert raw.status == "stopped" and raw.x_bool is None
    assert raw.bound == pytest.approx(4.001)  # the best bound of the two, ms to s
    budget = highs._solve_highs(None, None, 1, 1e-3, False, True, None, None, workers=2)
    assert budget.bound is None  # a bound on memory, not on recomputation


def test_raced_highs_searches_prove_together_what_neither_proved_alone(monkeypatch):
    """One search's schedule and another's bound, within the tolerance together, make the
    result optimal (on an H200 a full-mode solve ended "feasible" with its gap 0.09% of the
    recomputation: each racer stopped at its limit); bounds short of it leave it feasible,
    and so does a smallest-budget search (window searches improve a stopped one)."""
    from monet_like.solver.backends import highs, slack_ms

    f = formulate(CHAIN, None)
    budget = 9 * MIB  # some recomputation
    real = solve_formulation(f, budget, "HIGHS", time_limit=30)
    x = real.x_bool.astype(int)
    cost_ms = float(f.cost @ x)
    slack = slack_ms(f, cost_ms, 1e-3)
    assert 0 < 2 * slack < cost_ms

    def searches(other_bound):
        def search(f_, rhs, time_limit, gap, verbose, minimize_budget, start, pins, seed, *rest):
            if seed == 0:  # the schedule, with a weak bound of its own
                return highs._HighsOutcome("feasible", x, cost_ms, 0.0, "", 0.1, 0)
            return highs._HighsOutcome("stopped", None, np.inf, other_bound, "", None, 1)

        return search

    rhs = _rhs_for(f, budget)
    for other_bound, status in (
        (cost_ms - slack / 2, "optimal"),
        (cost_ms - 2 * slack, "feasible"),
    ):
        monkeypatch.setattr(highs, "_highs_search", searches(other_bound))
        raw = highs._solve_highs(f, rhs, None, 1e-3, False, False, None, None, workers=2)
        assert raw.status == status, other_bound
        assert raw.gap == pytest.approx((cost_ms - other_bound) / cost_ms)
        budget_search = highs._solve_highs(f, rhs, None, 1e-3, False, True, None, None, workers=2)
        assert budget_search.status == "feasible"


def test_a_highs_search_past_its_time_limit_is_stopped_with_its_last_schedule(monkeypatch):
    """HiGHS 1.16 ran over 14 minutes on a 118 s limit (in a restart's presolve, which
    polls neither its clock nor our interrupt): a whole-problem search runs forked and
    watched, and one still running after the limit and the grace is killed; the last
    schedule it told counts. Made to hang here: it tells a schedule, then ignores its
    stop."""
    from monet_like.solver.backends import highs
    from monet_like.solver.race import RACE_GRACE_S

    f = formulate(CHAIN, DEFAULT_DEPTH)
    budget = 100 * MIB
    real = solve_formulation(f, budget, "HIGHS", time_limit=30, progress=(lines := []).append)
    assert real.status == "optimal" and lines, "a watched search's lines reach the caller"

    def hangs(f_, rhs, time_limit, gap, verbose, minimize_budget, start, pins, seed, progress,
              stop, found):  # fmt: skip
        x8 = real.x_bool.astype(np.int8)
        found(highs._HighsOutcome("feasible", x8, 1.0, -np.inf, "", 0.1, 0))  # no bound yet
        progress("a schedule told before the hang")
        while True:  # deaf to `stop`, as HiGHS's presolve is
            time.sleep(0.05)

    monkeypatch.setattr(highs, "_highs_search", hangs)
    said = []
    started = time.perf_counter()
    raw = highs._solve_highs(f, _rhs_for(f, budget), 1, 1e-3, False, False, None, said.append)
    took = time.perf_counter() - started
    assert 1 + RACE_GRACE_S - 0.5 < took < 1 + RACE_GRACE_S + 10
    assert raw.status == "feasible" and np.array_equal(raw.x_bool, real.x_bool)
    assert raw.objective == pytest.approx(real.objective)  # the columns' own cost
    assert said[0] == "a schedule told before the hang"
    assert said[-1].startswith("HiGHS (random seed 0) ran past its time limit: stopped")


def test_a_highs_search_in_a_forked_process_runs_where_highs_ran_here_on_threads():
    """HiGHS's thread pool is global: a fork copies it without its worker threads, and a
    search there waited on them for ever where this process had run HiGHS on two threads
    or more (its default on 4 cores or more), as the racers and the watched searches do.
    In its own process, so that the pool this test makes is no other test's."""
    code = (
        "import multiprocessing as mp, sys, highspy\n"
        "import monet_like.solver.backends.highs\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_solver import _market_split\n"
        "def search(send):\n"
        "    h = highspy.Highs()\n"
        "    for option, value in [('output_flag', False), ('threads', 2), ('time_limit', 2.0)]:\n"
        "        h.setOptionValue(option, value)\n"
        "    _market_split(h)\n"
        "    h.run()\n"
        "    send.send(h.modelStatusToString(h.getModelStatus()))\n"
        "here, there = mp.Pipe(False)\n"
        "search(there)\n"
        "print('here:', here.recv())\n"
        "child = mp.get_context('fork').Process(target=search, args=(there,), daemon=True)\n"
        "child.start()\n"
        "print('forked:', here.recv() if here.poll(60) else 'no answer in 60 s')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT,
        env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "here: Time limit reached" in r.stdout, r.stdout
    assert "forked: Time limit reached" in r.stdout, r.stdout


@pytest.mark.parametrize("cbc_stops", [False, True])
def test_cbc_on_a_large_problem_races_a_search_and_then_windows_beside_it(
    resnet18_problem, monkeypatch, cbc_stops
):
    """Where two CBC searches race (a large problem), the second one stops early and
    windows improve the best schedule on its core for the rest of the limit: the
    cheapest schedule comes back, with the higher bound. Made to stop (the first search
    with a costly schedule, the optimum at the smallest budget, which fits a larger
    one, and half the optimum as its bound; the second with nothing), CBC loses to the
    windows; left alone, it proves the optimum."""
    graph, prof, problem, low = resnet18_problem
    budget = between(low, problem, 0.5)
    f = formulate(problem, DEFAULT_DEPTH)
    optimum = solve_formulation(f, budget, "HIGHS", 120, gap=1e-4).objective
    costly = solve_formulation(f, low, "HIGHS", 120).x_bool
    costly_s = float(f.cost @ costly) * MS

    def stopped(f_, rhs, time_limit, gap, verbose, pins, cutoff, seed):
        if seed == 0:
            bound = optimum / 2  # a bound that holds
            return RawResult("feasible", costly, costly_s, bound, 1 - bound / costly_s, 0, "CBC")
        return RawResult("error", None, None, None, None, 0, "CBC", "no schedule")

    monkeypatch.setattr(solver_module, "race_workers", lambda f: 2)  # as on a large one
    if cbc_stops:
        monkeypatch.setattr(solver_module, "cbc_seeded", stopped)
    sol = solve(graph, prof, budget, solver="CBC", time_limit=60)
    assert sol.predicted_peak_bytes <= budget
    assert sol.objective_s <= sol.stats["start_objective_s"] + 1e-9
    if cbc_stops:
        assert costly_s > sol.stats["start_objective_s"]  # the windows' schedule is cheaper
        assert sol.status == "feasible" and sol.bound_s == pytest.approx(optimum / 2)
        assert sol.gap == pytest.approx(1 - sol.bound_s / sol.objective_s)
    else:
        assert sol.status == "optimal" and sol.objective_s - optimum <= 1e-3 * sol.predicted_time_s
        assert sol.bound_s <= optimum + 1e-9


@pytest.mark.parametrize("captured_first", [False, True])
@pytest.mark.parametrize("variants_mib, captured_mib", [(200, 150), (150, 200)])
def test_a_modes_smallest_budget_is_the_lower_of_its_two_graphs(
    monkeypatch, variants_mib, captured_mib, captured_first
):
    # A mode solves its rewritten graph and the captured one and keeps the faster
    # schedule, so a budget is out of reach only when it is for both, and the smallest
    # budget to report is the lower (VGG-16 at 176 in the full mode: 11.723 GB with the
    # variants, 11.657 GB on the captured graph), in either solving order.
    from types import SimpleNamespace

    solved_captured = []

    def out_of_reach(graph, profile, budget_bytes, reference, **options):
        solved_captured.append(reference is None)
        smallest = (variants_mib if reference is not None else captured_mib) * MIB
        raise InfeasibleBudget(f"smallest {smallest}", smallest, MIB)

    monkeypatch.setattr(solver_module, "_solve", out_of_reach)
    monkeypatch.setattr(solver_module, "build_problem", lambda g, *_args, **_kw: g)
    monkeypatch.setattr(
        solver_module,
        "_step_bound_before_solve",
        lambda g, *_args: (float(bool(g.variants) == captured_first), None),  # lower first
    )
    rewritten, captured = SimpleNamespace(variants=("newnode",)), SimpleNamespace(variants=())
    with pytest.raises(InfeasibleBudget) as raised:
        solve(rewritten, None, MIB, mode="newnode", baseline=(captured, object()))
    assert solved_captured == [captured_first, not captured_first]
    assert raised.value.min_budget_bytes == min(variants_mib, captured_mib) * MIB
    assert ("captured graph" in str(raised.value)) == (captured_mib < variants_mib)
    if captured_mib < variants_mib:  # the mode's own smallest budget is named beside it
        assert f"with the mode's variants {gb_at_least(variants_mib * MIB)} GB" in str(raised.value)


@pytest.mark.parametrize("backward_op, smallest_mib", [(11, 10), (None, 13)])
def test_a_convolutions_backward_counts_what_is_read_from_it_on(backward_op, smallest_mib):
    # Stage 0 runs op 10, which reads unit 1 (a ReLU's backward from its output), then op
    # 11, a convolution's backward with 5 MiB of workspace, which reads unit 0 only: unit
    # 1 is dead by then. Counting every read of the stage at the convolution (as before,
    # and still where its op is not known) held it there: VGG-16 at 176 had a smallest
    # budget above its store-all peak with algorithm choices.
    units = [
        Unit(0, (0,), (0,), 4 * MIB, 1e-3, 0, (), 1),
        Unit(1, (1,), (1,), 3 * MIB, 1e-3, 0, (0,), 1),
    ]
    runs = ((10, MIB, (0, 1)), (11, MIB, (0,)))
    stages = [Stage(0, 1, (10, 11), (0, 1), MIB, by_op=runs), Stage(1, 0, (12,), (0,), MIB)]
    conv = AlgorithmChoice(
        "conv", 1, 0, (((-1,), 1e-3, 0),), 1e-3, 0, MIB, (((-1, -1), 1e-3, 5 * MIB),), 1e-3,
        backward_op=backward_op,
    )  # fmt: skip
    problem = Problem(units, stages, 0, [0, 0], 0, 1.0, 0, algorithms=(conv,))
    for depth in (None, DEFAULT_DEPTH):
        f = formulate(problem, depth)
        raw = solve_formulation(f, None, "HIGHS", 30)
        # its bytes, the workspace and unit 0 (and unit 1 where it is counted)
        assert evaluate(f, raw.x_bool)["peak_bytes"] == smallest_mib * MIB
        # the rows say the same: that budget fits, and 1 kB less does not
        assert solve_formulation(f, smallest_mib * MIB, "HIGHS", 30).status == "optimal"
        assert solve_formulation(f, smallest_mib * MIB - 1024, "HIGHS", 30).status == "infeasible"


@pytest.mark.parametrize(
    "problem, depth", [(CHAIN, None), (DIAMOND, 1), (FREED, None), (MIXED, None), (MIXED, 1)]
)
def test_recompute_count_cuts_hold_for_every_schedule(problem, depth):
    # With memory to spare every schedule the rows allow is enumerated: none breaks a cut
    # (the cuts say nothing about memory, so they hold at every budget).
    f = formulate(problem, depth)
    schedules = feasible_assignments(f, 1000 * MIB)
    assert schedules.shape[1] > 10
    separator = CutSeparator(f)
    broken = [x for x in schedules.T if separator.separate(x)]
    assert not broken


def test_recompute_count_cuts_lift_the_lp_and_keep_the_optimum():
    f = formulate(MIXED, None)
    budget = 11 * MIB
    cuts, stats = root_cuts(f, budget)
    assert stats["cuts"] >= 1
    best = brute_force(f, budget)
    assert stats["lp_before_s"] == pytest.approx(0.0044667, abs=1e-6)
    assert stats["lp_before_s"] < stats["lp_after_s"] <= best + 1e-9
    strengthened = with_cuts(f, cuts)
    assert brute_force(strengthened, budget) == pytest.approx(best, abs=1e-12)
    for solver in SOLVERS:
        raw = solve_formulation(strengthened, budget, solver, time_limit=30)
        assert raw.status == "optimal" and raw.objective == pytest.approx(best, abs=1e-9), solver


def test_a_real_graphs_optimum_breaks_no_recompute_count_cut(resnet18_problem):
    graph, prof, problem, low = resnet18_problem
    budget = between(low, problem, 0.2)
    for depth in (DEFAULT_DEPTH, None):
        f = formulate(problem, depth)
        raw = solve_formulation(f, budget, "HIGHS", 60)
        assert raw.status == "optimal"
        assert CutSeparator(f).separate(raw.x_bool.astype(float)) == []
    # CBC gets the cuts through solve(), which reports the LP bound they reached. The
    # bound is the formulation's without frees: a schedule with them can cost less
    # (0.032 s where the cuts' LP bound was 0.052 s on one profile), so none are tried.
    sol = solve(graph, prof, budget, solver="CBC", time_limit=60, frees=False)
    assert sol.stats["cut_lp_before_s"] <= sol.stats["cut_lp_after_s"] <= sol.objective_s + 1e-9


def test_a_solver_needs_only_its_own_binding(monkeypatch):
    """HiGHS and CBC are called through highspy and cylp: a missing cvxpy must not stop them,
    and a missing binding is named with its install command."""
    import sys

    from monet_like.errors import UserError
    from monet_like.solver.milp import check_solver

    monkeypatch.setitem(sys.modules, "cvxpy", None)  # import cvxpy now raises ImportError
    check_solver("HIGHS")
    check_solver("CBC")
    with pytest.raises(UserError, match="pip install cvxpy"):
        check_solver("SCIP")
    monkeypatch.setitem(sys.modules, "highspy", None)
    with pytest.raises(UserError, match="pip install highspy"):
        check_solver("HIGHS")


def test_a_highs_search_reports_the_cost_of_the_columns_it_hands_back(monkeypatch):
    """HiGHS's objective figure can be off the columns it hands back (with the frees on
    ResNet-50, 16 x 128 px: 162.9 ms said, the start's 179.2 ms handed back). Here HiGHS
    is made to hand back the start (5 ms on FREED at 9 MiB with the frees) after finding
    the 3 ms schedule: the search's objective, which the races compare, is the 5 ms the
    columns cost."""
    plain = formulate(FREED, DEFAULT_DEPTH, True)
    with_frees = formulate(FREED, DEFAULT_DEPTH, True, frees=True)
    budget = 9 * MIB
    start = carried_over(solve_formulation(plain, budget, "HIGHS", 10).x_bool, plain, with_frees)
    real_model = highs_module._highs_model

    class HandsBackTheStart:
        def __init__(self, h):
            self._h = h

        def __getattr__(self, name):
            return getattr(self._h, name)

        def getSolution(self):  # noqa: N802 (highspy's name)
            values = list(self._h.getSolution().col_value)
            values[: len(start)] = start.astype(float)
            return SimpleNamespace(col_value=values)

    monkeypatch.setattr(
        highs_module, "_highs_model", lambda *a, **k: HandsBackTheStart(real_model(*a, **k))
    )
    rhs = _rhs_for(with_frees, budget)
    found = highs_module._highs_search(
        with_frees, rhs, 10, 1e-3, False, False, start, None, 0, None, None
    )
    assert float(with_frees.cost @ found.x) == pytest.approx(5.0) == found.objective


@pytest.mark.parametrize(("other_bound_s", "status"), [(0.0100, "optimal"), (0.0090, "feasible")])
def test_raced_cbc_searches_prove_together_what_neither_proved_alone(other_bound_s, status):
    """Two CBC searches stopped by the limit: the cheaper schedule (10.5 ms of
    recomputation) with the other search's bound proves it where they are within the
    tolerance, 0.1% of a 1 s step (1 ms): a bound of 10 ms does, 9 ms does not."""
    f = SimpleNamespace(floor_ms=1000.0)
    cheap = RawResult("feasible", np.array([1, 0]), 0.0105, 0.0050, None, 0.0, "CBC")
    other = RawResult("feasible", np.array([0, 1]), 0.0120, other_bound_s, None, 0.0, "CBC")
    merged = merge_cbc_outcomes(f, [cheap, other], 1e-3)
    assert merged.status == status
    assert merged.objective == 0.0105 and merged.bound == other_bound_s
    assert list(merged.x_bool) == [1, 0]
