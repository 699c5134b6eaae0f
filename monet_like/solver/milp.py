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

import os
import re
import signal
import tempfile
import threading
import time
import warnings
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import scipy.sparse as sp

from monet_like.errors import UserError
from monet_like.memory import captured, silenced
from monet_like.solver.problem import Problem
from monet_like.solver.race import available_cores, race
from monet_like.units import GIB

MIB = float(2**20)  # bytes are scaled to MiB inside the matrix: better conditioned
MS = 1e-3  # times scaled to milliseconds
_NUMBER = r"([-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"  # a number in a solver's log
STARTABLE = ("HIGHS", "PULP")  # take a start schedule (cylp's CBC interface has no MIP start)


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


@dataclass
class RawResult:
    # "optimal", "feasible" (stopped with a schedule), "infeasible", "error", or "cutoff"
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


def solved_relaxation(f: Formulation, budget_bytes: float, time_limit: float = 60.0):
    """The LP relaxation at `budget_bytes` (least recomputation) as a highspy model, run
    for at most `time_limit` seconds, and whether it reached its optimum."""
    import highspy

    h = _highs_model(f, _rhs_for(f, budget_bytes), False)
    h.setOptionValue("solve_relaxation", True)
    h.setOptionValue("time_limit", float(time_limit))
    h.run()
    return h, h.getModelStatus() == highspy.HighsModelStatus.kOptimal


def relaxation(f: Formulation, budget_bytes: float, time_limit: float = 60.0) -> np.ndarray | None:
    """The binary columns' values in the LP relaxation at `budget_bytes` (least
    recomputation), or None when even the relaxation is infeasible (or not solved
    within `time_limit` seconds)."""
    h, solved = solved_relaxation(f, budget_bytes, time_limit)
    return np.asarray(h.getSolution().col_value[: f.n_bool]) if solved else None


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

    status: str  # "optimal", "feasible", "infeasible", "error"
    x: np.ndarray | None
    objective: float  # HiGHS's objective and dual bound, in the model's own units
    bound: float
    message: str
    first_s: float | None  # when it found its first schedule
    seed: int


# Racing a second search only pays on problems that take seconds or more:
# ResNet-50 (184) has 9,936 binaries, ResNet-18 at 64 px 1,963 (the test suite's
# GoogLeNet at 64 px, 13,939, and DenseNet at depth 2, 5,558, race).
RACE_MIN_BINARIES = 4000


def race_workers(f: Formulation) -> int:
    """How many HiGHS or CBC searches to race on `f` (see race.py): one per core, up to
    two, on a large problem; one otherwise."""
    return min(2, available_cores()) if f.n_bool >= RACE_MIN_BINARIES else 1


def _highs_search(
    f, rhs, time_limit, gap, verbose, minimize_budget, start, pins, seed, progress, stop
) -> _HighsOutcome:
    """One HiGHS search with random seed `seed`; `stop()` (polled) interrupts it."""
    import highspy

    h = _highs_model(f, rhs, minimize_budget, pins=pins)
    h.setOptionValue("output_flag", bool(verbose) and seed == 0)
    h.setOptionValue("mip_rel_gap", float(gap))
    h.setOptionValue("random_seed", seed)
    if time_limit:
        h.setOptionValue("time_limit", float(time_limit))
    n_b = f.n_bool
    if start is not None:
        h.setSolution(n_b, np.arange(n_b, dtype=np.int32), start.astype(np.float64))

    first, shown = [None], [None]
    started = time.perf_counter()

    def improved(event) -> None:
        out = event.data_out
        if first[0] is None:
            first[0] = time.perf_counter() - started
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
            f"[{out.running_time:6.1f} s] schedule with {out.objective_function_value * MS:.3f}"
            f" s of recomputation"
            + (f"; bound {bound * MS:.3f} s, gap {out.mip_gap:.2%}" if known else "")
        )

    h.cbMipImprovingSolution.subscribe(improved)
    if stop is not None:
        h.cbMipInterrupt.subscribe(lambda event: event.interrupt() if stop() else None)
    h.run()
    model_status = h.getModelStatus()
    message = h.modelStatusToString(model_status)
    info = h.getInfo()
    if model_status == highspy.HighsModelStatus.kInfeasible:
        return _HighsOutcome("infeasible", None, np.inf, np.inf, message, first[0], seed)
    if info.primal_solution_status != 2:  # no feasible point
        return _HighsOutcome("error", None, np.inf, info.mip_dual_bound, message, first[0], seed)
    x_val = np.round(np.asarray(h.getSolution().col_value[:n_b])).astype(int)
    status = "optimal" if model_status == highspy.HighsModelStatus.kOptimal else "feasible"
    return _HighsOutcome(
        status, x_val, info.objective_function_value, info.mip_dual_bound, message, first[0],
        seed,
    )  # fmt: skip


