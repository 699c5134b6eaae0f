"""Recompute-count cuts: valid rows that the MILP's LP relaxation misses, found on it.

The relaxation can recompute a fraction of a unit `w` from the same fraction of its
input `v`, carry those fractions from stage to stage, and so count a fraction of `v`'s
recomputation and of its bytes where a schedule recomputes and holds all of it or
none. On ResNet-50 (184, normal, 5 GB) that put the LP at 4.977 s of recomputation
against an optimum of 5.674 s, and CBC, whose bound starts there, stood at an 18.6%
gap after 300 s. Two families of rows forbid the cheapest of those mixtures.

Take a unit `v` that can be recomputed and a run `[a, e]` of consecutive stages
where `v` is a candidate, with `v` no candidate of stage `a - 1`: `v` is present in
stage `a` only if kept or recomputed there. Take a unit `w` that reads `v`, and a
stage `t` in `[a, e]` where `w` is a candidate whose own run of candidate stages
starts at `a` or later. (`P = S + R`: present in a stage.)

**w needs v.** If `w` is present in `t` and neither is kept, `w` was recomputed in
some stage `s` of its run, `a <= s <= t`, which needed `v` present in `s`; `v`,
dropped, was recomputed in `[a, s]`:

    sum_{s = a..t} R_{s,v}  >=  P_{t,w} - k_v - k_w

**v again.** If moreover `v` is absent in `t` and present in a later stage `t'` of
its run, it was recomputed once for `w` (before `t`) and again in `(t, t']`:

    sum_{s = a..t'} R_{s,v}  >=  P_{t',v} + P_{t,w} - P_{t,v} - k_v - k_w

Every other case asks for fewer recomputations (a kept candidate is present, so
`k_v = 1` makes `P_{t,v} = 1`). The rows say nothing about memory: they hold for
every schedule at every budget, so they are added to the formulation itself.

**Separation.** There are many such rows (pairs `v, w` times stages, squared for the
second family); only those the current LP solution breaks are added, for a few
rounds of LP solve and separation (`root_cuts`): per `(v, w, t)` the first family's
row and the second's most violated `t'`.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import scipy.sparse as sp

from monet_like.solver.backends.highs import solved_relaxation
from monet_like.solver.formulation import Formulation

MIN_VIOLATION = 1e-3  # in units of "recomputations": the rows' coefficients are 0, ±1


def _candidate_runs(f: Formulation) -> dict[int, list[tuple[int, int]]]:
    """Per unit, its runs of consecutive stages where it is a candidate, as (first, last)."""
    stages: dict[int, list[int]] = {}
    for t, cand in enumerate(f.cand):
        for u in cand:
            stages.setdefault(u, []).append(t)
    runs = {}
    for u, ts in stages.items():
        bounds, first = [], ts[0]
        for prev, t in zip(ts, ts[1:], strict=False):
            if t != prev + 1:
                bounds.append((first, prev))
                first = t
        bounds.append((first, ts[-1]))
        runs[u] = bounds
    return runs


class CutSeparator:
    """The structure the cuts need, built once per formulation."""

    def __init__(self, f: Formulation):
        self.f = f
        self.runs = _candidate_runs(f)
        self.run_start: dict[tuple[int, int], int] = {}
        for u, bounds in self.runs.items():
            for first, last in bounds:
                for t in range(first, last + 1):
                    self.run_start[t, u] = first
        self.readers: dict[int, list[int]] = {}
        for w, unit in enumerate(f.problem.units):
            for v in unit.inputs:
                self.readers.setdefault(v, []).append(w)

    def _present(self, x: np.ndarray, t: int, u: int) -> float:
        f = self.f
        r = f.r_index.get((t, u))
        return x[f.s_index[t, u]] + (x[r] if r is not None else 0.0)

    def separate(self, x: np.ndarray, min_violation: float = MIN_VIOLATION) -> list[tuple]:
        """The cuts that the binary columns' values `x` break, as (violation, v, w, a, t,
        t'), t' None for the first family ("w needs v"), else the second's most violated
        t' for that (v, w, t)."""
        f = self.f
        found = []
        for v, bounds in self.runs.items():
            k_v = x[f.keep[v]]
            for a, e in bounds:
                columns = [f.r_index.get((s, v)) for s in range(a, e + 1)]
                if all(c is None for c in columns):
                    continue  # v is never recomputed here: only kept, the rows say so
                count = np.cumsum([0.0 if c is None else x[c] for c in columns])
                present = np.array([self._present(x, s, v) for s in range(a, e + 1)])
                for w in self.readers.get(v, ()):
                    k_w = x[f.keep[w]]
                    for t in range(a, e + 1):
                        if self.run_start.get((t, w), -1) < a:
                            continue
                        w_needs_v = self._present(x, t, w) - k_v - k_w
                        if w_needs_v - count[t - a] > min_violation:
                            found.append((w_needs_v - count[t - a], v, w, a, t, None))
                        base = w_needs_v - present[t - a]
                        if t == e or base + 1.0 <= min_violation:  # P_{t',v} - sum R <= 1
                            continue
                        later = present[t - a + 1 :] - count[t - a + 1 :]
                        j = int(np.argmax(later))
                        violation = base + later[j]
                        if violation > min_violation:
                            found.append((violation, v, w, a, t, t + 1 + j))
        return found

    def row(self, v: int, w: int, a: int, t: int, t_later: int | None) -> dict[int, float]:
        """The cut as {column: coefficient}, `<= 0` (`t_later` None: "w needs v")."""
        f = self.f
        row: dict[int, float] = {}

        def add(col: int, value: float) -> None:
            row[col] = row.get(col, 0.0) + value

        for s in range(a, (t if t_later is None else t_later) + 1):
            if (s, v) in f.r_index:
                add(f.r_index[s, v], -1.0)
        present = [(t, w, 1.0)]
        if t_later is not None:
            present += [(t_later, v, 1.0), (t, v, -1.0)]
        for s, u, sign in present:
            add(f.s_index[s, u], sign)
            if (s, u) in f.r_index:
                add(f.r_index[s, u], sign)
        add(int(f.keep[v]), -1.0)
        add(int(f.keep[w]), -1.0)
        return {c: value for c, value in row.items() if value != 0.0}


