"""A schedule's peak memory computed from the formulation's own rows: what the solver
promised, checked independently of any solver (and where the peak falls)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from monet_like.solver.formulation import Formulation, _choice_needs, _op_runs, _reads_from


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