def _solve_highs(
    f, rhs, time_limit, gap, verbose, minimize_budget, start, progress, pins=None, workers=1
):
    """HiGHS through highspy (cvxpy's interface takes no start and reports no progress),
    `workers` searches raced with different seeds: the first to finish wins; stopped by
    the time limit, the best schedule and the best bound of all count."""

    def run(seed, stop):
        return _highs_search(
            f, rhs, time_limit, gap, verbose, minimize_budget, start, pins, seed,
            progress if seed == 0 else None, stop,
        )  # fmt: skip

    outcomes = race(run, workers, lambda o: o.status in ("optimal", "infeasible"))
    if any(o.status == "infeasible" for o in outcomes):
        return RawResult("infeasible", None, None, None, None, 0.0, "HIGHS")
    found = [o for o in outcomes if o.x is not None]
    if not found:
        return RawResult("error", None, None, None, None, 0.0, "HIGHS", outcomes[0].message)
    best = min(found, key=lambda o: o.objective)
    bounds = [o.bound for o in outcomes if np.isfinite(o.bound)]
    bound = max(bounds) if bounds else None  # each search's bound holds: the best counts
    if progress is not None and best.seed != 0:
        progress(f"the search with random seed {best.seed}, raced on another core, won")
    proved = any(o.status == "optimal" for o in found)  # best is at most that one's
    res = _finish(
        f, best.x, "optimal" if proved else "feasible", bound,
        relative_gap(best.objective, bound), gap, "HIGHS", minimize_budget,
    )  # fmt: skip
    firsts = [o.first_s for o in outcomes if o.first_s is not None]
    res.first_feasible_s = min(firsts) if firsts else None
    return res


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
    out, as (matrix over `x`, right-hand sides, which rows are equalities); None unless
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
    return a, b, is_eq[rest]


def _cbc_matrix(f, rhs, minimize_budget):
    """The rows CBC gets, over [binaries, free columns (full formulation), budget (when
    minimizing it)]: the running sums substituted out (`eliminate_sums`) where they can
    be; as (matrix, right-hand sides, equality rows, number of continuous columns)."""
    sums = np.setdiff1d(np.arange(f.n_cont), f.free_columns)
    a_c = f.a_cont.tocsc()
    kept = [f.a_bool, a_c[:, f.free_columns]]
    if minimize_budget:
        kept.append(sp.csr_matrix(_budget_column(f)[:, None]))
    a_kept = sp.hstack(kept).tocsr()
    reduced = eliminate_sums(a_kept, a_c[:, sums], rhs, f.is_eq)
    if reduced is None:  # as built: every continuous column stays
        kept = [f.a_bool, a_c] + kept[2:]
        return sp.hstack(kept).tocsr(), rhs, f.is_eq, f.n_cont
    a, b, is_eq = reduced
    return a, b, is_eq, len(f.free_columns)


def _cbc_rows(f, rhs, minimize_budget):
    """`_cbc_matrix`'s rows, kept on `f` for its last right-hand sides: the window
    searches solve one budget's problem many times with other columns pinned, and
    substituting the sums out takes seconds on a large model (6 s on ResNet-50)."""
    key = (rhs.tobytes(), bool(minimize_budget))
    cached = f.cache.get("cbc_rows")
    if cached is None or cached[0] != key:
        cached = (key, _cbc_matrix(f, rhs, minimize_budget))
        f.cache["cbc_rows"] = cached
    return cached[1]


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

    a, rhs, is_eq, n_cont = rows
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
        bound = min(bound, float(f.cost @ x_val) * (1 - gap))
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

    deadline = None if not time_limit else time.perf_counter() + time_limit
    outcomes = race(run, workers, lambda r: r.status in CBC_FINISHED, False, deadline)
    return merge_cbc_outcomes(outcomes, gap)


