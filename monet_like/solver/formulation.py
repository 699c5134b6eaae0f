"""The mixed-integer program: which units to keep, which to recompute and when.

See docs/solver.md for the mathematics. In short, with units u (bytes m_u,
recompute time c_u) and backward stages t (in eager order):

  keep_u     binary   u stays in memory after the forward pass
  R[t,u]     binary   u is recomputed just before stage t
  S[t,u]     binary   u is in memory at the start of stage t

defined only for the candidates C(t) of each stage: the units stage t needs and
their forward ancestors up to `depth` steps back. Outside C(t) a unit is present
exactly when it was kept, until its last possible use. Memory is checked at every
forward unit, at every recomputation and at every run of a stage's backward ops,
with the backward-only bytes (gradients, temporaries, workspace) there. Auxiliary
running sums keep the number of nonzeros linear in the size of the graph.

depth=None is the "full" formulation, MONeT's T x V: every ancestor is a candidate
of every stage, and memory is checked at each recomputation with each input freed
after its last recomputed reader (free[t, i, k] columns, Checkmate's FREE), where the
compact one counts a recomputed unit until the stage's recomputations end.

The matrix is built once, sparse, and handed to HiGHS (highspy), CBC (cylp), Gurobi
(cvxpy) or PuLP's bundled CBC.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from monet_like.solver.problem import Problem

MIB = float(2**20)  # bytes are scaled to MiB inside the matrix: better conditioned


MS = 1e-3  # times scaled to milliseconds


def candidates(problem: Problem, depth: int | None) -> list[list[int]]:
    """C(t): the units stage t needs and their ancestors up to `depth` steps back."""
    inputs = [u.inputs for u in problem.units]
    result = []
    for stage, extra in zip(problem.stages, _choice_needs(problem), strict=True):
        seen = set(stage.need) | extra
        frontier = deque((u, 0) for u in seen)
        while frontier:
            u, d = frontier.popleft()
            if depth is not None and d >= depth:
                continue
            for v in inputs[u]:
                if v not in seen:
                    seen.add(v)
                    frontier.append((v, d + 1))
        result.append(sorted(seen))
    return result


def _recompute_order(problem: Problem, cand, r_index, rec_alg, algorithm_of, every=False):
    """Per stage: the recomputable candidates in the order their ops run (by first
    node); for each, the last position among them that has begun by the time its own
    last node runs (-1 where it needs no row of its own: no workspace, unless `every`);
    and the positions where the running sum of recomputed bytes is read."""
    units = problem.units
    order, prefix_end, breaks = [], [], []
    for t, c in enumerate(cand):
        o = sorted((u for u in c if (t, u) in r_index), key=lambda u: (min(units[u].nodes), u))
        firsts = [min(units[u].nodes) for u in o]
        ends = []
        for u in o:
            algorithm = problem.algorithms[algorithm_of[u]] if (t, u) in rec_alg else None
            has_ws = (
                every
                or units[u].workspace_bytes > 0
                or (algorithm is not None and any(opt[2] for opt in algorithm.forward))
            )
            ends.append(bisect_right(firsts, max(units[u].nodes)) - 1 if has_ws else -1)
        order.append(o)
        prefix_end.append(ends)
        breaks.append(sorted({e for e in ends if e >= 0} | ({len(o) - 1} if o else set())))
    return order, prefix_end, breaks


@dataclass(frozen=True)
class FreePlan:
    """The full formulation's frees in one stage. `readers`: the recomputable units
    that read a candidate the stage's backward ops do not, in the order their last op
    runs, each with those inputs. Input i read by k can go once both k's ops and i's
    own (a view of i read late holds it) have run: `event[i, k]` numbers that moment
    among the stage's distinct ones, in order; `before[p]`: how many of them come
    before the unit at position p of the run order begins."""

    readers: tuple[tuple[int, tuple[int, ...]], ...]
    event: dict[tuple[int, int], int]
    n_events: int
    before: tuple[int, ...]


def _free_plans(problem: Problem, cand, order) -> list[FreePlan]:
    units = problem.units
    choice_needs = _choice_needs(problem)
    never_freed = {u.id for u in units if u.side_of is not None}
    never_freed |= {u for c in problem.choices for u in c.optional_units}
    plans = []
    for t, (stage, c) in enumerate(zip(problem.stages, cand, strict=True)):
        read = set(stage.need) | choice_needs[t]  # all the stage's backward ops read
        in_stage = set(c)
        readers = []
        for k in sorted(order[t], key=lambda u: units[u].span[1]):
            freeable = [i for i in units[k].inputs if i in in_stage and i not in read | never_freed]
            if freeable:
                readers.append((k, tuple(freeable)))
        when = {
            (i, k): max(units[k].span[1], units[i].span[1]) for k, inputs in readers for i in inputs
        }
        times = sorted(set(when.values()))
        number = {w: e for e, w in enumerate(times)}
        plans.append(
            FreePlan(
                readers=tuple(readers),
                event={ik: number[w] for ik, w in when.items()},
                n_events=len(times),
                before=tuple(bisect_right(times, units[u].span[0] - 1) for u in order[t]),
            )
        )
    return plans


def _op_runs(stage, choice_needs: set[int]):
    """The stage's runs of ops (Stage.by_op); a stage without them is one run that reads
    all its needs and its choices' units."""
    return stage.by_op or ((None, stage.grad_bytes, tuple(set(stage.need) | choice_needs)),)


