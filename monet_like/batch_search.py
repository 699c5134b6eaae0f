"""The largest batch whose schedule fits a budget (`solve.py MODEL auto BUDGET ...`).

Each batch tried is captured on fake tensors (nothing allocated) and solved with a
profile carried over from one taken at a small batch (`profile.align.at_batch`: times
scaled, workspace never scaled down): the search runs no model. The batch it finds is
then compiled like any other, profiled at that batch; where that schedule does not fit
(the carried profile was too kind) or the next batch turns out to fit, the search goes
on from the new profile, whose estimates near its own batch are close.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from monet_like.errors import UserError
from monet_like.units import GIB

REFERENCE_BATCH = 8  # profiled first: small enough to run anywhere, large enough to scale
MAX_BATCH = 1 << 20
ROUNDS = 3  # compiles at a found batch before the answer stands or the search gives up


@dataclass
class Probe:
    """One batch tried: whether its schedule fits, and why not."""

    batch: int
    fits: bool
    detail: str  # "peak 9.95 GB, +4.1%", "smallest budget 10.62 GB", ...
    estimated_from: tuple[int, ...]  # the batches of the profiles its estimate came from


@dataclass
class BatchSearch:
    """The largest batch found, its compiled schedule and every batch tried."""

    batch: int
    compiled: object  # monet_like.pipeline.Compiled, profiled and solved at `batch`
    probes: list[Probe] = field(default_factory=list)


def largest_batch(
    model: nn.Module,
    input_shape: tuple[int, ...],
    budget_bytes: int,
    mode: str = "normal",
    solver: str = "HIGHS",
    *,
    max_overhead: float | None = None,
    probe_time_limit: float = 30.0,
    progress: Callable[[str], None] | None = None,
    **compile_args,
) -> BatchSearch:
    """The largest batch whose schedule fits `budget_bytes` (and, given `max_overhead`,
    costs at most that predicted overhead over the store-all step, e.g. 0.1 for +10%).

    Args:
        model, input_shape, mode, solver: as for `pipeline.compile_schedule`.
        budget_bytes: the budget of one training step, in bytes.
        max_overhead: the largest predicted overhead accepted; None: any.
        probe_time_limit: seconds for each batch's solve during the search (a solve
            stopped without a schedule counts as not fitting).
        progress: receives one line per batch tried.
        compile_args: passed to `compile_schedule` (dtype, device, time_limit, ...).

    Returns:
        `BatchSearch`: the batch, its `Compiled` (profiled and solved at that batch;
        not saved) and the probes; the batch after it was found not to fit.

    Raises:
        UserError: not even batch 1 fits, or the search did not settle.
    """
    from monet_like.pipeline import capture_graphs, compile_schedule, profile_graphs

    say = progress or (lambda _line: None)
    capture_args = {
        k: compile_args[k]
        for k in ("dtype", "device", "model_name", "input_grad", "outputs_held", "autocast")
        if k in compile_args
    }
    device = compile_args.get("device", "cpu")
    probes: list[Probe] = []

    def graphs_at(batch: int):
        return capture_graphs(model, input_shape, batch, mode, **capture_args)

    references: dict[int, tuple] = {}  # batch -> (graph, profile, baseline), as measured

    def measure_at(batch: int) -> None:
        """The profile at `batch` (from the cache where a compile at that batch took it)."""
        captured, graph = graphs_at(batch)
        profile_batch = compile_args.get("profile_batch")
        prof, baseline = profile_graphs(
            model, captured, graph, None if profile_batch is None else min(profile_batch, batch),
            device, compile_args.get("repeats", 3), progress is not None,
        )  # fmt: skip
        references[batch] = (graph, prof, baseline)

    say(f"profiles at batches {REFERENCE_BATCH // 2} and {REFERENCE_BATCH}: the others are"
        " estimated from them, and from those of each batch compiled")  # fmt: skip
    for batch in (REFERENCE_BATCH // 2, REFERENCE_BATCH):
        measure_at(batch)

    def nearest(batch: int) -> list[tuple]:
        """The two measured profiles nearest `batch` (in ratio), in batch order."""
        near = sorted(references, key=lambda b: abs(math.log(b / batch)))[:2]
        return [references[b] for b in sorted(near)]

    verdicts: dict[int, bool] = {}  # batch -> fits, as estimated or compiled

    def fits(batch: int) -> bool:
        if batch not in verdicts:
            try:
                graphs = graphs_at(batch)
            except UserError as exc:  # e.g. BatchNorm over one value per channel at batch 1
                probe = Probe(batch, False, f"cannot run: {exc}", ())
            else:
                probe = _probe(nearest(batch), graphs, budget_bytes, mode, solver,
                               max_overhead, probe_time_limit)  # fmt: skip
            probes.append(probe)
            verdicts[batch] = probe.fits
            say(f"  batch {batch}: {'fits' if probe.fits else 'does not fit'} ({probe.detail})")
        return verdicts[batch]

    for _round in range(ROUNDS):
        low = max((b for b, ok in verdicts.items() if ok), default=0)
        high = min((b for b, ok in verdicts.items() if not ok and b > low), default=None)
        found = _search(fits, low, high, REFERENCE_BATCH)
        if found == 0:
            ran = [p for p in probes if not p.detail.startswith("cannot run")] or probes
            smallest = min(ran, key=lambda p: p.batch)
            raise UserError(
                f"no batch fits {budget_bytes / GIB:.3f} GB: batch {smallest.batch}"
                f" {smallest.detail}"
            )
        say(f"batch {found}: compiling its schedule on a profile taken at that batch")
        try:
            compiled = compile_schedule(
                model, input_shape, found, budget_bytes, mode, solver, **compile_args
            )
            overhead = compiled.solution.overhead
            within = max_overhead is None or overhead <= max_overhead + 1e-12
            if not within:
                say(f"  batch {found}: overhead {overhead:+.2%} on its own profile")
        except UserError as exc:  # InfeasibleBudget, or a solve stopped without a schedule
            compiled, within = None, False
            say(f"  batch {found} does not fit on its own profile: {exc}")
        # Estimates near the found batch come from its own profile (the compile cached
        # it) from here on; the batches below it found to fit are kept.
        measure_at(found)
        verdicts = {b: ok for b, ok in verdicts.items() if ok and b < found}
        verdicts[found] = within
        if within and not fits(found + 1):
            return BatchSearch(found, compiled, probes)
    raise UserError(
        f"the batch search did not settle in {ROUNDS} rounds (tried: "
        + ", ".join(f"{p.batch} {'yes' if p.fits else 'no'}" for p in probes)
        + "): give a batch instead of auto"
    )


def _search(fits: Callable[[int], bool], low: int, high: int | None, first: int) -> int:
    """The largest batch for which `fits` holds, taken to hold below any batch it holds
    for: `low` fits (0: none known), `high` does not (None: none known). Doubling from
    `first` (or twice `low`) to the first batch that does not fit, then bisection, so
    that batch 1, which some models cannot train at, is tried only when nothing larger
    fits. 0: no batch fits."""
    if high is None:
        high = max(first, 2 * low)
        while high <= MAX_BATCH and fits(high):
            low, high = high, 2 * high
        if high > MAX_BATCH:
            return low
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def _probe(references, graphs, budget_bytes, mode, solver, max_overhead, time_limit) -> Probe:
    """Whether one batch's schedule fits, solved on a profile carried over from the
    measured ones (`references`: (graph, profile, baseline) at one or two batches)."""
    from monet_like.profile.align import at_batch
    from monet_like.solver import InfeasibleBudget, solve

    captured, graph = graphs
    try:
        prof = at_batch([(g, p) for g, p, _ in references], graph)
        baseline = None
        if references[0][2] is not None:
            pairs = [b for _, _, b in references]
            baseline = (captured, at_batch(pairs, captured))
    except ValueError as exc:
        message = f"{exc}: batch-dependent control flow; give a batch instead of auto"
        raise UserError(message) from None
    try:
        sol = solve(graph, prof, budget_bytes, mode=mode, solver=solver,
                    time_limit=time_limit, baseline=baseline)  # fmt: skip
    except InfeasibleBudget as exc:
        smallest = exc.min_budget_bytes
        detail = "no schedule fits" if smallest is None else (
            f"smallest budget {smallest / GIB:.4f} GB"
        )  # fmt: skip
        return Probe(graph.batch, False, detail, _from(references))
    except UserError as exc:  # stopped without a schedule within the probe's limit
        return Probe(graph.batch, False, str(exc).split(":")[0], _from(references))
    detail = f"peak {sol.predicted_peak_bytes / GIB:.4f} GB, {sol.overhead:+.2%}"
    within = max_overhead is None or sol.overhead <= max_overhead + 1e-12
    return Probe(graph.batch, within, detail, _from(references))


def _from(references) -> tuple[int, ...]:
    return tuple(g.batch for g, _, _ in references)