CBC_FINISHED = ("optimal", "infeasible", "cutoff")  # a raced CBC search that ends the race


def merge_cbc_outcomes(outcomes: list[RawResult], gap: float, solve_time_s: float = 0.0):
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
    proved = any(r.status == "optimal" for r in found)  # best is at most that one's
    gap_value = relative_gap(best.objective, bound)
    if proved and gap_value is None:
        gap_value = gap
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
    for seed 0): column j of the result is column order[j] of `f`."""
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
    return g, rhs[rows], pins, order


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
    rows = _cbc_rows(f, rhs, minimize_budget)  # each re-solve below reuses them
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
        proven = relative_gap(objective, lower)
        remaining = None if not time_limit else time_limit - (time.perf_counter() - started)
        if (proven is not None and proven <= gap) or (remaining is not None and remaining < 1):
            break
        cutoff = objective * (1 - gap)
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
    proven = gap_value is not None and gap_value <= gap * (1 + 1e-9)
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
        opts = {"MIPGap": gap}
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


def _solve_pulp(f, rhs, time_limit, gap, verbose, start, progress, threads) -> RawResult:
    with warnings.catch_warnings():  # PuLP 3 warns about its own 4.0 API change
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve_pulp_quiet(f, rhs, time_limit, gap, verbose, start, progress, threads)


# Cbc0004I (branch and bound), Cbc0012I (a heuristic), Cbc0016I (strong branching),
# Cbc0024I (a subtree): each a new schedule.
_CBC_SCHEDULE = re.compile(
    rf"Cbc00\d\dI Integer solution of {_NUMBER} found.*?\({_NUMBER} seconds\)"
)
_CBC_POSSIBLE = re.compile(rf"best possible {_NUMBER}")


class _CbcLogWatch:
    """Follows the log that PuLP's CBC writes while it runs, for progress lines
    (CBC's binary runs in a child process PuLP waits on)."""

    def __init__(self, path: str, progress: Callable[[str], None] | None) -> None:
        self.path, self.progress = path, progress
        self.first_s: float | None = None  # CBC's clock at its first schedule
        self._best, self._bound, self._done = np.inf, None, threading.Event()
        self._text: list[str] = []  # the log as read
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not os.path.exists(self.path) and not self._done.wait(0.2):
            pass
        if not os.path.exists(self.path):
            return
        with open(self.path) as log:
            pending = ""
            while True:
                finished = self._done.wait(0.5)  # then one last read of what CBC wrote
                chunk = log.read()
                self._text.append(chunk)
                pending += chunk
                *lines, pending = pending.split("\n")
                for line in lines + ([pending] if finished else []):
                    self._line(line)
                if finished:
                    return

    def _line(self, line: str) -> None:
        if found := _CBC_POSSIBLE.search(line):
            self._bound = float(found.group(1))
        if (found := _CBC_SCHEDULE.search(line)) is None:
            return
        objective, at = float(found.group(1)), float(found.group(2))
        if self.first_s is None:
            self.first_s = at
        self.show(objective, at)

    def show(self, objective: float, at: float | None) -> None:
        """A progress line for a schedule costing `objective` (ms), if it is a better one."""
        if objective >= self._best - 1e-9:
            return
        self._best = objective
        if self.progress is not None:
            gap = relative_gap(objective, self._bound)
            self.progress(
                ("[   end  ]" if at is None else f"[{at:6.1f} s]")
                + f" schedule with {objective * MS:.3f} s of recomputation"
                + ("" if gap is None else f"; bound {self._bound * MS:.3f} s, gap {gap:.2%}")
            )

    def close(self) -> str:
        """Stop following; the whole log."""
        self._done.set()
        self._thread.join()
        return "".join(self._text)


def _pulp_bound(log: str, proved: bool, objective_ms: float, gap: float) -> float | None:
    """The bound (ms) that CBC's log proves: its summary's lower bound, only the one
    shown before a restart where it restarted (see _cbc_run); for a finished search
    without a restart, its schedule less the tolerance it pruned with."""
    if "Cbc0044I" in log:
        return _cbc_bound_before_restart(log)
    if proved:
        return objective_ms * (1 - gap)
    found = re.findall(rf"Lower bound:\s+{_NUMBER}", log)
    return _least_printed_as(found[-1]) if found else _cbc_bound_before_restart(log)


def _least_printed_as(printed: str) -> float:
    """The least value that rounds to `printed`: CBC's summary prints its bound to a few
    digits ("Lower bound: 2.861" for a bound of 2.86055 ms), which can put it above the
    optimum."""
    mantissa, _, exponent = printed.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return float(printed) - 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def _solve_pulp_quiet(f, rhs, time_limit, gap, verbose, start, progress, threads) -> RawResult:
    """The formulation written row by row into PuLP and solved by its bundled CBC
    binary: unlike CBC through cylp, it takes a start (-mipstart) and runs its search on
    `threads` threads; its bound and its schedules are read from CBC's log."""
    import pulp

    prob = pulp.LpProblem("monet_like", pulp.LpMinimize)
    xb = [pulp.LpVariable(f"x{j}", cat="Binary") for j in range(f.n_bool)]
    yc = [pulp.LpVariable(f"y{j}") for j in range(f.n_cont)]
    prob += pulp.lpSum(float(c) * xb[j] for j, c in enumerate(f.cost) if c)
    a_b, a_c = f.a_bool.tocsr(), f.a_cont.tocsr()

    def terms(a, variables, r):
        lo, hi = a.indptr[r], a.indptr[r + 1]
        return [(variables[j], v) for j, v in zip(a.indices[lo:hi], a.data[lo:hi], strict=True)]

    for r in range(f.n_rows):
        lhs = terms(a_b, xb, r) + terms(a_c, yc, r)
        expr = pulp.LpAffineExpression(lhs)
        prob += (expr == rhs[r]) if f.is_eq[r] else (expr <= rhs[r])
    if start is not None:  # CBC's -mipstart: it completes the continuous columns itself
        for v, value in zip(xb, start, strict=True):
            v.setInitialValue(int(value))
    with tempfile.TemporaryDirectory(prefix="monet_like_cbc_") as folder:
        log_path = os.path.join(folder, "cbc.log")
        cmd = pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit, gapRel=gap, warmStart=start is not None,
            threads=threads if threads > 1 else None, logPath=log_path,
        )  # fmt: skip
        watch = _CbcLogWatch(log_path, progress)
        try:
            prob.solve(cmd)
        finally:
            log = watch.close()
    if verbose:
        print(log, end="", flush=True)
    status = pulp.LpStatus[prob.status]
    if status == "Infeasible":
        return RawResult("infeasible", None, None, None, None, 0.0, "PULP")
    # Stopped without a schedule, CBC still writes a point (the relaxation's): not one.
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        message = f"no schedule found (CBC status {status}, solution status {prob.sol_status})"
        if time_limit:
            message += f" within the time limit of {time_limit:g} s: give it more time or use HIGHS"
        return RawResult("error", None, None, None, None, 0.0, "PULP", message)
    # PuLP reads back every column it wrote (0 where CBC's file omits it), and writes none
    # that is in no row and costs nothing: any value fits such a column, 0 is taken.
    x_val = np.array([round(v.varValue or 0) for v in xb], dtype=int)
    objective_ms = float(f.cost @ x_val)
    finished = prob.sol_status == pulp.LpSolutionOptimal and "Cbc0044I" not in log
    bound = _pulp_bound(log, finished, objective_ms, gap)
    gap_value = relative_gap(objective_ms, bound)
    proved = finished or (gap_value is not None and gap_value <= gap * (1 + 1e-9))
    res = _finish(f, x_val, "optimal" if proved else "feasible", bound, gap_value, gap, "PULP",
                  False)  # fmt: skip
    res.first_feasible_s = watch.first_s
    # A schedule CBC found without a line this watch knows (or wrapped over two) is
    # still shown: the one returned.
    watch.show(objective_ms, None)
    return res