def _reads_from(stage, op: int | None, choice_needs: set[int]) -> tuple[int, ...]:
    """The units the stage's backward ops read from op `op` on (its run of ops, see
    `_op_runs`); without the op, the first run's: all the stage reads."""
    runs = _op_runs(stage, choice_needs)
    later = [
        reads for first, _, reads in runs if op is not None and first is not None and first <= op
    ]
    return later[-1] if later else runs[0][2]


def _choice_needs(problem: Problem) -> list[set[int]]:
    """Per stage, the units one option or the other of its choices needs."""
    extra: list[set[int]] = [set() for _ in problem.stages]
    for c in problem.choices:
        extra[c.stage].update(c.on_units, c.off_units)
    return extra


@dataclass
class Formulation:
    problem: Problem
    depth: int | None
    cand: list[list[int]]
    last_use: list[int]  # L_u: last stage where u may be present (-1: never in backward)
    n_bool: int
    n_cont: int
    keep: np.ndarray  # column index of keep_u
    r_index: dict[tuple[int, int], int]
    s_index: dict[tuple[int, int], int]
    on_col: np.ndarray  # per choice: column of "the variant runs"
    off_col: np.ndarray  # per choice: column of "the aten op it replaced runs"
    cost: np.ndarray  # objective over the boolean columns (ms)
    a_bool: sp.csr_matrix  # rows: A_b x + A_c y (<= or ==) rhs
    a_cont: sp.csr_matrix
    rhs: np.ndarray
    is_eq: np.ndarray
    budget_rows: np.ndarray  # rows whose right-hand side is the budget (minus constants)
    budget_const: np.ndarray  # the constant subtracted on those rows (MiB)
    stats: dict = field(default_factory=dict)
    columns: list | None = field(default=None, repr=False)  # filled by evaluate()
    # per algorithm choice: a column per forward option and per backward option
    fwd_cols: list[np.ndarray] = field(default_factory=list)
    bwd_cols: list[np.ndarray] = field(default_factory=list)
    # (stage, unit) -> per forward option, "recomputed before the stage with it"
    rec_alg: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    algorithm_of: dict[int, int] = field(default_factory=dict)  # unit -> algorithm choice
    # per stage, the recomputable candidates in run order, and per entry the last
    # position begun when it ends (-1: no row of its own): see _recompute_order
    recompute_order: list[list[int]] = field(default_factory=list)
    prefix_end: list[list[int]] = field(default_factory=list)
    # the full formulation (depth None): a recomputation's inputs are freed after their
    # last reader, with a continuous column per (stage, input, reader): see _free_plans
    free_plans: list[FreePlan] | None = None
    free_columns: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))
    cache: dict = field(default_factory=dict, repr=False)  # solver inputs built once

    def chosen_options(self, x: np.ndarray) -> list[tuple[int, int | None]]:
        """Per algorithm choice, the forward option and the backward option (None: it
        has no backward) that the 0/1 columns `x` select, as indices."""
        return [
            (int(np.argmax(x[fwd])), int(np.argmax(x[bwd])) if len(bwd) else None)
            for fwd, bwd in zip(self.fwd_cols, self.bwd_cols, strict=True)
        ]

    @property
    def n_rows(self) -> int:
        return self.a_bool.shape[0]


