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


def bridge_stages(cand: list[list[int]]) -> tuple[list[list[int]], set[int]]:
    """`cand` with each stage that reads nothing (a residual add's backward, a view's)
    given the units that are candidates both before and after it, so that a value can
    be held across it instead of recomputed again behind it; and those stages, where
    the units are only held, never recomputed. Without it, a GPT's softmax output,
    recomputed for the attention's second matmul backward, had to be recomputed again
    for the softmax backward two stages on, over 16 MiB more of gradients."""
    bridged = [list(c) for c in cand]
    empty = {t for t, c in enumerate(cand) if not c}
    t = 0
    while t < len(cand):
        if t not in empty:
            t += 1
            continue
        end = t
        while end in empty:
            end += 1
        if t > 0 and end < len(cand):
            held = sorted(set(cand[t - 1]) & set(cand[end]))
            for s in range(t, end):
                bridged[s] = held
        t = end
    return bridged, {t for t in empty if bridged[t]}


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
    columns: object | None = field(default=None, repr=False)  # filled by evaluate()
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
    hold_only: frozenset[int] = frozenset()  # stages bridged by `bridge_stages`
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

    @property
    def floor_ms(self) -> float:
        """The fastest step (ms) that the objective counts time above: the solvers' tolerance
        is a share of the step it and the objective make (backends.abs_gap_ms)."""
        return max(0.0, self.problem.fastest_step_s) / MS


def formulate(
    problem: Problem,
    depth: int | None,
    allow_recompute: bool = True,
    frees: bool | None = None,
    bridges: bool | None = None,
) -> Formulation:
    """The MILP of `problem`: candidates up to `depth` steps back (None: all, the full
    formulation); `allow_recompute=False` forbids recomputation (--ablation); `frees`
    frees a recomputation's inputs after their last reader (default: in the full
    formulation only; docs/solver.md says why not in the compact one); `bridges` lets
    a recomputed value be held across stages that read nothing (`bridge_stages`;
    default: in the compact formulation with `frees=True`).

    The rows come in families, built in this order and counted by name in
    `Formulation.stats["rows"]`: the forward pass (`forward`), the kept bytes per stage
    (`kept`), then per backward stage its start, recomputations, frees, backward ops and
    presence rules, then the variant choices (`choice`) and the convolution algorithms
    (`algorithm`)."""
    return _Builder(problem, depth, allow_recompute, frees, bridges).build()