@dataclass(frozen=True)
class _StageColumns:
    """Column indices of one stage's candidates, for vectorized evaluation."""

    units: np.ndarray
    s_cols: np.ndarray
    r_cols: np.ndarray  # -1 where the unit cannot be recomputed
    next_s_cols: np.ndarray  # S of the next stage, -1 where it is no candidate there
    dead: np.ndarray  # no later stage can read it
    by_op: list[tuple[int, np.ndarray]]  # (backward-only bytes, read from there on)
    conv_reads: list[tuple[int, np.ndarray]]  # (algorithm, read from its backward op on)
    order: np.ndarray  # positions (in `units`) of the recomputable ones, in run order
    prefix_end: np.ndarray  # per entry of `order`: what has begun when it ends (-1: no row)


def _stage_columns(f: Formulation) -> list[_StageColumns]:
    if f.columns is not None:
        return f.columns
    p = f.problem
    choice_needs = _choice_needs(p)
    columns = []
    for t, c in enumerate(f.cand):
        stage = p.stages[t]
        position = {u: i for i, u in enumerate(c)}
        columns.append(
            _StageColumns(
                units=np.array(c, dtype=int),
                s_cols=np.array([f.s_index[t, u] for u in c], dtype=int),
                r_cols=np.array([f.r_index.get((t, u), -1) for u in c], dtype=int),
                next_s_cols=np.array([f.s_index.get((t + 1, u), -1) for u in c], dtype=int),
                dead=np.array([f.last_use[u] == t for u in c], dtype=bool),
                by_op=[
                    (at_op, np.isin(c, reads))
                    for _, at_op, reads in _op_runs(stage, choice_needs[t])
                ],
                conv_reads=[
                    (k, np.isin(c, _reads_from(stage, a.backward_op, choice_needs[t])))
                    for k, a in enumerate(p.algorithms)
                    if a.stage == t and a.backward
                ],
                order=np.array([position[u] for u in f.recompute_order[t]], dtype=int),
                prefix_end=np.array(f.prefix_end[t], dtype=int),
            )
        )
    f.columns = columns
    return columns