def _rows_matrix(rows: list[dict[int, float]], n_cols: int) -> sp.csr_matrix:
    indptr, indices, data = [0], [], []
    for row in rows:
        indices.extend(row.keys())
        data.extend(row.values())
        indptr.append(len(indices))
    return sp.csr_matrix(
        (np.asarray(data, dtype=float), np.asarray(indices, dtype=np.int64), indptr),
        shape=(len(rows), n_cols),
    )


def root_cuts(
    f: Formulation,
    budget_bytes: int,
    rounds: int = 10,
    time_limit: float = 60.0,
    per_round: int = 5000,
    solved_lp=None,
) -> tuple[sp.csr_matrix, dict]:
    """Cuts separated on the LP relaxation at `budget_bytes`: up to `rounds` rounds of
    LP (HiGHS, warm-started) and separation, within about `time_limit` seconds. Returns
    the rows over the binary columns (each `<= 0`) and what happened (number of rows,
    LP bound before and after, in seconds of recomputation, rounds, seconds; and
    "lp_columns": the binary columns of the LP optimum with every row returned, which
    the start's LP rounding takes instead of solving that LP again, or None).
    `solved_lp`: that relaxation already at its optimum (`solved_relaxation`'s model),
    taken over instead of solved again; the cuts' rows are added to it."""
    import highspy

    started = time.perf_counter()
    separator = CutSeparator(f)
    if solved_lp is None:
        h, solved = solved_relaxation(f, budget_bytes, time_limit)
    else:
        h, solved = solved_lp, True
    stats = {"cuts": 0, "lp_before_s": None, "lp_after_s": None, "rounds": 0, "seconds": 0.0}
    blocks = [sp.csr_matrix((0, f.n_bool))]
    at_optimum = solved  # of the LP with every row added so far
    if solved:
        stats["lp_before_s"] = stats["lp_after_s"] = h.getInfo().objective_function_value * 1e-3
    for _ in range(rounds if solved else 0):
        if time.perf_counter() - started > time_limit:
            break
        x = np.asarray(h.getSolution().col_value[: f.n_bool])
        found = sorted(separator.separate(x), key=lambda c: -c[0])[:per_round]
        if not found:
            break
        # over the binary columns only: HiGHS takes the rows by their column indices
        block = _rows_matrix([separator.row(*c[1:]) for c in found], f.n_bool)
        blocks.append(block)
        h.addRows(
            block.shape[0], np.full(block.shape[0], -highspy.kHighsInf),
            np.zeros(block.shape[0]), block.nnz, block.indptr[:-1].astype(np.int32),
            block.indices.astype(np.int32), block.data,
        )  # fmt: skip
        stats["rounds"] += 1
        h.setOptionValue("time_limit", max(1.0, time_limit - (time.perf_counter() - started)))
        h.run()
        at_optimum = h.getModelStatus() == highspy.HighsModelStatus.kOptimal
        if not at_optimum:
            break  # the rows found so far stand: each holds for every schedule
        stats["lp_after_s"] = h.getInfo().objective_function_value * 1e-3
    stats["lp_columns"] = np.asarray(h.getSolution().col_value[: f.n_bool]) if at_optimum else None
    cuts = sp.vstack(blocks).tocsr()
    stats["cuts"] = cuts.shape[0]
    stats["seconds"] = time.perf_counter() - started
    return cuts, stats


def with_cuts(f: Formulation, cuts: sp.csr_matrix) -> Formulation:
    """`f` with the rows `cuts @ x_bool <= 0` appended (after every other row, so the
    budget rows keep their indices)."""
    if cuts.shape[0] == 0:
        return f
    n = cuts.shape[0]
    return replace(
        f,
        a_bool=sp.vstack([f.a_bool, cuts]).tocsr(),
        a_cont=sp.vstack([f.a_cont, sp.csr_matrix((n, f.n_cont))]).tocsr(),
        rhs=np.concatenate([f.rhs, np.zeros(n)]),
        is_eq=np.concatenate([f.is_eq, np.zeros(n, dtype=bool)]),
        stats={
            **f.stats,
            "constraints": f.stats.get("constraints", f.n_rows) + n,
            "nonzeros": f.stats.get("nonzeros", 0) + cuts.nnz,
            "cuts": n,
            "rows": {**f.stats.get("rows", {}), "recompute count (cut)": n},
        },
        columns=None,
        cache={},
    )
