"""Stage 3: from Graph + Profile + budget + mode to a Solution.

    solution = solve(graph, profile, budget_bytes, mode="normal", solver="HIGHS")

Edge cases are decided before any MILP: a budget at or above the store-all peak
returns store-all at once; a budget below the fixed part, or below what any
schedule in the model can reach, raises `InfeasibleBudget` carrying the smallest
feasible budget (found by solving the min-memory problem) and the fixed part.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable

import numpy as np

from monet_like.errors import UserError
from monet_like.profile import align_times, derived_profile
from monet_like.solution import Solution
from monet_like.solver.backends import RawResult, relative_gap, within_tolerance
from monet_like.solver.backends.cbc import (
    CBC_FINISHED,
    cbc_rows,
    cbc_seeded,
    merge_cbc_outcomes,
)
from monet_like.solver.backends.highs import (
    is_feasible,
    known_infeasible,
    race_workers,
    relaxation_infeasible,
    solved_relaxation,
)
from monet_like.solver.cuts import root_cuts, with_cuts
from monet_like.solver.evaluate import evaluate
from monet_like.solver.formulation import _rhs_for, carried_over, formulate, lean_choices
from monet_like.solver.milp import STARTABLE, check_solver, solve_formulation
from monet_like.solver.neighbourhood import lower_cost, shrink_peak
from monet_like.solver.problem import Problem, build_problem
from monet_like.solver.race import race
from monet_like.solver.start import (
    least_peak_start,
    remember_least_peak,
    remembered_least_peak,
    start_schedule,
    store_all_start,
)
from monet_like.units import GIB, gb_at_least
from monet_like.variants import apply as apply_variants
from monet_like.variants import parse_mode

SOLVERS = ("CBC", "HIGHS", "GUROBI", "PULP")
DEFAULT_DEPTH = 16  # the compact formulation's recomputation depth (see docs/solver.md)
# Solvers given the recompute-count cuts (solver/cuts.py) before their search: their bound
# starts at the LP's, which the cuts lift (ResNet-50 at 184, normal, 5 GB, one search
# each: CBC proved the optimum in 149 s with 143 of them, an 18.6% gap after 300 s
# without; HiGHS 12.7 s with the rows as shipped, 51.3 s without). Gurobi, not measured
# here (no licence), gets none.
CUT_SOLVERS = ("CBC", "HIGHS", "PULP")


class InfeasibleBudget(UserError):
    def __init__(self, message: str, min_budget_bytes: int | None, fixed_bytes: int) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes
        self.fixed_bytes = fixed_bytes


def _store_all(problem: Problem, base: dict) -> Solution:
    needed = {u for s in problem.stages for u in s.need}
    needed |= {u for c in problem.choices for u in (*c.on_units, *c.optional_units)}
    return Solution(
        **base,
        formulation="store-all",
        depth=None,
        status="store-all",
        objective_s=0.0,
        bound_s=0.0,
        gap=0.0,
        solve_time_s=0.0,
        predicted_peak_bytes=problem.store_all_peak_bytes,
        predicted_peak_at="store-all peak",
        predicted_time_s=problem.store_all_time_s,
        stats={},
        keep=[u.id in needed for u in problem.units],
        units=[list(u.nodes) for u in problem.units],
        stages=[{"unit": s.unit, "ops": list(s.ops), "recompute": []} for s in problem.stages],
    )


MIN_BUDGET_TIME_LIMIT = 300.0  # seconds; past it the best budget found is reported
START_PEAK_SEARCH_SHARE = 0.25  # of the time limit, for a start where the heuristics fail


def min_feasible_budget(
    problem: Problem,
    depth: int | None,
    ablation: bool,
    solver: str,
    time_limit: float | None = MIN_BUDGET_TIME_LIMIT,
    frees: bool | None = False,
    progress: Callable[[str], None] | None = None,
) -> int:
    """The smallest budget any schedule of the model reaches (the min-memory problem),
    within 0.1%; when `time_limit` stops the solver first, the smallest budget it found
    (a feasible budget, possibly above the smallest).

    The full formulation (`depth` None) is far harder to solve. Every compact schedule
    is one of its schedules, at a peak no higher, so the compact formulation's smallest
    budget bounds it from above and is the answer when the full search finds nothing
    better. The compact search runs first, with the whole limit, and the full search
    gets what is left. The compact search mostly ends in seconds; GoogLeNet at 64 px
    needs 196 s, and given half of 300 s it stopped at 107.92 MiB against 107.62 MiB
    with time to finish, which the full search did not beat. `frees`: the compact
    formulation with the full one's frees (`formulate`), from the plain search's
    schedule; None (`solve`'s default): the frees tried after the plain search where
    their LP relaxation reaches at least FREES_SMALLEST_GAIN lower, for what the plain
    search leaves of the limit, at most FREES_SMALLEST_SHARE of it (the benchmarks' GPT in
    300 s: 0.1408 GB plain, 0.1007 GB with them, the greedy start's, found at once; block
    checkpointing's peak is 0.1046 GB). `progress` receives a line per smaller budget found."""
    if depth is None and not ablation:
        started = time.perf_counter()
        compact = _min_budget(problem, DEFAULT_DEPTH, ablation, solver, time_limit, frees, progress)
        remaining = None
        if time_limit is not None:
            remaining = time_limit - (time.perf_counter() - started)
            if remaining < 1.0:
                return compact
        try:
            if progress is not None:
                progress("the full formulation's search, for the time left")
            full = _min_budget(problem, None, ablation, solver, remaining, progress=progress)
            return min(compact, full)
        except UserError:
            return compact
    return _min_budget(problem, depth, ablation, solver, time_limit, frees, progress)


def _smallest_budget(problem, depth, ablation, solver, frees, progress) -> int:
    """`min_feasible_budget` for the message of a budget out of reach, announced."""
    if progress is not None:
        progress(
            "no schedule of this graph fits the budget: searching for its smallest budget"
            f" (at most {MIN_BUDGET_TIME_LIMIT:.0f} s)"
        )
    return min_feasible_budget(problem, depth, ablation, solver, frees=frees, progress=progress)


FREES_SMALLEST_SHARE = 0.2  # of the limit, kept for the default's search with the frees
FREES_SMALLEST_GAIN = 0.05  # lower than the plain smallest, at least, for their LP to pass


def _min_budget(
    problem: Problem,
    depth: int | None,
    ablation: bool,
    solver: str,
    time_limit: float | None,
    frees: bool | None = False,
    progress: Callable[[str], None] | None = None,
) -> int:
    chosen = "HIGHS" if importlib.util.find_spec("highspy") is not None else solver
    chosen = "CBC" if chosen == "PULP" else chosen
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    start = None
    if frees is None and (depth is None or ablation or chosen != "HIGHS"):
        frees = False  # the frees' LP below is HiGHS's
    if frees is not False and depth is not None and not ablation:
        # Every schedule fits with the frees at a peak no higher, and without them the
        # search finds small peaks far sooner (ResNet-50 at 184, normal: 4.355 GB in
        # 300 s, against 4.558 GB with them from scratch in 600 s): half the time goes
        # to that search, the rest to the frees' from its schedule. Left to the search
        # (None), the frees get what the plain search leaves of the limit, at most
        # FREES_SMALLEST_SHARE of it, where their LP reaches FREES_SMALLEST_GAIN lower.
        share = 1 / 2 if frees else 1 - FREES_SMALLEST_SHARE
        plain = formulate(problem, depth, allow_recompute=True)
        start = _min_schedule(plain, chosen, time_limit and time_limit * share, None, progress)
        remember_least_peak(plain, start)
        plain_peak = evaluate(plain, start)["peak_bytes"]
        f = formulate(problem, depth, allow_recompute=True, frees=True)
        if frees is None:
            left = 60.0 if deadline is None else min(60.0, deadline - time.perf_counter())
            lower = (1 - FREES_SMALLEST_GAIN) * plain_peak
            if left < 1.0 or relaxation_infeasible(f, lower, time_limit=left):
                return plain_peak
            if deadline is not None:
                deadline = min(deadline, time.perf_counter() + FREES_SMALLEST_SHARE * time_limit)
        if progress is not None:
            progress("the same with the frees, from that schedule")
        if f.hold_only:
            start = carried_over(start, plain, f)
    else:
        f = formulate(problem, depth, allow_recompute=not ablation, frees=frees or None)
    remaining = None if deadline is None else max(1.0, deadline - time.perf_counter())
    x = _min_schedule(f, chosen, remaining, start, progress)
    remember_least_peak(f, x)  # a solve at this budget starts from it
    return evaluate(f, x)["peak_bytes"]


def _min_schedule(
    f, solver: str, time_limit: float | None, start, progress: Callable[[str], None] | None = None
) -> np.ndarray:
    """The schedule of least peak found within `time_limit`, from `start` if given.

    Without a start, the MILP searches first. With HiGHS and variant or algorithm
    choices, which make this problem hard for it, it searches for half the limit with
    each choice fixed to its leaner option (they give nearly the smallest budget);
    otherwise for two thirds of it, and a proved answer is returned at once. A greedy
    schedule (`start.least_peak_start`) replaces the start where it peaks lower (or the
    search found none); so does an earlier search's on the same rows
    (`start.remembered_least_peak`), which is also the MILP's start. From there,
    windows of the network are then re-solved in turn (`neighbourhood.shrink_peak`)
    for the time left. ResNet-50 at 184 in normal mode:
    the MILP alone stopped at 4.355 GB after 200 s and after 300 s; 17 s of windows
    after the 200 s reached 4.2826 GB, the optimum (proved in 621 s by the MILP)."""
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    # An earlier search's schedule for these rows (another budget tried, another process):
    # the MILP starts from it and, where the bound meets it, proves it at once.
    remembered = remembered_least_peak(f)
    if remembered is not None:
        remembered_peak = evaluate(f, remembered)["peak_bytes"]
        if not is_feasible(f, remembered, remembered_peak):
            remembered = None
    if start is None:
        lean = solver == "HIGHS" and bool(f.problem.choices or f.problem.algorithms)
        share = 1 / 2 if lean else 2 / 3
        first = solve_formulation(
            f, None, solver, time_limit=time_limit and time_limit * share, gap=1e-3,
            start=None if lean else remembered,  # the lean pins may exclude it
            pins=lean_choices(f) if lean else None, progress=progress,
        )  # fmt: skip
        if first.x_bool is not None and not lean and first.status == "optimal":
            return first.x_bool
        start = first.x_bool
    start_peak = None if start is None else evaluate(f, start)["peak_bytes"]
    if remembered is not None and (start_peak is None or remembered_peak < start_peak):
        start, start_peak = remembered, remembered_peak
        if progress is not None:
            progress(f"an earlier search's schedule of {remembered_peak / GIB:.4f} GB is lower")
    # The greedy schedule can peak lower than a stopped search's: on the GPT (dim 256,
    # 8 x 256) with the frees, 0.1056 GB in 1.4 s, where the search without it ended
    # at 0.1105 GB after 120 s.
    greedy = least_peak_start(f)
    greedy_peak = evaluate(f, greedy)["peak_bytes"]
    if start_peak is None or greedy_peak < start_peak:
        if progress is not None:
            # GoogLeNet at 320 in normal mode: HiGHS had no schedule after 200 s
            why = "the MILP found no schedule" if start is None else "lower than the search's"
            progress(
                f"re-solving windows from a greedy schedule of {greedy_peak / GIB:.4f} GB ({why})"
            )
        start, start_peak = greedy, greedy_peak
    elif progress is not None:
        progress("re-solving windows of the network from that schedule")
    # A search stopped early can hold a schedule above store-all's peak (T5, under load:
    # 5.76 MB against 5.47 MB): the windows then start from store-all, and the answer is
    # never above it.
    kept_all = store_all_start(f)
    kept_all_peak = evaluate(f, kept_all)["peak_bytes"]
    if start_peak > kept_all_peak:
        start = kept_all
        if progress is not None:
            progress("that schedule peaks above store-all's: the windows start from store-all")
    x = shrink_peak(f, start, solver, deadline, progress)
    return x if evaluate(f, x)["peak_bytes"] <= kept_all_peak else kept_all


OTHER_GRAPH_SHARE = 0.2  # of the time limit, kept for each graph solved after the first


def solve(
    graph,
    profile,
    budget_bytes: int,
    mode: str = "normal",
    solver: str = "HIGHS",
    time_limit: float | None = None,
    formulation: str = "compact",
    depth: int | None = None,
    ablation: bool = False,
    frees: bool | None = None,
    gap: float = 1e-3,
    verbose: bool = False,
    progress: Callable[[str], None] | None = None,
    baseline=None,
) -> Solution:
    """Choose what to keep and what to recompute so that one step fits `budget_bytes`.

    `progress` receives one line per event worth showing (the start found, each
    improved schedule where the solver reports them).

    `time_limit` (seconds of wall time) bounds the whole solve: the MILP's set-up, the
    cuts and the start heuristic count against it, and with `baseline` it is shared by
    the graphs solved (the first solved, `_solving_order`'s, gets all but
    `OTHER_GRAPH_SHARE` of it per graph after it). Only the search for the smallest
    feasible budget, when the budget is infeasible, has a limit of its own. CBC counts
    its limit in CPU seconds; its raced searches are interrupted at the wall-clock
    deadline (race.py).

    `baseline`: (captured graph, its profile), the graph before the mode's variants
    were rewritten into `graph`. With it the solver chooses, site by site, whether a
    variant that only changes what a backward op reads runs, or the aten op it
    replaced; and it also solves the captured graph itself, and where the mode has
    convolution algorithms beside other variants the captured graph with the algorithms
    alone (lowest bound first; each unless a bound on its step is no faster than a
    schedule in hand), and returns the fastest schedule (`Solution.variants` says which
    graph it runs on; `schedule_graph` gives that graph). So a mode is never slower than `normal`
    at the same budget, nor the full mode than `conv`. The ops both graphs run take the
    baseline profile's times, the others theirs scaled to its speed
    (`monet_like.profile.align_times`), so that machine noise between the two profiles
    does not decide. Without it, every variant rewritten into `graph` runs.

    `frees`: True: the compact formulation frees a recomputation's inputs after their
    last reader from the start, as the full formulation does (and as the replay does): a
    smaller smallest budget, and solves that take longer. None (default): the solve
    without them, then with them from its schedule where they could pay
    (`_refined_with_frees`). False: never."""
    options = dict(
        mode=mode,
        solver=solver,
        time_limit=time_limit,
        formulation=formulation,
        depth=depth,
        ablation=ablation,
        frees=frees,
        gap=gap,
        verbose=verbose,
        progress=progress,
    )
    missing = [f for f in parse_mode(mode) if f not in graph.variants]
    if missing:
        raise UserError(
            f"mode {mode!r}: the graph was captured without the {', '.join(missing)} variants;"
            " rewrite it with monet_like.variants.apply(graph, mode) before profiling"
        )
    if baseline is None or not graph.variants:
        return _solve(graph, profile, budget_bytes, reference=None, **options)
    captured, reference = baseline
    # The schedules are compared by time: put the profiles on one footing.
    profile = align_times(profile, graph, reference, captured)
    if progress is not None and getattr(profile, "aligned", ""):
        progress(f"times: {profile.aligned}")
    attempts = candidate_graphs(graph, profile, baseline)
    rank = {what: k for k, (what, *_rest) in enumerate(attempts)}  # a tie keeps the first
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    order = _solving_order(attempts, budget_bytes, formulation, depth, ablation)
    if progress is not None and order[0][0] != attempts[0][0]:
        progress(
            f"solving {order[0][0]} first: its LP relaxation bounds its step at"
            f" {order[0][-1]:.4f} s, the lowest of the {len(order)} graphs"
        )
    solved, infeasible, stopped = [], [], []
    cannot_win: dict[str, float] = {}  # graph -> a bound on its step, no faster than one solved
    for k, (what, g, p, ref, problem, prepared, _bound) in enumerate(order):
        best_s = min((sol.predicted_time_s for _, sol in solved), default=None)
        if best_s is not None:
            # No schedule of a graph beats its fastest step (nothing recomputed, the
            # fastest options): where that is no faster than a schedule in hand, the
            # graph's MILP (a third of a full-mode solve) is not needed.
            fastest = _fastest_step_s(problem)
            if fastest >= best_s:
                cannot_win[what] = fastest
                if progress is not None:
                    progress(
                        f"not solving {what}: its fastest step, {fastest:.4f} s, is no faster"
                        f" than the schedule in hand, {best_s:.4f} s"
                    )
                continue
        if progress is not None and solved + infeasible + stopped:
            progress(f"trying {what} too, to keep the fastest schedule")
        if deadline is not None:
            # The first graph solved gets the limit less a share kept for each graph
            # after it; each later one gets an even part of what is left.
            left, later = deadline - time.perf_counter(), len(attempts) - k - 1
            share = left - later * OTHER_GRAPH_SHARE * time_limit if k == 0 else left / (later + 1)
            options["time_limit"] = max(1.0, share)
        try:
            found = _solve(
                g, p, budget_bytes, reference=ref, problem=problem, beat_s=best_s,
                prepared=prepared, **options,
            )  # fmt: skip
            solved.append((what, found))
        except _CannotWin as exc:
            cannot_win[what] = exc.bound_s
            if progress is not None:
                progress(
                    f"not solving {what}: its LP relaxation bounds its step at {exc.bound_s:.4f}"
                    f" s, no faster than the schedule in hand, {best_s:.4f} s"
                )
        except InfeasibleBudget as exc:
            infeasible.append((what, exc))
        except UserError as exc:  # its share of the time ended with no schedule
            if progress is not None:
                progress(f"no schedule on {what} in its share of the time: {exc}")
            stopped.append((what, exc))
    mode_graph = attempts[0][0]  # solved in any order: its error is the one to give
    mode_stopped = [exc for what, exc in stopped if what == mode_graph]
    if not solved and stopped and (mode_stopped or not infeasible):
        raise (mode_stopped or [stopped[0][1]])[0]
    if not solved:
        # The lowest smallest budget is the mode's: a budget at it is solved on that
        # graph. Mostly the variants'; VGG-16 (176) in the full mode: 11.723 GB with
        # them against the captured graph's 11.657 GB (before the profiler's fix).
        what, lowest = min(infeasible, key=lambda e: (e[1].min_budget_bytes, rank[e[0]]))
        if what == mode_graph:
            raise lowest
        mode_exc = next((exc for w, exc in infeasible if w == mode_graph), infeasible[0][1])
        raise InfeasibleBudget(
            f"{lowest} (on {what}; with the mode's variants "
            f"{gb_at_least(mode_exc.min_budget_bytes)} GB)",
            lowest.min_budget_bytes,
            lowest.fixed_bytes,
        ) from None
    what, best = min(solved, key=lambda e: (e[1].predicted_time_s, rank[e[0]]))
    # Overhead and store-all are eager's, whichever graph won: another graph's own
    # store-all step has its variants all on (ResNet-50 at 16, 128 px, full mode: in-place
    # BatchNorm backwards made it 2.1% slower than eager's, and a schedule on it claimed
    # -2.43% where it was -0.39% against eager).
    eager = next((problem for _, g, *_r, problem, _p, _b in order if g is captured), None)
    if eager is None:  # the captured graph was not weighed (a caller narrowed the graphs)
        eager = build_problem(captured, reference)
    best.store_all_time_s = eager.store_all_time_s
    best.store_all_peak_bytes = eager.store_all_peak_bytes
    others = {w: s.predicted_time_s for w, s in solved if s is not best}
    best.extra["kept_over"] = others  # what each other graph's schedule was predicted at
    if cannot_win:
        best.extra["not_solved"] = cannot_win  # a lower bound on each graph's step
    if progress is not None and others:
        progress(
            f"kept the schedule on {what}, predicted {best.predicted_time_s:.4f} s: "
            + "; ".join(f"on {w}, {t:.4f} s" for w, t in others.items())
        )
    return best


def _solving_order(
    attempts: list[tuple], budget_bytes: int, formulation: str, depth: int | None,
    ablation: bool,
) -> list[tuple]:  # fmt: skip
    """`candidate_graphs` in the order they are solved, each with its Problem, the
    formulation and LP built for its bound (for `_solve` to reuse) and a lower bound on
    its step (`_step_bound_before_solve`) appended: the lowest bound first, so
    that the schedule in hand when the others come lets their LP bounds skip their
    MILPs. A tie keeps the order: the mode's graph, the convolution algorithms alone,
    the captured graph (the algorithms' schedules include the captured graph's: PyTorch's
    own algorithm is one of each convolution's options). ResNet-50 (184), 10 GB, full
    mode, CBC, on one profile: the algorithms alone proved in 15.8 s and beat the mode's
    graph, whose LP then bounds it above them; solved first, the mode's graph took 151 s."""
    later = sorted(range(1, len(attempts)), key=lambda k: attempts[k][1].variants != ("conv",))
    ordered = [attempts[0], *(attempts[k] for k in later)]
    depth = None if formulation == "full" else (depth or DEFAULT_DEPTH)
    rows = []
    for what, g, p, ref in ordered:
        problem = build_problem(g, p, reference=ref)
        bound, prepared = _step_bound_before_solve(problem, budget_bytes, depth, ablation)
        rows.append((what, g, p, ref, problem, prepared, bound))
    return sorted(rows, key=lambda row: row[-1])  # stable: a tie keeps the order above


def _step_bound_before_solve(
    problem: Problem, budget_bytes: int, depth: int | None, ablation: bool
) -> tuple[float, tuple | None]:
    """A lower bound on the step of `problem`'s schedules at `budget_bytes`, for the order
    graphs are solved in: its fastest step plus its LP relaxation's recomputation (0
    without HiGHS or an LP optimum; infinity where the LP proves nothing fits). Each
    graph's skip is decided in `_solve`, on its own bound. Also returns what `_solve`
    reuses rather than builds again (`_solve`'s `prepared`): the formulation (frees off)
    and the HiGHS model at its LP optimum (None where not reached); None without HiGHS."""
    fastest = _fastest_step_s(problem)
    if importlib.util.find_spec("highspy") is None:
        return fastest, None
    f = formulate(problem, depth, allow_recompute=not ablation)
    h, solved = solved_relaxation(f, budget_bytes, 10.0)
    if known_infeasible(f, budget_bytes):
        return float("inf"), (f, None)
    if not solved:
        return fastest, (f, None)
    return fastest + float(h.getInfo().objective_function_value) * 1e-3, (f, h)


class _CannotWin(Exception):
    """No schedule of the graph being solved beats the one in hand: `bound_s` (a lower
    bound on its predicted step) is no less than that schedule's."""

    def __init__(self, bound_s: float) -> None:
        super().__init__(f"no schedule faster than {bound_s:.4f} s")
        self.bound_s = bound_s


def _step_lower_bound_s(
    problem: Problem,
    depth: int | None,
    cut_stats: dict,
    budget_bytes: int,
    frees_too: bool,
    time_limit: float | None,
    beat_s: float,
) -> float | None:
    """A lower bound on the predicted step of any schedule `_solve` can return for
    `problem` at `budget_bytes`: its fastest step plus the LP relaxation's recomputation
    (the cuts' LP, cuts included; None where none was solved). Where the solve may end
    with the frees (`frees_too`), their LP's, which is lower (their schedules include
    the others). That LP is solved only where the plain bound reaches `beat_s`: below
    it the graph may win either way, and the plain figure returned says only that."""
    lp_s = cut_stats.get("lp_after_s")
    if lp_s is None:
        return None
    fastest_s = _fastest_step_s(problem)
    if frees_too and fastest_s + lp_s >= beat_s:
        with_frees = formulate(problem, depth, allow_recompute=True, frees=True)
        lp_limit = 60.0 if time_limit is None else max(1.0, min(60.0, 0.1 * time_limit))
        h, solved = solved_relaxation(with_frees, budget_bytes, lp_limit)
        if not solved:
            return None
        lp_s = min(lp_s, float(h.getInfo().objective_function_value) * 1e-3)
    return fastest_s + lp_s


def _fastest_step_s(problem: Problem) -> float:
    """`problem.fastest_step_s` (a function, so that tests can make every graph win)."""
    return problem.fastest_step_s


def candidate_graphs(graph, profile, baseline) -> list[tuple]:
    """What a mode's solve weighs, as (what runs, graph, its profile, the reference
    profile to pass `build_problem`), in the order a tie keeps: `graph` with the mode's
    variants, the captured graph (`baseline` = (captured graph, its profile)), and, where
    `graph` has convolution algorithms beside other variants, the captured graph with
    the algorithms alone. The mode's other variants are partly fixed (in-place ops, the
    compact max-pool) and cost time of their own, so the algorithms alone can be faster
    (MobileNetV2 at 272, 10 GB: 6.6% below normal's store-all step in conv_normal, 0.7%
    above it in the full mode); their profile is built from the two already taken
    (`derived_profile`). `profile` should be aligned to the baseline's (`align_times`)."""
    captured, reference = baseline
    found = [
        ("the mode's variants", graph, profile, reference),
        ("the captured graph (no variants)", captured, reference, None),
    ]
    if "conv" in graph.variants and len(graph.variants) > 1:
        conv_graph = apply_variants(captured, ("conv",))
        conv_profile = derived_profile(conv_graph, captured, reference, profile, graph)
        if conv_profile is not None:
            found.append(("the convolution algorithms alone", conv_graph, conv_profile, reference))
    return found


def schedule_graph(solution: Solution, graph, profile, baseline=None):
    """(graph, profile) that `solution`, returned by `solve(graph, profile, ...,
    baseline=baseline)`, runs on: `graph`, the captured graph, or the captured graph
    with only the convolution algorithms (`candidate_graphs`)."""
    if baseline is None:
        return graph, profile
    for _, g, p, _ in candidate_graphs(graph, profile, baseline):
        if tuple(g.variants) == tuple(solution.variants or ()):
            return g, p
    raise ValueError(f"none of the graphs solved runs the variants {solution.variants}")


def _from_start(f, start, raw, solver: str, tolerance: float) -> RawResult:
    """The solver's result replaced by the start schedule: feasible, its gap measured
    against the solver's bound where it reported one (also when it stopped without a
    schedule of its own)."""
    objective = float(f.cost @ start) * 1e-3
    bound = raw.bound if raw.status != "infeasible" else None
    gap = relative_gap(objective, bound)
    bound_ms = None if bound is None else bound / 1e-3
    proved = within_tolerance(f, objective / 1e-3, bound_ms, tolerance)
    if objective <= 1e-12:
        bound = 0.0
    return RawResult(
        "optimal" if proved else "feasible",
        start, objective, bound, gap, raw.solve_time_s, solver,
        first_feasible_s=0.0,
    )  # fmt: skip


WINDOWS_AFTER_SHARE = 0.3  # of the limit: the second CBC search's, before its windows


def _cbc_beside_windows(
    f, budget_bytes: int, start: np.ndarray, time_limit: float | None, gap: float,
    verbose: bool, progress: Callable[[str], None] | None,
) -> RawResult:  # fmt: skip
    """Two CBC searches raced, the second one (on the problem shuffled) stopped after
    `WINDOWS_AFTER_SHARE` of the limit and followed, on its core, by windows improving
    the best schedule known there (`neighbourhood.lower_cost`, CBC on each) for the rest.
    The cheapest schedule and the higher bound come back; a search that proves its
    schedule ends the race. Why: CBC through cylp takes no start, and on a large problem
    its own schedules come late (ResNet-50 at 184, full mode, 6 GB: 3.874 s of
    recomputation after 600 s where the optimum is 3.401 s; windows from the start beside
    one search reached 3.512 s in 300 s), while on an easy one a second search ordered
    otherwise is often the first to prove (the main job, ResNet-50 at 184,
    normal, 10 GB, each run on a fresh profile: 8.5 and 40 s with two searches raced,
    116 s with the first search alone beside windows)."""
    started = time.perf_counter()
    deadline = None if time_limit is None else started + time_limit
    rhs = _rhs_for(f, budget_bytes)

    def run(seed: int, stop) -> RawResult:
        if seed == 0:
            return cbc_seeded(f, rhs, time_limit, gap, verbose, None, None, 0)
        first_limit = None if time_limit is None else WINDOWS_AFTER_SHARE * time_limit
        first = cbc_seeded(f, rhs, first_limit, gap, False, None, None, seed)
        if first.status in ("optimal", "infeasible"):
            return first
        x = start
        if first.x_bool is not None and float(f.cost @ first.x_bool) < float(f.cost @ start):
            x = first.x_bool
        x = lower_cost(f, x, budget_bytes, "CBC", deadline, progress)
        cost_s, bound = float(f.cost @ x) * 1e-3, first.bound
        return RawResult("feasible", x, cost_s, bound, relative_gap(cost_s, bound), 0.0, "CBC",
                         "windows")  # fmt: skip

    cbc_rows(f, rhs)  # once, before the racers fork
    outcomes = race(run, 2, lambda r: r.status in CBC_FINISHED, False, deadline)
    return merge_cbc_outcomes(f, outcomes, gap, time.perf_counter() - started)


def _cuts_line(stats: dict) -> str:
    """The progress line for `root_cuts`'s `stats`."""
    before, after, seconds = stats["lp_before_s"], stats["lp_after_s"], stats["seconds"]
    if before is None:
        return "cuts: none (the LP relaxation reached no optimum to separate them on)"
    if not stats["cuts"]:
        return (
            f"cuts: none, the LP relaxation breaks no recompute-count row (its bound "
            f"{before:.3f} s of recomputation; {seconds:.1f} s)"
        )
    lift = f", +{after / before - 1:.2%}" if before > 0 else ""  # below 3 decimals too
    return (
        f"cuts: {stats['cuts']} recompute-count rows lift the LP bound from {before:.3f} "
        f"to {after:.3f} s of recomputation{lift} ({seconds:.1f} s)"
    )


def _checked_options(solver: str, formulation: str, budget_bytes: int) -> str:
    """The solver's name as SOLVERS spells it; a UserError for an unknown solver or
    formulation, or a budget that is not positive."""
    solver = solver.upper()
    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}: choose one of {', '.join(SOLVERS)}")
    if formulation not in ("compact", "full"):
        raise UserError(f"unknown formulation {formulation!r}: compact or full")
    if budget_bytes <= 0:
        raise UserError("the budget must be positive")
    return solver


def _no_schedule_fits(
    problem: Problem,
    budget_bytes: int,
    depth: int | None,
    ablation: bool,
    solver: str,
    frees: bool,
    whose: str,
    progress: Callable[[str], None] | None,
) -> InfeasibleBudget:
    """The error for a budget proved infeasible, naming the smallest feasible one
    (`whose`: of which formulation, `_whose_smallest`) and the fixed part."""
    smallest = _smallest_budget(problem, depth, ablation, solver, frees, progress)
    fixed = f"{problem.fixed_bytes / GIB:.3f} GB"
    at_least = f"the smallest feasible budget is {gb_at_least(smallest)} GB{whose}"
    if budget_bytes < problem.fixed_bytes:
        message = (
            f"budget {budget_bytes / GIB:.3f} GB is below the fixed part {fixed}"
            f" (parameters, gradients, buffers, input); {at_least}"
        )
    else:
        message = f"no schedule fits {budget_bytes / GIB:.3f} GB: {at_least}; fixed part {fixed}"
    return InfeasibleBudget(message, smallest, problem.fixed_bytes)


def _solve(
    graph,
    profile,
    budget_bytes: int,
    mode: str,
    solver: str,
    time_limit: float | None,
    formulation: str,
    depth: int | None,
    ablation: bool,
    frees: bool | None,
    gap: float,
    verbose: bool,
    progress: Callable[[str], None] | None,
    reference,
    problem: Problem | None = None,
    beat_s: float | None = None,
    prepared: tuple | None = None,
) -> Solution:
    """`solve` on one graph. `beat_s`: the predicted step of a schedule in hand (of
    another graph of the model); where this graph's LP bound proves that none of its
    schedules is faster, `_CannotWin` is raised before its MILP. `prepared`: (the
    formulation of `problem` at `depth` with the frees off, its HiGHS model at the LP
    optimum at `budget_bytes` or None), built for `_solving_order`'s bound; used where
    the solve starts without the frees, so neither is built twice (ResNet-50 (184), full
    mode: a formulation of 0.6 to 0.9 s and an LP of about 0.5 s per graph solved)."""
    solver = _checked_options(solver, formulation, budget_bytes)
    depth = None if formulation == "full" else (depth or DEFAULT_DEPTH)

    started = time.perf_counter()  # `time_limit` counts from here: cuts and start included
    if problem is None:
        problem = build_problem(graph, profile, reference=reference)
    base = _solution_base(graph, profile, problem, mode, budget_bytes, solver, ablation)
    if budget_bytes >= problem.store_all_peak_bytes and not (problem.choices or problem.algorithms):
        # With variant sites or convolution algorithms to choose, store-all fits but the
        # MILP still picks the faster options (PyTorch's algorithms are not always those).
        return _store_all(problem, base)

    check_solver(solver)
    # None: the frees left to the solve (tried after it, or where nothing fits without);
    # their LP is HiGHS's
    auto_frees = (
        frees is None
        and formulation == "compact"
        and not ablation
        and importlib.util.find_spec("highspy") is not None
    )
    # The compact formulation's smallest budget is an upper bound on the true one.
    frees = frees and formulation == "compact" and not ablation
    whose = _whose_smallest(frees, formulation, ablation)
    if budget_bytes < problem.fixed_bytes:
        raise _no_schedule_fits(
            problem, budget_bytes, depth, ablation, solver, frees, whose, progress
        )

    if prepared is not None and not frees:
        f, lp = prepared
    else:
        f, lp = formulate(problem, depth, allow_recompute=not ablation, frees=frees or None), None
    known = remembered_least_peak(f)  # before the cuts' rows
    cut_stats = {}
    if solver in CUT_SOLVERS:
        cut_limit = 60.0 if time_limit is None else max(5.0, min(60.0, 0.1 * time_limit))
        cuts, cut_stats = root_cuts(f, budget_bytes, time_limit=cut_limit, solved_lp=lp)
        f = with_cuts(f, cuts)
        if progress is not None:
            progress(_cuts_line(cut_stats))
    if beat_s is not None:
        bound_s = _step_lower_bound_s(
            problem, depth, cut_stats, budget_bytes, auto_frees, time_limit, beat_s
        )
        if bound_s is not None and bound_s >= beat_s:
            raise _CannotWin(bound_s)
    t0 = time.perf_counter()
    # near the smallest budget only the least-peak search finds a start: a share of the time
    peak_search_s = START_PEAK_SEARCH_SHARE * (time_limit or MIN_BUDGET_TIME_LIMIT)
    lp_columns = cut_stats.get("lp_columns")  # the LP of `f` (cuts included) at the budget
    start, how = start_schedule(f, budget_bytes, solver, peak_search_s, known, lp_columns)
    if start is not None and not is_feasible(f, start, budget_bytes):
        start, how = None, "the heuristic's schedule broke a row"  # never hand that over
    searched = time.perf_counter()
    start_s = searched - t0
    left = None if time_limit is None else max(1.0, time_limit - (searched - started))
    start_cost = None if start is None else float(f.cost @ start)  # ms
    if progress is not None:
        if start is None:
            progress(f"start: none ({how}, {start_s:.1f} s); {solver} starts from scratch")
        else:
            progress(
                f"start: {how} schedule with {start_cost * 1e-3:.3f} s of "
                f"recomputation ({start_s:.1f} s)"
                + ("" if solver in STARTABLE else f"; {solver} takes no start, kept as fallback")
            )

    def none_fits(why: str = "no schedule fits without the frees") -> Solution:
        """With the frees left to the solve (the default), a budget that no schedule
        fits without them is solved with them where their LP relaxation allows it (the
        benchmarks' GPT: 0.1007 GB with them, 0.1398 GB without); else the error."""
        if auto_frees:
            with_frees = formulate(problem, depth, allow_recompute=True, frees=True)
            if not relaxation_infeasible(with_frees, budget_bytes):
                if progress is not None:
                    progress(f"{why}: solving with them")
                spent = time.perf_counter() - started
                return _solve(
                    graph, profile, budget_bytes, mode=mode, solver=solver,
                    time_limit=None if time_limit is None else max(1.0, time_limit - spent),
                    formulation=formulation, depth=depth, ablation=ablation, frees=True,
                    gap=gap, verbose=verbose, progress=progress, reference=reference,
                    problem=problem,
                )  # fmt: skip
        raise _no_schedule_fits(
            problem, budget_bytes, depth, ablation, solver, frees, whose, progress
        )

    if start is None and known_infeasible(f, budget_bytes):
        # the LP relaxation (the cuts' or the start's) proved it: no MILP to run
        return none_fits()
    if start is None and auto_frees:
        # Near the smallest budget without the frees: the MILP seldom finds a schedule
        # there (the GPT's full mode at 0.1397 GB: none in 120 s), and with them the
        # least-peak start reaches far lower. Every schedule is one with the frees.
        return none_fits("no start without the frees")
    if solver == "CBC" and start is not None and race_workers(f) > 1:
        raw = _cbc_beside_windows(f, budget_bytes, start, left, gap, verbose, progress)
    else:
        raw = solve_formulation(
            f, budget_bytes, solver, left, gap, verbose,
            start if solver in STARTABLE else None, progress,
        )  # fmt: skip
    search_s = time.perf_counter() - searched
    if raw.status == "infeasible" and start is None:
        return none_fits()
    x, returned_start = raw.x_bool, False
    peak = None if x is None else evaluate(f, x)
    fits = peak is not None and peak["peak_bytes"] <= budget_bytes + 1024
    if peak is not None and not fits and raw.status == "optimal":
        raise RuntimeError(
            f"{solver} returned a schedule of {peak['peak_bytes']} bytes for a "
            f"budget of {budget_bytes}: a bug in the formulation or the solver"
        )
    if start is not None and (not fits or start_cost < float(f.cost @ x)):
        # The solver stopped (time limit) without a schedule, or with a costlier one
        # than the start it could not take: the start is the answer.
        raw = _from_start(f, start, raw, solver, gap)
        x, peak, fits, returned_start = start, evaluate(f, start), True, True
    if raw.status == "error" and not fits:
        raise UserError(f"solver {solver} failed: {raw.message}")
    if not fits:
        best = "" if peak is None else f" (its best one needs {peak['peak_bytes'] / GIB:.3f} GB)"
        raise UserError(
            f"{solver} stopped at the time limit without a schedule that fits "
            f"{budget_bytes / GIB:.3f} GB{best}: give it more time (--time_limit)"
            + ("" if solver == "HIGHS" else " or use HIGHS")
        )
    # the search above, on its own: where the frees improve on its schedule, the
    # solution's status and gap are theirs, and this says whether it was proved first
    first_search = {
        "status": raw.status,
        "gap": None if raw.gap is None else float(raw.gap),
        "recompute_s": float(f.cost @ x) * 1e-3,
        "seconds": time.perf_counter() - started,
    }
    frees_tried = None
    if auto_frees:
        deadline = None if time_limit is None else started + time_limit
        refined, frees_tried = _refined_with_frees(
            problem, depth, f, x, budget_bytes, solver, gap, verbose, progress, deadline
        )
        if refined is not None:
            f, raw, x, peak = refined
            returned_start = False
    if start is not None:  # a schedule within the budget existed once the start did
        first_feasible_s = searched - started
    elif raw.first_feasible_s is not None:
        first_feasible_s = raw.first_feasible_s + (searched - started)
    else:
        first_feasible_s = None  # the solver reports no incumbents
    off, algorithms, stages = _decisions(problem, f, x)
    return Solution(
        **base,
        formulation=formulation,
        depth=depth,
        status=raw.status,
        objective_s=raw.objective,
        bound_s=raw.bound,
        gap=raw.gap,
        solve_time_s=time.perf_counter() - started,  # the MILP's set-up, cuts and start too
        predicted_peak_bytes=peak["peak_bytes"],
        predicted_peak_at=peak["peak_at"],
        predicted_time_s=problem.store_all_time_s - problem.choice_base_s + raw.objective,
        stats={
            **f.stats,
            "frees": f.free_plans is not None,
            "start": how if start is not None else None,
            "returned_start": returned_start,
            "start_objective_s": None if start is None else start_cost * 1e-3,
            "first_feasible_s": first_feasible_s,
            "start_s": start_s,
            "search_s": search_s,
            "cut_s": cut_stats.get("seconds"),
            "cut_lp_before_s": cut_stats.get("lp_before_s"),
            "cut_lp_after_s": cut_stats.get("lp_after_s"),
            "frees_tried": frees_tried,
            "first_search": first_search,
        },
        keep=[bool(x[f.keep[u.id]]) for u in problem.units],
        units=[list(u.nodes) for u in problem.units],
        stages=stages,
        variants_off=off,
        algorithms=algorithms,
    )


def _solution_base(graph, profile, problem, mode, budget_bytes, solver, ablation) -> dict:
    """The Solution's fields that describe the run, whatever the search finds."""
    return dict(
        model=graph.model,
        fingerprint=graph.fingerprint,
        batch=graph.batch,
        input_shape=graph.input_shape,
        dtype=graph.dtype,
        device=profile.device,
        mode=mode,
        budget_bytes=int(budget_bytes),
        solver=solver,
        store_all_peak_bytes=problem.store_all_peak_bytes,
        store_all_time_s=problem.store_all_time_s,
        fixed_bytes=problem.fixed_bytes,
        ablation=ablation,
        input_grad=graph.input_grad,
        outputs_held=graph.outputs_held,
        autocast=graph.autocast,
        variants=list(graph.variants),
        plain_batch_norms=list(graph.plain_batch_norms),
    )


FREES_WORTH = 0.05  # of the store-all step: the least saving that the frees are tried for
FREES_MIN_S = 10.0  # seconds left, at least, to try them


def _refined_with_frees(
    problem: Problem, depth: int, f, x: np.ndarray, budget_bytes: int, solver: str,
    gap: float, verbose: bool, progress: Callable[[str], None] | None, deadline: float | None,
) -> tuple[tuple | None, dict | None]:  # fmt: skip
    """The compact formulation's schedule `x` improved with the frees (each recomputed
    value freed after its last reader), where they could pay: their LP relaxation at the
    budget must leave room for a saving of at least FREES_WORTH of the store-all step
    below `x`'s recomputation. The frees' MILP starts from `x` (HiGHS where `solver`
    takes no start), so it never returns a costlier schedule. Returns ((formulation,
    raw result, x, peak) or None, what was tried, for the solution's stats).

    On the benchmarks' GPT (dim 256, 8 x 256) at half of eager's activation memory the
    frees lower the recomputation from 84.8 to 51.7 ms (their LP: 16.5 ms); on ResNet-50
    (16 x 128 px) at 50% and 35% their LP is within 6.6 and 36.9 ms of the optimum
    without them (a step of 831 ms), and 300 s of HiGHS with them found nothing cheaper."""
    # From the schedule in hand, so that it never returns a costlier one: with a solver
    # that takes no start (cylp's CBC, Gurobi through cvxpy), HiGHS searches, as the
    # smallest-budget search does.
    if importlib.util.find_spec("highspy") is None:
        return None, None  # the frees' LP below is HiGHS's
    if solver not in STARTABLE:
        solver = "HIGHS"
    cost_ms = float(f.cost @ x)
    step_ms = problem.store_all_time_s * 1e3
    if cost_ms < FREES_WORTH * step_ms or (
        deadline is not None and deadline - time.perf_counter() < FREES_MIN_S
    ):
        return None, None
    t0 = time.perf_counter()
    with_frees = formulate(problem, depth, allow_recompute=True, frees=True)
    lp_limit = 60.0 if deadline is None else max(1.0, min(60.0, deadline - t0))
    h, solved = solved_relaxation(with_frees, budget_bytes, lp_limit)
    if not solved:
        return None, {"lp_bound_ms": None, "seconds": time.perf_counter() - t0}
    bound_ms = float(h.getInfo().objective_function_value)
    tried = {"cost_ms": cost_ms, "lp_bound_ms": bound_ms, "improved": False, "solver": solver}
    start = carried_over(x, f, with_frees)
    if cost_ms - bound_ms < FREES_WORTH * step_ms or not is_feasible(
        with_frees, start, budget_bytes
    ):
        tried["seconds"] = time.perf_counter() - t0
        return None, tried
    if progress is not None:
        progress(
            f"the frees could save up to {(cost_ms - bound_ms) * 1e-3:.3f} s of the"
            f" {cost_ms * 1e-3:.3f} s recomputed (their LP): solving with them from this schedule"
        )
    left = None if deadline is None else max(1.0, deadline - time.perf_counter())
    raw = solve_formulation(with_frees, budget_bytes, solver, left, gap, verbose, start, progress)
    tried["seconds"] = time.perf_counter() - t0
    # into their search, when its best schedule came: how long the search paid for
    tried["best_found_s"] = raw.best_found_s
    if raw.x_bool is None or float(with_frees.cost @ raw.x_bool) >= cost_ms - 1e-6:
        if progress is not None:
            progress(f"with the frees: nothing cheaper in {tried['seconds']:.1f} s")
        return None, tried
    peak = evaluate(with_frees, raw.x_bool)
    if peak["peak_bytes"] > budget_bytes + 1024:
        return None, tried
    tried["improved"] = True
    if progress is not None:
        progress(
            f"with the frees: {raw.objective:.3f} s recomputed ({raw.status}) instead of"
            f" {cost_ms * 1e-3:.3f} s, in {tried['seconds']:.1f} s"
        )
    return (with_frees, raw, raw.x_bool, peak), tried


def _whose_smallest(frees: bool | None, formulation: str, ablation: bool) -> str:
    """Which formulation a smallest feasible budget is the smallest of, for messages."""
    if frees:
        return " in the compact formulation with frees"
    if frees is None and formulation == "compact" and not ablation:
        return (
            " in the compact formulation, with the frees where their LP reaches lower"
            " (--formulation full searches more schedules)"
        )
    if formulation == "compact" and not ablation:
        return (
            " in the compact formulation (--frees or --formulation full free recomputed"
            " values sooner)"
        )
    return ""


def _decisions(problem, f, x) -> tuple[list[str], dict[str, list[int]], list[dict]]:
    """What the 0/1 columns `x` decide: the variant sites turned off, the convolution
    algorithms chosen (sites left to PyTorch's own omitted), and per stage its
    recomputations."""
    off = [c.site for k, c in enumerate(problem.choices) if x[f.off_col[k]]]
    algorithms = {}
    for a, (i, j) in zip(problem.algorithms, f.chosen_options(x), strict=True):
        (forward,), _, _ = a.forward[i]
        data, weight = a.backward[j][0] if j is not None else (-1, -1)
        if (forward, data, weight) != (-1, -1, -1):
            algorithms[a.site] = [int(forward), int(data), int(weight)]
    stages = []
    for t, s in enumerate(problem.stages):
        rec = [u for u in f.cand[t] if (t, u) in f.r_index and x[f.r_index[t, u]]]
        stages.append(
            {"unit": s.unit, "ops": list(s.ops), "recompute": rec, "candidates": f.cand[t]}
        )
    return off, algorithms, stages


__all__ = [
    "solve",
    "schedule_graph",
    "candidate_graphs",
    "parse_mode",
    "InfeasibleBudget",
    "min_feasible_budget",
    "SOLVERS",
]