def formulate(
    problem: Problem, depth: int | None, allow_recompute: bool = True, frees: bool | None = None
) -> Formulation:
    """The MILP of `problem`: candidates up to `depth` steps back (None: all, the full
    formulation); `allow_recompute=False` forbids recomputation (--ablation); `frees`
    frees a recomputation's inputs after their last reader (default: in the full
    formulation only; docs/solver.md says why not in the compact one)."""
    units, stages = problem.units, problem.stages
    n_u, n_t = len(units), len(stages)
    cand = candidates(problem, depth if allow_recompute else 0)  # depth 0: the needs alone
    cand_sets = [set(c) for c in cand]
    # A variant's own forward outputs (the ReLU mask) exist only while it is chosen;
    # they are kept, never recomputed.
    optional_of = {u: k for k, c in enumerate(problem.choices) for u in c.optional_units}

    last_use = [-1] * n_u
    for t, c in enumerate(cand):
        for u in c:
            last_use[u] = max(last_use[u], t)
            for v in units[u].inputs:
                last_use[v] = max(last_use[v], t)

    # -- columns -----------------------------------------------------------------------
    keep = np.arange(n_u)
    col = n_u
    r_index: dict[tuple[int, int], int] = {}
    s_index: dict[tuple[int, int], int] = {}
    for t, c in enumerate(cand):
        for u in c:
            recomputable = units[u].recomputable
            if allow_recompute and recomputable and u not in optional_of:
                r_index[t, u] = col
                col += 1
            s_index[t, u] = col
            col += 1
    # choice k: on_k (the variant runs) and off_k (the aten op it replaced), one of them
    on_col = np.arange(col, col + len(problem.choices), dtype=int)
    off_col = on_col + len(problem.choices)
    col += 2 * len(problem.choices)
    # algorithm choice k: one column per option of each direction; a recomputation of
    # its unit is split by the forward option it runs (r = sum of those columns)
    fwd_cols, bwd_cols = [], []
    for a in problem.algorithms:
        fwd_cols.append(np.arange(col, col + len(a.forward)))
        col += len(a.forward)
        bwd_cols.append(np.arange(col, col + len(a.backward)))
        col += len(a.backward)
    algorithm_of = {a.unit: k for k, a in enumerate(problem.algorithms)}
    rec_alg: dict[tuple[int, int], np.ndarray] = {}
    for t, u in r_index:
        if u in algorithm_of:
            n_opts = len(problem.algorithms[algorithm_of[u]].forward)
            rec_alg[t, u] = np.arange(col, col + n_opts)
            col += n_opts
    n_bool = col
    # continuous: y_k (forward kept bytes of units already consumed), z_t (kept, pinned),
    # b_t (what stage t starts with: z_t plus the candidates carried into it), and q
    # (bytes recomputed so far in a stage, a running sum at the points a row reads it)
    exact = allow_recompute and (depth is None if frees is None else frees)
    order, prefix_end, breaks = _recompute_order(
        problem, cand, r_index, rec_alg, algorithm_of, every=exact
    )
    y0, z0, b0 = 0, n_u, n_u + n_t
    q_col: dict[tuple[int, int], int] = {}  # (stage, position in its order) -> column
    n_cont = n_u + 2 * n_t
    for t in range(n_t):
        for pos in breaks[t]:
            q_col[t, pos] = n_cont
            n_cont += 1
    # Full formulation: free[t, i, k] <= 1 when input i goes after reader k (the solver
    # sets it, within the rows below); freed_col[t, e] = bytes freed by the stage's
    # first e + 1 free events (FreePlan), a running sum.
    free_plans = _free_plans(problem, cand, order) if exact else None
    free_col: dict[tuple[int, int, int], int] = {}
    freed_col: dict[tuple[int, int], int] = {}
    for t, plan in enumerate(free_plans or ()):
        for k, inputs in plan.readers:
            for i in inputs:
                free_col[t, i, k] = n_cont
                n_cont += 1
        for e in range(plan.n_events):
            freed_col[t, e] = n_cont
            n_cont += 1

    rows_b: list[tuple[int, int, float]] = []
    rows_c: list[tuple[int, int, float]] = []
    rhs: list[float] = []
    is_eq: list[bool] = []
    budget_rows: list[int] = []
    budget_const: list[float] = []

    def row(bool_terms, cont_terms, value, eq=False, budget_const_mib=None):
        r = len(rhs)
        rows_b.extend((r, j, a) for j, a in bool_terms)
        rows_c.extend((r, j, a) for j, a in cont_terms)
        rhs.append(value)
        is_eq.append(eq)
        if budget_const_mib is not None:
            budget_rows.append(r)
            budget_const.append(budget_const_mib)

    m = [u.bytes / MIB for u in units]
    const = problem.constant_bytes / MIB

    # -- forward pass: memory while unit k runs ------------------------------------------
    # live(k) = sum_{u<=k, lastfwd(u)>=k} m_u + y_k, y_k = sum_{lastfwd(u)<k} m_u keep_u
    consumed_at: list[list[int]] = [[] for _ in range(n_u)]
    diff = np.zeros(n_u + 1)
    optional_at: list[list[tuple[int, float]]] = [[] for _ in range(n_u)]
    for u in units:
        consumed_at[u.last_forward_use].append(u.id)
        if u.id in optional_of:
            for k in range(u.id, u.last_forward_use + 1):
                optional_at[k].append((on_col[optional_of[u.id]], m[u.id]))
            continue
        diff[u.id] += m[u.id]
        diff[u.last_forward_use + 1] -= m[u.id]
    still_needed = np.cumsum(diff)[:n_u]
    row([], [(y0, 1.0)], 0.0, eq=True)
    for k in range(1, n_u):
        row(
            [(keep[u], -m[u]) for u in consumed_at[k - 1]],
            [(y0 + k, 1.0), (y0 + k - 1, -1.0)],
            0.0,
            eq=True,
        )
    for k in range(n_u):
        extra = const + still_needed[k] + problem.forward_extra[k] / MIB
        row(optional_at[k], [(y0 + k, 1.0)], 0.0, budget_const_mib=extra)
    for k, a in enumerate(problem.algorithms):  # the convolution itself, with its workspace
        u = a.unit
        row(
            optional_at[u] + [(j, o[2] / MIB) for j, o in zip(fwd_cols[k], a.forward, strict=True)],
            [(y0 + u, 1.0)],
            0.0,
            budget_const_mib=const + still_needed[u] + a.forward_live / MIB,
        )

    # -- backward stages -----------------------------------------------------------------
    # z_t = sum_{u: last_use(u) >= t} m_u keep_u, built as a running sum from the end.
    ends_at: list[list[int]] = [[] for _ in range(n_t)]
    for u in range(n_u):
        if last_use[u] >= 0:
            ends_at[last_use[u]].append(u)
    for t in reversed(range(n_t)):
        terms_c = [(z0 + t, 1.0)] + ([(z0 + t + 1, -1.0)] if t + 1 < n_t else [])
        row([(keep[u], -m[u]) for u in ends_at[t]], terms_c, 0.0, eq=True)

    def present(t, u):  # P[t,u] as terms, for u in C(t)
        terms = [(s_index[t, u], 1.0)]
        if (t, u) in r_index:
            terms.append((r_index[t, u], 1.0))
        return terms

    side = [u.side_bytes / MIB for u in units]
    choice_needs = _choice_needs(problem)

    def frees_of(t):
        """The full formulation's frees in stage t: writes their rows, and returns a
        function giving, for position p of the run order (None: after the last one), the
        term subtracting what was freed before that unit begins."""
        if free_plans is None:
            return lambda p: []
        plan = free_plans[t]
        readers_of: dict[int, list[int]] = {}
        for k, inputs in plan.readers:
            for i in inputs:
                readers_of.setdefault(i, []).append(k)
        end = {k: units[k].span[1] for k, _ in plan.readers}
        at_event: list[list[tuple[int, float]]] = [[] for _ in range(plan.n_events)]
        for (i, k), e in plan.event.items():
            at_event[e].append((free_col[t, i, k], -m[i]))
        for e, terms in enumerate(at_event):
            chain = [(freed_col[t, e], 1.0)] + ([(freed_col[t, e - 1], -1.0)] if e else [])
            row([], chain + terms, 0.0, eq=True)
        for k, inputs in plan.readers:
            for i in inputs:
                j = free_col[t, i, k]
                row([(r_index[t, k], -1.0)], [(j, 1.0)], 0.0)  # only after k has run
                for later in readers_of[i]:  # and no reader of i ends after k
                    if end[later] > end[k]:
                        row([(r_index[t, later], 1.0)], [(j, 1.0)], 1.0)
                if (t + 1, i) in s_index:  # not carried on to the next stage
                    row([(s_index[t + 1, i], 1.0)], [(j, 1.0)], 1.0)
                elif last_use[i] > t:  # a kept unit a later stage may read stays
                    row([(keep[i], 1.0)], [(j, 1.0)], 1.0)

        def freed(p):
            n = plan.n_events if p is None else plan.before[p]
            return [(freed_col[t, n - 1], -1.0)] if n else []

        return freed

    def backward_terms(t, read):
        """m_u (Q[t,u] - keep_u) for the candidates of stage t, at a backward op that
        (or whose successors in the stage) reads `read`; plus recomputed side outputs."""
        terms = []
        for u in cand[t]:
            if (t, u) in r_index:
                terms.append((r_index[t, u], side[u]))
            if u in read:  # present
                terms += [(s_index[t, u], m[u]), (keep[u], -m[u])]
                if (t, u) in r_index:
                    terms.append((r_index[t, u], m[u]))
            elif t + 1 < n_t and u in cand_sets[t + 1]:  # carried on
                terms += [(s_index[t + 1, u], m[u]), (keep[u], -m[u])]
            elif last_use[u] == t:  # no later stage can read it: dead
                terms.append((keep[u], -m[u]))
        return terms

    for t, stage in enumerate(stages):
        c = cand[t]
        # b_t: what the stage starts with, z_t plus the candidates carried into it
        start_terms = []
        for u in c:
            start_terms += [(s_index[t, u], -m[u]), (keep[u], m[u])]
        row(start_terms, [(b0 + t, 1.0), (z0 + t, -1.0)], 0.0, eq=True)
        # Recomputation runs in forward order; while unit u runs, the stage holds what it
        # started with, the units recomputed so far (q: those that began before u ends),
        # and u's workspace. A recomputation also rewrites the unit's side outputs.
        pos_prev, q_prev = -1, None
        for pos in breaks[t]:
            seg = [(r_index[t, u], -(m[u] + side[u])) for u in order[t][pos_prev + 1 : pos + 1]]
            cont = [(q_col[t, pos], 1.0)] + ([(q_prev, -1.0)] if q_prev is not None else [])
            row(seg, cont, 0.0, eq=True)
            pos_prev, q_prev = pos, q_col[t, pos]
        at_start = const + stage.start_bytes / MIB
        freed = frees_of(t)
        end = [(q_prev, 1.0)] if q_prev is not None else []
        row([], [(b0 + t, 1.0)] + end + freed(None), 0.0, budget_const_mib=at_start)
        for i, u in enumerate(order[t]):
            if prefix_end[t][i] < 0:
                continue  # no workspace: the row after the last recomputation covers it
            q_here = [(q_col[t, prefix_end[t][i]], 1.0), (b0 + t, 1.0)] + freed(i)
            if units[u].workspace_bytes or exact:  # full: memory falls, a row at each
                ws = units[u].workspace_bytes / MIB
                row([(r_index[t, u], ws)], q_here, 0.0, budget_const_mib=at_start)
            if (t, u) in rec_alg:  # the convolution's workspace, by the option it runs
                options = problem.algorithms[algorithm_of[u]].forward
                ws_terms = [(j, o[2] / MIB) for j, o in zip(rec_alg[t, u], options, strict=True)]
                if any(a for _, a in ws_terms):
                    row(ws_terms, q_here, 0.0, budget_const_mib=at_start)
        # At the stage's backward ops: kept units (z_t), the units read from this op on,
        # and those carried on to the next stage or possibly read later. A unit
        # recomputed only as the input of another was freed after its last reader, before
        # the backward ops; a saved value, after its last reader in the stage.
        for _, at_op, reads in _op_runs(stage, choice_needs[t]):
            op_terms = backward_terms(t, set(reads))
            row(op_terms, [(z0 + t, 1.0)], 0.0, budget_const_mib=const + at_op / MIB)
        for k, a in enumerate(problem.algorithms):  # a convolution's backward in this stage
            if a.stage == t and a.backward:
                # what the stage reads from its op on (VGG-16 at 176: counting all the
                # stage reads held a dead 2.1 GB ReLU output at the first convolution's
                # backward, and the smallest budget with algorithm choices was 13.762 GB,
                # above the store-all peak)
                terms = backward_terms(t, set(_reads_from(stage, a.backward_op, choice_needs[t])))
                ws = [(j, o[2] / MIB) for j, o in zip(bwd_cols[k], a.backward, strict=True)]
                at_op = const + a.backward_live / MIB
                row(terms + ws, [(z0 + t, 1.0)], 0.0, budget_const_mib=at_op)
        for u in stage.need:
            row([(j, -a) for j, a in present(t, u)], [], -1.0)  # P >= 1
        for u in c:
            # A kept unit stays, as itself, until its last possible use: once freed, it
            # could only come back by recomputation, never as the "pinned" kept value; and
            # recomputing it while kept would hold a second copy the rows do not count
            # (a min-memory solve, indifferent to time, once left R = 1 on kept units).
            row([(keep[u], 1.0), (s_index[t, u], -1.0)], [], 0.0)  # keep <= S
            if (t, u) in r_index:
                row(present(t, u), [], 1.0)  # S + R <= 1
                for v in units[u].inputs:  # recompute needs its inputs
                    if v in cand_sets[t]:
                        row([(r_index[t, u], 1.0)] + [(j, -a) for j, a in present(t, v)], [], 0.0)
                    else:
                        row([(r_index[t, u], 1.0), (keep[v], -1.0)], [], 0.0)
            # S[t,u] only from what was there before
            if t > 0 and u in cand_sets[t - 1]:
                row([(s_index[t, u], 1.0)] + [(j, -a) for j, a in present(t - 1, u)], [], 0.0)
            else:
                row([(s_index[t, u], 1.0), (keep[u], -1.0)], [], 0.0)

    for k, c in enumerate(problem.choices):
        row([(on_col[k], 1.0), (off_col[k], 1.0)], [], 1.0, eq=True)
        for u in c.optional_units:
            row([(keep[u], 1.0), (on_col[k], -1.0)], [], 0.0)  # kept only if it exists
        for units_needed, chosen in ((c.on_units, on_col[k]), (c.off_units, off_col[k])):
            for u in units_needed:  # P[t,u] >= the option that reads it
                row([(j, -a) for j, a in present(c.stage, u)] + [(chosen, 1.0)], [], 0.0)

    for k, a in enumerate(problem.algorithms):
        row([(j, 1.0) for j in fwd_cols[k]], [], 1.0, eq=True)
        if a.backward:
            row([(j, 1.0) for j in bwd_cols[k]], [], 1.0, eq=True)
    for (t, u), cols in rec_alg.items():
        row([(r_index[t, u], -1.0)] + [(j, 1.0) for j in cols], [], 0.0, eq=True)
        for j, option_col in zip(cols, fwd_cols[algorithm_of[u]], strict=True):
            row([(j, 1.0), (option_col, -1.0)], [], 0.0)  # recomputed with the option chosen

    cost = np.zeros(n_bool)
    for (_t, u), j in r_index.items():
        cost[j] = units[u].recompute_s / MS
    for k, a in enumerate(problem.algorithms):  # above the fastest option: never negative
        fastest = min(o[1] for o in a.forward)
        cost[fwd_cols[k]] = [(o[1] - fastest) / MS for o in a.forward]
        if a.backward:
            fastest_bwd = min(o[1] for o in a.backward)
            cost[bwd_cols[k]] = [(o[1] - fastest_bwd) / MS for o in a.backward]
    for (t, u), cols in rec_alg.items():
        a = problem.algorithms[algorithm_of[u]]
        fastest = min(o[1] for o in a.forward)
        # the unit's profiled recomputation ran PyTorch's choice: swap its time for the
        # fastest option's, and the option chosen adds its excess
        cost[r_index[t, u]] = max(0.0, units[u].recompute_s - a.forward_default_s + fastest) / MS
        cost[cols] = [(o[1] - fastest) / MS for o in a.forward]
    for k, c in enumerate(problem.choices):  # above the cheaper option: never negative
        base = min(c.on_s, c.off_s)
        cost[on_col[k]] = (c.on_s - base) / MS
        cost[off_col[k]] = (c.off_s - base) / MS

    n_rows = len(rhs)

    def matrix(entries, n_cols):
        if not entries:
            return sp.csr_matrix((n_rows, n_cols))
        r, cidx, v = zip(*entries, strict=True)
        return sp.csr_matrix((v, (r, cidx)), shape=(n_rows, n_cols))

    f = Formulation(
        problem=problem,
        depth=depth,
        cand=cand,
        last_use=last_use,
        n_bool=n_bool,
        n_cont=n_cont,
        keep=keep,
        r_index=r_index,
        s_index=s_index,
        on_col=on_col,
        off_col=off_col,
        cost=cost,
        a_bool=matrix(rows_b, n_bool),
        a_cont=matrix(rows_c, n_cont),
        rhs=np.array(rhs),
        is_eq=np.array(is_eq),
        budget_rows=np.array(budget_rows, dtype=int),
        budget_const=np.array(budget_const),
        fwd_cols=fwd_cols,
        bwd_cols=bwd_cols,
        rec_alg=rec_alg,
        algorithm_of=algorithm_of,
        recompute_order=order,
        prefix_end=prefix_end,
        free_plans=free_plans,
        free_columns=np.array(sorted(free_col.values()), dtype=int),
    )
    f.stats = {
        "variables": n_bool + n_cont,
        "binaries": n_bool,
        "constraints": n_rows,
        "nonzeros": int(f.a_bool.nnz + f.a_cont.nnz),
    }
    return f