class _Builder:
    """The columns of one formulation, its rows as they are written, and its objective.

    Boolean columns: keep_u, per stage t and candidate u R[t,u] (recomputed before t)
    and S[t,u] (in memory at t's start), per variant choice on/off, per convolution an
    option per direction and, per recomputation of it, the forward option it runs.
    Continuous columns: y_k (forward bytes kept of units already consumed), z_t (kept
    bytes a stage holds), b_t (what stage t starts with), q (bytes recomputed so far in
    a stage, a running sum where a row reads it), and in the full formulation the
    frees (free[t, i, k] and their running sums)."""

    def __init__(self, problem: Problem, depth, allow_recompute: bool, frees, bridges) -> None:
        self.problem, self.depth, self.allow_recompute = problem, depth, allow_recompute
        units = problem.units
        self.n_u, self.n_t = len(units), len(problem.stages)
        self.exact = allow_recompute and (depth is None if frees is None else frees)
        self.cand = candidates(problem, depth if allow_recompute else 0)  # depth 0: needs
        self.hold_only: set[int] = set()
        # Only in the compact formulation with the frees for now: on ResNet-50 (batch 8,
        # 64 px, normal, near its smallest budget) HiGHS found a schedule with bridges at
        # +4.1% where the optimum without them is +8.0%, but proved nothing in 600 s
        # beside other work (without bridges: proved after 52 s of search); in the full
        # formulation the smallest-budget search of a small UNet ended higher in its time.
        if bridges is None:
            bridges = bool(frees) and depth is not None
        if allow_recompute and bridges:
            self.cand, self.hold_only = bridge_stages(self.cand)
        self.cand_sets = [set(c) for c in self.cand]
        # A variant's own forward outputs (the ReLU mask) exist only while it is chosen;
        # they are kept, never recomputed.
        self.optional_of = {u: k for k, c in enumerate(problem.choices) for u in c.optional_units}
        self.last_use = [-1] * self.n_u
        for t, c in enumerate(self.cand):
            for u in c:
                self.last_use[u] = max(self.last_use[u], t)
                for v in units[u].inputs:
                    self.last_use[v] = max(self.last_use[v], t)
        self.m = [u.bytes / MIB for u in units]
        self.side = [u.side_bytes / MIB for u in units]
        self.const = problem.constant_bytes / MIB
        self.choice_needs = _choice_needs(problem)
        self._boolean_columns()
        self._continuous_columns()
        self.rows_b: list[tuple[int, int, float]] = []
        self.rows_c: list[tuple[int, int, float]] = []
        self.rhs: list[float] = []
        self.is_eq: list[bool] = []
        self.budget_rows: list[int] = []
        self.budget_const: list[float] = []
        self.families: dict[str, int] = {}

    def _boolean_columns(self) -> None:
        problem, units = self.problem, self.problem.units
        self.keep = np.arange(self.n_u)
        col = self.n_u
        self.r_index: dict[tuple[int, int], int] = {}
        self.s_index: dict[tuple[int, int], int] = {}
        for t, c in enumerate(self.cand):
            for u in c:
                if (
                    self.allow_recompute
                    and units[u].recomputable
                    and u not in self.optional_of
                    and t not in self.hold_only
                ):
                    self.r_index[t, u] = col
                    col += 1
                self.s_index[t, u] = col
                col += 1
        # choice k: on_k (the variant runs) and off_k (the aten op it replaced), one of them
        self.on_col = np.arange(col, col + len(problem.choices), dtype=int)
        self.off_col = self.on_col + len(problem.choices)
        col += 2 * len(problem.choices)
        # algorithm choice k: one column per option of each direction; a recomputation of
        # its unit is split by the forward option it runs (r = sum of those columns)
        self.fwd_cols, self.bwd_cols = [], []
        for a in problem.algorithms:
            self.fwd_cols.append(np.arange(col, col + len(a.forward)))
            col += len(a.forward)
            self.bwd_cols.append(np.arange(col, col + len(a.backward)))
            col += len(a.backward)
        self.algorithm_of = {a.unit: k for k, a in enumerate(problem.algorithms)}
        self.rec_alg: dict[tuple[int, int], np.ndarray] = {}
        for t, u in self.r_index:
            if u in self.algorithm_of:
                n_opts = len(problem.algorithms[self.algorithm_of[u]].forward)
                self.rec_alg[t, u] = np.arange(col, col + n_opts)
                col += n_opts
        self.n_bool = col

    def _continuous_columns(self) -> None:
        n_u, n_t = self.n_u, self.n_t
        self.order, self.prefix_end, self.breaks = _recompute_order(
            self.problem, self.cand, self.r_index, self.rec_alg, self.algorithm_of,
            every=self.exact,
        )  # fmt: skip
        self.y0, self.z0, self.b0 = 0, n_u, n_u + n_t
        self.q_col: dict[tuple[int, int], int] = {}  # (stage, position in its order) -> column
        n_cont = n_u + 2 * n_t
        for t in range(n_t):
            for pos in self.breaks[t]:
                self.q_col[t, pos] = n_cont
                n_cont += 1
        # Full formulation: free[t, i, k] <= 1 when input i goes after reader k (the solver
        # sets it, within the rows below); freed_col[t, e] = bytes freed by the stage's
        # first e + 1 free events (FreePlan), a running sum.
        self.free_plans = _free_plans(self.problem, self.cand, self.order) if self.exact else None
        self.free_col: dict[tuple[int, int, int], int] = {}
        self.freed_col: dict[tuple[int, int], int] = {}
        for t, plan in enumerate(self.free_plans or ()):
            for k, inputs in plan.readers:
                for i in inputs:
                    self.free_col[t, i, k] = n_cont
                    n_cont += 1
            for e in range(plan.n_events):
                self.freed_col[t, e] = n_cont
                n_cont += 1
        self.n_cont = n_cont

    def row(self, family: str, bool_terms, cont_terms, value, eq=False, budget_const_mib=None):
        """One row, `family` naming its kind; `budget_const_mib`: a budget row (its right
        side is the budget less this constant, set per solve by `_rhs_for`)."""
        r = len(self.rhs)
        self.rows_b.extend((r, j, a) for j, a in bool_terms)
        self.rows_c.extend((r, j, a) for j, a in cont_terms)
        self.rhs.append(value)
        self.is_eq.append(eq)
        self.families[family] = self.families.get(family, 0) + 1
        if budget_const_mib is not None:
            self.budget_rows.append(r)
            self.budget_const.append(budget_const_mib)

    def present(self, t: int, u: int) -> list[tuple[int, float]]:
        """P[t,u] = S[t,u] + R[t,u] as terms, for u in C(t)."""
        terms = [(self.s_index[t, u], 1.0)]
        if (t, u) in self.r_index:
            terms.append((self.r_index[t, u], 1.0))
        return terms

    # -- forward pass ----------------------------------------------------------------------

    def forward_rows(self) -> None:
        """Memory while forward unit k runs, within the budget:
        live(k) = sum_{u<=k, lastfwd(u)>=k} m_u + y_k, y_k = sum_{lastfwd(u)<k} m_u keep_u;
        each convolution with its chosen forward option's workspace."""
        problem, m, n_u, y0 = self.problem, self.m, self.n_u, self.y0
        consumed_at: list[list[int]] = [[] for _ in range(n_u)]
        diff = np.zeros(n_u + 1)
        optional_at: list[list[tuple[int, float]]] = [[] for _ in range(n_u)]
        for u in problem.units:
            consumed_at[u.last_forward_use].append(u.id)
            if u.id in self.optional_of:
                for k in range(u.id, u.last_forward_use + 1):
                    optional_at[k].append((self.on_col[self.optional_of[u.id]], m[u.id]))
                continue
            diff[u.id] += m[u.id]
            diff[u.last_forward_use + 1] -= m[u.id]
        still_needed = np.cumsum(diff)[:n_u]
        self.row("forward kept sum", [], [(y0, 1.0)], 0.0, eq=True)
        for k in range(1, n_u):
            consumed = [(self.keep[u], -m[u]) for u in consumed_at[k - 1]]
            self.row(
                "forward kept sum", consumed, [(y0 + k, 1.0), (y0 + k - 1, -1.0)], 0.0, eq=True
            )
        for k in range(n_u):
            extra = self.const + still_needed[k] + problem.forward_extra[k] / MIB
            self.row("forward memory", optional_at[k], [(y0 + k, 1.0)], 0.0, budget_const_mib=extra)
        for k, a in enumerate(problem.algorithms):  # the convolution itself, with its workspace
            u = a.unit
            options = [(j, o[2] / MIB) for j, o in zip(self.fwd_cols[k], a.forward, strict=True)]
            self.row(
                "forward memory", optional_at[u] + options, [(y0 + u, 1.0)], 0.0,
                budget_const_mib=self.const + still_needed[u] + a.forward_live / MIB,
            )  # fmt: skip

    # -- backward stages -------------------------------------------------------------------

    def kept_rows(self) -> None:
        """z_t = sum_{u: last_use(u) >= t} m_u keep_u, built as a running sum from the end."""
        ends_at: list[list[int]] = [[] for _ in range(self.n_t)]
        for u in range(self.n_u):
            if self.last_use[u] >= 0:
                ends_at[self.last_use[u]].append(u)
        z0 = self.z0
        for t in reversed(range(self.n_t)):
            terms_c = [(z0 + t, 1.0)] + ([(z0 + t + 1, -1.0)] if t + 1 < self.n_t else [])
            self.row(
                "kept", [(self.keep[u], -self.m[u]) for u in ends_at[t]], terms_c, 0.0, eq=True
            )

    def frees_of(self, t: int):
        """The full formulation's frees in stage t: writes their rows, and returns a
        function giving, for position p of the run order (None: after the last one), the
        term subtracting what was freed before that unit begins."""
        if self.free_plans is None:
            return lambda p: []
        units, m, plan = self.problem.units, self.m, self.free_plans[t]
        free_col, freed_col, r_index = self.free_col, self.freed_col, self.r_index
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
            self.row("freed sum", [], chain + terms, 0.0, eq=True)
        for k, inputs in plan.readers:
            for i in inputs:
                j = free_col[t, i, k]
                self.row("free", [(r_index[t, k], -1.0)], [(j, 1.0)], 0.0)  # only after k ran
                for later in readers_of[i]:  # and no reader of i ends after k
                    if end[later] > end[k]:
                        self.row("free", [(r_index[t, later], 1.0)], [(j, 1.0)], 1.0)
                if (t + 1, i) in self.s_index:  # not carried on to the next stage
                    self.row("free", [(self.s_index[t + 1, i], 1.0)], [(j, 1.0)], 1.0)
                elif self.last_use[i] > t:  # a kept unit a later stage may read stays
                    self.row("free", [(self.keep[i], 1.0)], [(j, 1.0)], 1.0)

        def freed(p):
            n = plan.n_events if p is None else plan.before[p]
            return [(freed_col[t, n - 1], -1.0)] if n else []

        return freed

    def backward_terms(self, t: int, read: set[int]) -> list[tuple[int, float]]:
        """m_u (Q[t,u] - keep_u) for the candidates of stage t, at a backward op that
        (or whose successors in the stage) reads `read`; plus recomputed side outputs."""
        m, keep, r_index, s_index = self.m, self.keep, self.r_index, self.s_index
        terms = []
        for u in self.cand[t]:
            if (t, u) in r_index:
                terms.append((r_index[t, u], self.side[u]))
            if u in read:  # present
                terms += [(s_index[t, u], m[u]), (keep[u], -m[u])]
                if (t, u) in r_index:
                    terms.append((r_index[t, u], m[u]))
            elif t + 1 < self.n_t and u in self.cand_sets[t + 1]:  # carried on
                terms += [(s_index[t + 1, u], m[u]), (keep[u], -m[u])]
            elif self.last_use[u] == t:  # no later stage can read it: dead
                terms.append((keep[u], -m[u]))
        return terms

    def recompute_rows(self, t: int) -> None:
        """Stage t's start b_t (z_t plus the candidates carried into it), then its
        recomputations, in forward order: while unit u runs, the stage holds what it
        started with, the units recomputed so far (q: those that began before u ends)
        and u's workspace, less what the full formulation freed. A recomputation also
        rewrites the unit's side outputs."""
        m, r_index, b0, problem = self.m, self.r_index, self.b0, self.problem
        start_terms = []
        for u in self.cand[t]:
            start_terms += [(self.s_index[t, u], -m[u]), (self.keep[u], m[u])]
        self.row("stage start", start_terms, [(b0 + t, 1.0), (self.z0 + t, -1.0)], 0.0, eq=True)
        order = self.order[t]
        pos_prev, q_prev = -1, None
        for pos in self.breaks[t]:
            seg = [(r_index[t, u], -(m[u] + self.side[u])) for u in order[pos_prev + 1 : pos + 1]]
            cont = [(self.q_col[t, pos], 1.0)] + ([(q_prev, -1.0)] if q_prev is not None else [])
            self.row("recomputed sum", seg, cont, 0.0, eq=True)
            pos_prev, q_prev = pos, self.q_col[t, pos]
        at_start = self.const + problem.stages[t].start_bytes / MIB
        freed = self.frees_of(t)
        end = [(q_prev, 1.0)] if q_prev is not None else []
        self.row(
            "recompute memory", [], [(b0 + t, 1.0)] + end + freed(None), 0.0,
            budget_const_mib=at_start,
        )  # fmt: skip
        for i, u in enumerate(order):
            if self.prefix_end[t][i] < 0:
                continue  # no workspace: the row after the last recomputation covers it
            q_here = [(self.q_col[t, self.prefix_end[t][i]], 1.0), (b0 + t, 1.0)] + freed(i)
            unit = problem.units[u]
            if unit.workspace_bytes or self.exact:  # full: memory falls, a row at each
                ws = unit.workspace_bytes / MIB
                self.row(
                    "recompute memory", [(r_index[t, u], ws)], q_here, 0.0,
                    budget_const_mib=at_start,
                )  # fmt: skip
            if (t, u) in self.rec_alg:  # the convolution's workspace, by the option it runs
                options = problem.algorithms[self.algorithm_of[u]].forward
                cols = self.rec_alg[t, u]
                ws_terms = [(j, o[2] / MIB) for j, o in zip(cols, options, strict=True)]
                if any(a for _, a in ws_terms):
                    self.row("recompute memory", ws_terms, q_here, 0.0, budget_const_mib=at_start)

    def backward_op_rows(self, t: int) -> None:
        """At stage t's backward ops: kept units (z_t), the units read from this op on,
        and those carried on to the next stage or possibly read later. A unit recomputed
        only as the input of another was freed after its last reader, before the backward
        ops; a saved value, after its last reader in the stage. A convolution's backward
        with its chosen options' workspace."""
        stage, z0, const = self.problem.stages[t], self.z0, self.const
        for _, at_op, reads in _op_runs(stage, self.choice_needs[t]):
            op_terms = self.backward_terms(t, set(reads))
            self.row(
                "backward memory", op_terms, [(z0 + t, 1.0)], 0.0,
                budget_const_mib=const + at_op / MIB,
            )  # fmt: skip
        for k, a in enumerate(self.problem.algorithms):
            if a.stage == t and a.backward:
                # what the stage reads from its op on (VGG-16 at 176: counting all the
                # stage reads held a dead 2.1 GB ReLU output at the first convolution's
                # backward, and the smallest budget with algorithm choices was 13.762 GB,
                # above the store-all peak)
                read = set(_reads_from(stage, a.backward_op, self.choice_needs[t]))
                terms = self.backward_terms(t, read)
                ws = [(j, o[2] / MIB) for j, o in zip(self.bwd_cols[k], a.backward, strict=True)]
                at_op = const + a.backward_live / MIB
                self.row(
                    "backward memory", terms + ws, [(z0 + t, 1.0)], 0.0, budget_const_mib=at_op
                )

    def presence_rows(self, t: int) -> None:
        """What stage t needs is present; a kept unit stays as itself until its last
        possible use; a unit is not both held and recomputed; a recomputation has its
        inputs; S[t,u] only from what was there before."""
        keep, r_index, s_index, present = self.keep, self.r_index, self.s_index, self.present
        for u in self.problem.stages[t].need:
            self.row("needed", [(j, -a) for j, a in present(t, u)], [], -1.0)  # P >= 1
        for u in self.cand[t]:
            # Once freed, a kept unit could only come back by recomputation, never as the
            # "pinned" kept value; and recomputing it while kept would hold a second copy
            # the rows do not count (a min-memory solve, indifferent to time, once left
            # R = 1 on kept units).
            self.row("kept stays", [(keep[u], 1.0), (s_index[t, u], -1.0)], [], 0.0)  # keep <= S
            if (t, u) in r_index:
                self.row("held or recomputed", present(t, u), [], 1.0)  # S + R <= 1
                for v in self.problem.units[u].inputs:  # recompute needs its inputs
                    if v in self.cand_sets[t]:
                        terms = [(r_index[t, u], 1.0)] + [(j, -a) for j, a in present(t, v)]
                    else:
                        terms = [(r_index[t, u], 1.0), (keep[v], -1.0)]
                    self.row("inputs present", terms, [], 0.0)
            if t > 0 and u in self.cand_sets[t - 1]:
                terms = [(s_index[t, u], 1.0)] + [(j, -a) for j, a in present(t - 1, u)]
            else:
                terms = [(s_index[t, u], 1.0), (keep[u], -1.0)]
            self.row("carried", terms, [], 0.0)

    # -- choices ---------------------------------------------------------------------------

    def choice_rows(self) -> None:
        """Each variant site runs the variant or the op it replaced; the variant's own
        outputs are kept only if it runs; the option chosen has what it reads."""
        for k, c in enumerate(self.problem.choices):
            on, off = self.on_col[k], self.off_col[k]
            self.row("choice", [(on, 1.0), (off, 1.0)], [], 1.0, eq=True)
            for u in c.optional_units:
                self.row("choice", [(self.keep[u], 1.0), (on, -1.0)], [], 0.0)
            for units_needed, chosen in ((c.on_units, on), (c.off_units, off)):
                for u in units_needed:  # P[t,u] >= the option that reads it
                    terms = [(j, -a) for j, a in self.present(c.stage, u)] + [(chosen, 1.0)]
                    self.row("choice", terms, [], 0.0)

    def algorithm_rows(self) -> None:
        """One option per convolution and direction; a recomputation runs one forward
        option, the one chosen."""
        for k, a in enumerate(self.problem.algorithms):
            self.row("algorithm", [(j, 1.0) for j in self.fwd_cols[k]], [], 1.0, eq=True)
            if a.backward:
                self.row("algorithm", [(j, 1.0) for j in self.bwd_cols[k]], [], 1.0, eq=True)
        for (t, u), cols in self.rec_alg.items():
            terms = [(self.r_index[t, u], -1.0)] + [(j, 1.0) for j in cols]
            self.row("algorithm", terms, [], 0.0, eq=True)
            for j, option_col in zip(cols, self.fwd_cols[self.algorithm_of[u]], strict=True):
                self.row("algorithm", [(j, 1.0), (option_col, -1.0)], [], 0.0)

    def objective(self) -> np.ndarray:
        """Milliseconds over the fastest step: recomputations, and each choice's time
        above its faster option (never negative)."""
        problem, units = self.problem, self.problem.units
        cost = np.zeros(self.n_bool)
        for (_t, u), j in self.r_index.items():
            cost[j] = units[u].recompute_s / MS
        for k, a in enumerate(problem.algorithms):
            fastest = min(o[1] for o in a.forward)
            cost[self.fwd_cols[k]] = [(o[1] - fastest) / MS for o in a.forward]
            if a.backward:
                fastest_bwd = min(o[1] for o in a.backward)
                cost[self.bwd_cols[k]] = [(o[1] - fastest_bwd) / MS for o in a.backward]
        for (t, u), cols in self.rec_alg.items():
            a = problem.algorithms[self.algorithm_of[u]]
            fastest = min(o[1] for o in a.forward)
            # the unit's profiled recomputation ran PyTorch's choice: swap its time for the
            # fastest option's, and the option chosen adds its excess
            recompute = max(0.0, units[u].recompute_s - a.forward_default_s + fastest)
            cost[self.r_index[t, u]] = recompute / MS
            cost[cols] = [(o[1] - fastest) / MS for o in a.forward]
        for k, c in enumerate(problem.choices):
            base = min(c.on_s, c.off_s)
            cost[self.on_col[k]] = (c.on_s - base) / MS
            cost[self.off_col[k]] = (c.off_s - base) / MS
        return cost

    def build(self) -> Formulation:
        self.forward_rows()
        self.kept_rows()
        for t in range(self.n_t):
            self.recompute_rows(t)
            self.backward_op_rows(t)
            self.presence_rows(t)
        self.choice_rows()
        self.algorithm_rows()
        n_rows = len(self.rhs)

        def matrix(entries, n_cols):
            if not entries:
                return sp.csr_matrix((n_rows, n_cols))
            r, cidx, v = zip(*entries, strict=True)
            return sp.csr_matrix((v, (r, cidx)), shape=(n_rows, n_cols))

        f = Formulation(
            problem=self.problem,
            depth=self.depth,
            cand=self.cand,
            last_use=self.last_use,
            hold_only=frozenset(self.hold_only),
            n_bool=self.n_bool,
            n_cont=self.n_cont,
            keep=self.keep,
            r_index=self.r_index,
            s_index=self.s_index,
            on_col=self.on_col,
            off_col=self.off_col,
            cost=self.objective(),
            a_bool=matrix(self.rows_b, self.n_bool),
            a_cont=matrix(self.rows_c, self.n_cont),
            rhs=np.array(self.rhs),
            is_eq=np.array(self.is_eq),
            budget_rows=np.array(self.budget_rows, dtype=int),
            budget_const=np.array(self.budget_const),
            fwd_cols=self.fwd_cols,
            bwd_cols=self.bwd_cols,
            rec_alg=self.rec_alg,
            algorithm_of=self.algorithm_of,
            recompute_order=self.order,
            prefix_end=self.prefix_end,
            free_plans=self.free_plans,
            free_columns=np.array(sorted(self.free_col.values()), dtype=int),
        )
        f.stats = {
            "variables": self.n_bool + self.n_cont,
            "binaries": self.n_bool,
            "constraints": n_rows,
            "nonzeros": int(f.a_bool.nnz + f.a_cont.nnz),
            "rows": dict(self.families),
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


def carried_over(x: np.ndarray, source: Formulation, target: Formulation) -> np.ndarray:
    """The 0/1 columns `x` of `source` as columns of `target`, a formulation of the same
    problem and depth with bridges (`bridge_stages`) where `source` has none: the same
    schedule, each kept unit present at the bridged stages, nothing else held there."""
    y = np.zeros(target.n_bool, dtype=x.dtype)
    y[target.keep] = x[source.keep]
    for mine, theirs in ((source.r_index, target.r_index), (source.s_index, target.s_index)):
        for key, j in mine.items():
            y[theirs[key]] = x[j]
    for t in target.hold_only:
        for u in target.cand[t]:
            y[target.s_index[t, u]] = x[source.keep[u]]
    y[target.on_col], y[target.off_col] = x[source.on_col], x[source.off_col]
    for k in range(len(source.fwd_cols)):
        y[target.fwd_cols[k]] = x[source.fwd_cols[k]]
        y[target.bwd_cols[k]] = x[source.bwd_cols[k]]
    for key, cols in source.rec_alg.items():
        y[target.rec_alg[key]] = x[cols]
    return y