def _freed_bytes(f: Formulation, t: int, x: np.ndarray, keep: np.ndarray) -> list[int]:
    """Full formulation: bytes freed in stage t by its first e free events (FreePlan),
    e = 0, 1, ...: each input goes after its last recomputed reader, unless the
    backward ops read it, it is carried on, or it is kept for a later stage."""
    if f.free_plans is None:
        return [0]
    units = f.problem.units
    plan = f.free_plans[t]
    last_reader: dict[int, int] = {}  # input -> its last recomputed reader
    for k, inputs in plan.readers:  # in the order they end
        if x[f.r_index[t, k]]:
            for i in inputs:
                last_reader[i] = k
    freed = [0] * (plan.n_events + 1)
    for i, k in last_reader.items():
        if (t + 1, i) in f.s_index:
            stays = bool(x[f.s_index[t + 1, i]])
        else:
            stays = f.last_use[i] > t and bool(keep[i])
        if not stays:
            freed[plan.event[i, k] + 1] += units[i].bytes
    return [int(v) for v in np.cumsum(freed)]


def evaluate(f: Formulation, x_bool: np.ndarray) -> dict:
    """Exact bytes of a 0/1 assignment under the model: peak and where it is reached."""
    p = f.problem
    units = p.units
    n_u = len(units)
    m = np.array([u.bytes for u in units], dtype=np.int64)
    side = np.array([u.side_bytes for u in units], dtype=np.int64)
    unit_ws = np.array([u.workspace_bytes for u in units], dtype=np.int64)
    keep = np.asarray(x_bool)[f.keep].astype(bool)
    last_fwd = np.array([u.last_forward_use for u in units], dtype=int)
    # forward unit k: units produced by k and still to be read in the forward pass, plus
    # the kept ones already consumed
    exists = np.ones(n_u, dtype=np.int64)  # a variant's own output: only if it is chosen
    for k, c in enumerate(p.choices):
        exists[list(c.optional_units)] = int(np.asarray(x_bool)[f.on_col[k]])
    span = np.zeros(n_u + 1, dtype=np.int64)
    np.add.at(span, np.arange(n_u), m * exists)
    np.add.at(span, last_fwd + 1, -m * exists)
    alive = np.cumsum(span)[:n_u]
    consumed_kept = np.concatenate(
        ([0], np.cumsum(np.bincount(last_fwd, weights=m * keep, minlength=n_u))[:-1])
    ).astype(np.int64)
    forward = p.constant_bytes + np.array(p.forward_extra, dtype=np.int64) + alive + consumed_kept
    x = np.asarray(x_bool)
    chosen = f.chosen_options(x)
    for a, (i, _) in zip(p.algorithms, chosen, strict=True):  # with its option's workspace
        u = a.unit
        at_conv = p.constant_bytes + a.forward_live + a.forward[i][2] + alive[u] + consumed_kept[u]
        forward[u] = max(forward[u], at_conv)
    k = int(np.argmax(forward))
    peak, where = int(forward[k]), f"forward unit {k}"
    # backward stage t: kept units alive until their last possible use, and the
    # candidates present (carried or recomputed)
    last_use = np.array(f.last_use, dtype=int)
    in_backward = last_use >= 0
    kept_until = np.bincount(
        last_use[in_backward], weights=(m * keep)[in_backward], minlength=len(p.stages)
    )
    z = np.cumsum(kept_until[::-1])[::-1]
    rec_ws: dict[tuple[int, int], int] = {}  # (stage, unit) -> workspace of the option run
    for t, u in f.rec_alg:
        k = f.algorithm_of[u]
        rec_ws[t, u] = p.algorithms[k].forward[chosen[k][0]][2]
    for t, (stage, cols) in enumerate(zip(p.stages, _stage_columns(f), strict=True)):
        cu = cols.units
        recomputed = np.where(cols.r_cols >= 0, x[np.maximum(cols.r_cols, 0)], 0)
        held = x[cols.s_cols]
        later = np.where(cols.dead, 0, keep[cu])  # a kept unit a later stage may read
        carried = np.where(cols.next_s_cols >= 0, x[np.maximum(cols.next_s_cols, 0)], later)
        # recomputation, in run order, on top of what the stage starts with
        at_start = p.constant_bytes + stage.start_bytes + int(z[t])
        at_start += int((m[cu] * (held - keep[cu])).sum())
        so_far = np.cumsum(((m[cu] + side[cu]) * recomputed)[cols.order])
        freed = _freed_bytes(f, t, x, keep)  # full formulation; else nothing
        live = at_start + (int(so_far[-1]) if len(so_far) else 0) - freed[-1]
        plan = f.free_plans[t] if f.free_plans is not None else None
        for i, j in enumerate(cols.order):
            if cols.prefix_end[i] >= 0 and (recomputed[j] or plan is not None):
                ws = max(int(unit_ws[cu[j]]), rec_ws.get((t, int(cu[j])), 0)) * int(recomputed[j])
                before = freed[plan.before[i]] if plan is not None else 0
                live = max(live, at_start + int(so_far[cols.prefix_end[i]]) - before + ws)
        # the backward ops: what they read from there on, what goes on to later stages
        # (a convolution's backward with its option's workspace)
        rewritten = int(z[t]) + int((side[cu] * recomputed).sum())
        runs = [*cols.by_op]
        for k, read in cols.conv_reads:
            a, option = p.algorithms[k], chosen[k][1]
            runs.append((a.backward_live + a.backward[option][2], read))
        for at_op, read in runs:
            present = np.where(read, held + recomputed, carried)
            at = p.constant_bytes + at_op + rewritten + int((m[cu] * (present - keep[cu])).sum())
            live = max(live, at)
        if live > peak:
            peak, where = live, f"backward stage {t}"
    return {"peak_bytes": int(peak), "peak_at": where}


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
    import cvxpy as cp

    if solver not in cp.installed_solvers():
        how = {
            "CBC": "pip install cylp",
            "HIGHS": "pip install highspy",
            "GUROBI": "pip install gurobipy (and a Gurobi licence)",
        }.get(solver, "")
        raise UserError(f"solver {solver} is not installed for cvxpy: {how}".rstrip(": "))