def _rhs_for(f: Formulation, budget_bytes: float | None) -> np.ndarray:
    """Right-hand sides; with no budget, the budget rows keep only their constants
    (the budget then is a variable, on the left)."""
    rhs = f.rhs.copy()
    rhs[f.budget_rows] = (budget_bytes or 0) / MIB - f.budget_const
    return rhs


def _budget_column(f: Formulation) -> np.ndarray:
    """The budget's column when it is minimized (a variable on the left of the budget
    rows, see `_rhs_for`): -1 on those rows."""
    column = np.zeros(f.n_rows)
    column[f.budget_rows] = -1.0
    return column


def lean_choices(f: Formulation) -> tuple[np.ndarray, np.ndarray]:
    """(columns, values) that fix every choice to its leaner option: each variant site
    on, each convolution's least-workspace algorithms."""
    cols = [f.on_col, f.off_col]
    values = [np.ones(len(f.on_col)), np.zeros(len(f.off_col))]
    for k, a in enumerate(f.problem.algorithms):
        for options, columns in ((a.forward, f.fwd_cols[k]), (a.backward, f.bwd_cols[k])):
            if len(options):
                lean = min(range(len(options)), key=lambda i: options[i][2])
                cols.append(columns)
                values.append((np.arange(len(options)) == lean).astype(float))
    return np.concatenate(cols).astype(int), np.concatenate(values)
