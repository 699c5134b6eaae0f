"""A schedule's peak memory computed from the formulation's own rows: what the solver
promised, checked independently of any solver (and where the peak falls)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from monet_like.solver.formulation import Formulation, _choice_needs, _op_runs, _reads_from


@dataclass(frozen=True)
class _Slots:
    """Every stage's candidates laid end to end ("slots", stage by stage), with what the
    backward stages' rows read of them, so that a schedule is evaluated in a few array
    operations over all stages instead of a loop over them (the start heuristics and the
    window searches evaluate hundreds of schedules)."""

    ptr: np.ndarray  # stage t's slots are ptr[t]:ptr[t + 1]
    units: np.ndarray  # per slot: its unit
    s_cols: np.ndarray
    r_cols: np.ndarray  # -1 where the unit cannot be recomputed
    next_s_cols: np.ndarray  # S of the next stage, -1 where it is no candidate there
    dead: np.ndarray  # no later stage can read it
    algorithm_of: np.ndarray  # its convolution choice if recomputed with one, or -1
    # the recomputable slots in run order, stage by stage (`order_ptr` as `ptr`); per
    # entry, the entry (global) of the last one begun when it ends, -1: no row of its own
    order: np.ndarray
    order_ptr: np.ndarray
    order_stage: np.ndarray
    prefix_end: np.ndarray
    # per run of backward ops: its stage, its backward-only bytes, and (a row per run)
    # which slots it or a later op of its stage reads
    run_stage: np.ndarray
    run_bytes: np.ndarray
    run_reads: sp.csr_matrix
    # per convolution's backward op: its stage, its algorithm choice, and what it reads
    conv_stage: np.ndarray
    conv_algorithm: np.ndarray
    conv_reads: sp.csr_matrix


def _slots(f: Formulation) -> _Slots:
    if f.columns is not None:
        return f.columns
    p = f.problem
    choice_needs = _choice_needs(p)
    sizes = [len(c) for c in f.cand]
    ptr = np.concatenate(([0], np.cumsum(sizes))).astype(int)
    flat = [(t, u) for t, c in enumerate(f.cand) for u in c]
    order, order_stage, prefix_end, order_ptr = [], [], [], [0]
    run_stage, run_bytes, run_rows = [], [], []
    conv_stage, conv_algorithm, conv_rows = [], [], []
    for t, c in enumerate(f.cand):
        position = {u: ptr[t] + i for i, u in enumerate(c)}
        base = order_ptr[-1]
        order += [position[u] for u in f.recompute_order[t]]
        order_stage += [t] * len(f.recompute_order[t])
        prefix_end += [base + e if e >= 0 else -1 for e in f.prefix_end[t]]
        order_ptr.append(len(order))
        stage = p.stages[t]
        for _, at_op, reads in _op_runs(stage, choice_needs[t]):
            run_stage.append(t)
            run_bytes.append(at_op)
            run_rows.append([position[u] for u in set(reads) if u in position])
        for k, a in enumerate(p.algorithms):
            if a.stage == t and a.backward:
                read = _reads_from(stage, a.backward_op, choice_needs[t])
                conv_stage.append(t)
                conv_algorithm.append(k)
                conv_rows.append([position[u] for u in set(read) if u in position])

    def rows(lists) -> sp.csr_matrix:
        indptr = np.concatenate(([0], np.cumsum([len(r) for r in lists]))).astype(int)
        indices = np.array([i for r in lists for i in r], dtype=int)
        data = np.ones(len(indices), dtype=np.int64)
        return sp.csr_matrix((data, indices, indptr), shape=(len(lists), len(flat)))

    f.columns = _Slots(
        ptr=ptr,
        units=np.array([u for _, u in flat], dtype=int),
        s_cols=np.array([f.s_index[t, u] for t, u in flat], dtype=int),
        r_cols=np.array([f.r_index.get((t, u), -1) for t, u in flat], dtype=int),
        next_s_cols=np.array([f.s_index.get((t + 1, u), -1) for t, u in flat], dtype=int),
        dead=np.array([f.last_use[u] == t for t, u in flat], dtype=bool),
        algorithm_of=np.array(
            [f.algorithm_of[u] if (t, u) in f.rec_alg else -1 for t, u in flat], dtype=int
        ),
        order=np.array(order, dtype=int),
        order_ptr=np.array(order_ptr, dtype=int),
        order_stage=np.array(order_stage, dtype=int),
        prefix_end=np.array(prefix_end, dtype=int),
        run_stage=np.array(run_stage, dtype=int),
        run_bytes=np.array(run_bytes, dtype=np.int64),
        run_reads=rows(run_rows),
        conv_stage=np.array(conv_stage, dtype=int),
        conv_algorithm=np.array(conv_algorithm, dtype=int),
        conv_reads=rows(conv_rows),
    )
    return f.columns


def _segment_sums(values: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """Sums of `values[ptr[t]:ptr[t + 1]]` for each t, exactly (integers)."""
    total = np.concatenate(([0], np.cumsum(values)))
    return total[ptr[1:]] - total[ptr[:-1]]


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
    # per algorithm choice: the workspace of the forward option a recomputation runs
    option_ws = np.array(
        [a.forward[i][2] for a, (i, _) in zip(p.algorithms, chosen, strict=True)] + [0],
        dtype=np.int64,
    )  # the last entry: no convolution (index -1)
    x = x.astype(np.int64)
    slots = _slots(f)
    n_t = len(p.stages)
    su, m_s = slots.units, m[slots.units]
    keep_s = keep[su].astype(np.int64)
    recomputed = np.where(slots.r_cols >= 0, x[np.maximum(slots.r_cols, 0)], 0)
    held = x[slots.s_cols]
    later = np.where(slots.dead, 0, keep_s)  # a kept unit a later stage may read
    carried = np.where(slots.next_s_cols >= 0, x[np.maximum(slots.next_s_cols, 0)], later)
    # each stage's recomputations, in run order, on top of what the stage starts with
    start_bytes = np.array([stage.start_bytes for stage in p.stages], dtype=np.int64)
    at_start = p.constant_bytes + start_bytes + z.astype(np.int64)
    at_start += _segment_sums(m_s * (held - keep_s), slots.ptr)
    begun = ((m_s + side[su]) * recomputed)[slots.order]
    so_far = np.cumsum(begun)
    so_far_before = np.concatenate(([0], so_far))[slots.order_ptr[:-1]]  # per stage
    freed = None
    if f.free_plans is not None:  # full formulation; else nothing is freed
        freed = [_freed_bytes(f, t, x, keep) for t in range(n_t)]
        freed_end = np.array([fr[-1] for fr in freed], dtype=np.int64)
    else:
        freed_end = np.zeros(n_t, dtype=np.int64)
    live = at_start + _segment_sums(begun, slots.order_ptr) - freed_end
    # each recomputation with a row of its own, while it runs: what has begun by its end,
    # less what was freed before it began, plus its workspace
    ran = recomputed[slots.order]
    rows = slots.prefix_end >= 0
    if freed is None:
        rows &= ran > 0
    if rows.any():
        j = slots.order[rows]
        t = slots.order_stage[rows]
        ws = np.maximum(unit_ws[su[j]], option_ws[slots.algorithm_of[j]]) * ran[rows]
        begun_by = so_far[slots.prefix_end[rows]] - so_far_before[t]
        if freed is None:
            before = 0
        else:
            position = np.flatnonzero(rows) - slots.order_ptr[t]
            before = np.array(
                [freed[s][f.free_plans[s].before[i]] for s, i in zip(t, position, strict=True)],
                dtype=np.int64,
            )
        np.maximum.at(live, t, at_start[t] + begun_by - before + ws)
    # the backward ops: what they read from there on, what goes on to later stages (a
    # convolution's backward with its option's workspace)
    if_read = m_s * (held + recomputed - keep_s)
    if_carried = m_s * (carried - keep_s)
    rewritten = z.astype(np.int64) + _segment_sums(side[su] * recomputed, slots.ptr)
    base = p.constant_bytes + rewritten + _segment_sums(if_carried, slots.ptr)
    difference = if_read - if_carried
    at_runs = slots.run_bytes + slots.run_reads @ difference
    np.maximum.at(live, slots.run_stage, base[slots.run_stage] + at_runs)
    if len(slots.conv_stage):
        conv_bytes = np.array(
            [
                p.algorithms[k].backward_live + p.algorithms[k].backward[chosen[k][1]][2]
                for k in slots.conv_algorithm
            ],
            dtype=np.int64,
        )
        at_conv = conv_bytes + slots.conv_reads @ difference
        np.maximum.at(live, slots.conv_stage, base[slots.conv_stage] + at_conv)
    if n_t:
        t = int(np.argmax(live))
        if live[t] > peak:
            peak, where = int(live[t]), f"backward stage {t}"
    return {"peak_bytes": int(peak), "peak_at": where}
