"""The whole pipeline in one call: capture, profile, solve, build and check a schedule.

    compiled = monet_like.compile(model, (3, 224, 224), 32, budget_bytes=4 * 2**30,
                                  mode="inplace_conv_multiway_newnode", solver="HIGHS",
                                  output="resnet50_32_4.json")
    compiled.solution.predicted_peak_bytes, compiled.solution.overhead
    wrapped = ScheduleWrapper(model, "resnet50_32_4.json", (3, 224, 224))

`solve.py`, the zoo builder and the differential checks (`verify.replay_entry`) go
through `compile_schedule`, so that each stage runs the same way wherever a schedule
is made.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from monet_like.errors import UserError
from monet_like.units import GIB


def describe_sites(graph) -> str:
    """The variants rewritten into `graph`, counted, e.g. 'relu_mask x17 (the solver's
    choice), max_pool2d_compact x1'."""
    from collections import Counter

    counts = Counter((s["variant"], s["choosable"]) for s in graph.sites)
    return "variants: " + ", ".join(
        f"{name} x{n}" + (" (the solver's choice)" if free else "")
        for (name, free), n in sorted(counts.items())
    )


@dataclass
class Compiled:
    """What `compile_schedule` made: the solution (saved where asked), the graph it runs
    on and that graph's profile, for callers that go on to inspect or replay it."""

    solution: object  # monet_like.solution.Solution
    graph: object  # monet_like.graph.Graph
    profile: object  # monet_like.profile.Profile
    min_budget_bytes: int | None = None  # the smallest feasible budget, where it was searched


def compile_schedule(
    model: nn.Module,
    input_shape: tuple[int, ...],
    batch: int,
    budget_bytes: int | None = None,
    mode: str = "normal",
    solver: str = "HIGHS",
    *,
    budget_fraction: float | None = None,
    min_budget_bytes: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model_name: str = "",
    time_limit: float | None = 600.0,
    formulation: str = "compact",
    depth: int | None = None,
    frees: bool | None = None,
    ablation: bool = False,
    input_grad: bool = False,
    outputs_held: bool = True,
    autocast: torch.dtype | None = None,
    profile_batch: int | None = None,
    repeats: int = 3,
    output: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
    verbose: bool = False,
) -> Compiled:
    """Capture `model`'s training step, profile it, solve for `budget_bytes` and check
    the schedule on fake tensors (its simulated peak, workspace included, must fit).

    Args:
        model: the model, with real parameters on `device`.
        input_shape: one sample's input shape, without the batch dimension.
        batch: the batch size.
        budget_bytes: the budget for one training step (parameters, gradients, buffers,
            input, activations, workspace), in bytes.
        mode: "normal" or MONeT's variant flags joined by "_".
        solver: "HIGHS", "CBC", "PULP" or "GUROBI".
        budget_fraction: instead of `budget_bytes`, a point between the smallest feasible
            budget (0.0) and the store-all peak (1.0), found by solving the min-memory
            problem first (within `time_limit`: past it, the smallest budget found).
            1.0 needs no search.
        min_budget_bytes: the smallest feasible budget where a caller already has it
            (`Compiled.min_budget_bytes` of another fraction), so it is not searched again.
        output: where to save the solution file (atomically); None: not saved.
        progress: receives one line per event worth showing.
        The others: as `solve.py`'s options of the same names.

    Returns:
        `Compiled`: the Solution, the graph it runs on and its profile.

    Raises:
        UserError: bad input; `solver.InfeasibleBudget` (a UserError) when no schedule
        fits, with the smallest feasible budget.
    """
    from monet_like.schedule import finalize
    from monet_like.solver import (
        DEFAULT_DEPTH,
        MIN_BUDGET_TIME_LIMIT,
        min_feasible_budget,
        parse_mode,
        schedule_graph,
        solve,
    )
    from monet_like.solver.problem import build_problem

    if (budget_bytes is None) == (budget_fraction is None):
        raise UserError("give exactly one of budget_bytes and budget_fraction")
    if budget_fraction is not None and not 0.0 <= budget_fraction <= 1.0:
        raise UserError(f"budget_fraction must be within [0, 1], not {budget_fraction}")
    parse_mode(mode)
    captured, graph = capture_graphs(
        model, input_shape, batch, mode, dtype=dtype, device=device, model_name=model_name,
        input_grad=input_grad, outputs_held=outputs_held, autocast=autocast, progress=progress,
    )  # fmt: skip
    prof, baseline = profile_graphs(
        model, captured, graph, profile_batch, device, repeats, progress is not None, progress
    )
    low = min_budget_bytes
    if budget_fraction is not None:
        problem = build_problem(graph, prof)
        if low is None and budget_fraction < 1.0:
            low = min_feasible_budget(
                problem,
                depth or DEFAULT_DEPTH,
                ablation,
                solver,
                time_limit=None if time_limit is None else min(time_limit, MIN_BUDGET_TIME_LIMIT),
                frees=frees,
            )
        top = problem.store_all_peak_bytes
        budget_bytes = top if low is None else int(low + budget_fraction * (top - low))
    if progress is not None:
        progress(_solving_line(budget_bytes, mode, solver, formulation, frees, time_limit))
    sol = solve(
        graph,
        prof,
        int(budget_bytes),
        mode=mode,
        solver=solver,
        time_limit=time_limit,
        formulation=formulation,
        depth=depth,
        ablation=ablation,
        frees=frees,
        verbose=verbose,
        progress=None if progress is None else (lambda line: progress(f"  {line}")),
        baseline=baseline,
    )
    # Read before the schedule's graph is chosen: a derived profile has no ops run alone.
    fit_check = getattr(prof, "alone_over_fitted", None)
    if baseline is not None and tuple(sol.variants or ()) != graph.variants:
        graph, prof = schedule_graph(sol, graph, prof, baseline)
        if progress is not None:
            progress(
                "  the captured graph's own schedule is faster: no variant is used"
                if not sol.variants
                else "  the convolution algorithms alone are faster: no other variant is used"
            )
    # The solver's peak is a bound from its memory model; the schedule run on fake
    # tensors with each op's workspace gives the exact prediction.
    finalize(graph, sol, prof)
    spread = getattr(prof, "time_spread", None)
    if spread is not None:
        sol.extra["profile_time_spread"] = spread
    if getattr(prof, "alone_drift", None) is not None:
        sol.extra["profile_alone_drift"] = prof.alone_drift
    if getattr(prof, "alone_drift_after", None) is not None:
        sol.extra["profile_alone_drift_after"] = prof.alone_drift_after
    if getattr(prof, "alone_contended", 0):
        sol.extra["profile_alone_contended"] = prof.alone_contended
    if getattr(prof, "load_per_core", None) is not None:
        sol.extra["profile_load_per_core"] = prof.load_per_core
    if fit_check is not None:
        from monet_like.profile.types import FIT_UNDERSTATES

        sol.extra["profile_alone_over_fitted"] = fit_check
        if fit_check > FIT_UNDERSTATES and progress is not None:
            progress(
                f"  the ops run alone at batch {graph.batch} took {fit_check:.2f}x their"
                " fitted times: the step at this batch is likely slower"
                " than predicted, and the overheads larger (docs/benchmarks.md#time-fit)"
            )
    if getattr(prof, "noisy", "") and progress is not None:
        progress(
            f"  the profile is unsure: {prof.noisy}; predicted times are no surer than that"
            " (one taken with the machine busy is taken again by a solve when it is quiet)"
        )
    if sol.predicted_peak_bytes > sol.budget_bytes:  # the MILP promised otherwise: a bug
        raise RuntimeError(
            f"the schedule's simulated peak {sol.predicted_peak_bytes / GIB:.4f} GB exceeds "
            f"its budget {sol.budget_bytes / GIB:.4f} GB"
        )
    if output is not None:
        sol.save(output)
    return Compiled(sol, graph, prof, low)


def capture_graphs(
    model: nn.Module,
    input_shape: tuple[int, ...],
    batch: int,
    mode: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model_name: str = "",
    input_grad: bool = False,
    outputs_held: bool = True,
    autocast: torch.dtype | None = None,
    progress: Callable[[str], None] | None = None,
):
    """The captured graph of one training step at `batch` (fake tensors: nothing is
    allocated) and that graph with `mode`'s variants rewritten in.

    Returns:
        (captured, graph): two `monet_like.graph.Graph`s, the same one in normal mode.
    """
    from monet_like.graph import capture
    from monet_like.variants import apply as apply_variants

    captured = capture(
        model,
        tuple(input_shape),
        batch,
        dtype,
        device,
        model_name,
        input_grad=input_grad,
        outputs_held=outputs_held,
        autocast=autocast,
    )
    graph = apply_variants(captured, mode, _zero_gamma_batch_norms(model, captured, mode, progress))
    if progress is not None:
        progress(graph.summary())
        if graph.sites:
            progress(f"  {describe_sites(graph)}")
    return captured, graph


def profile_graphs(
    model: nn.Module,
    captured,
    graph,
    profile_batch: int | None = None,
    device: str | torch.device = "cpu",
    repeats: int = 3,
    lines: bool = True,
    progress: Callable[[str], None] | None = None,
):
    """`graph`'s profile and, where it has variants, the captured graph's beside it: the
    solver weighs each variant's ops against the aten ops they replaced, timed in the
    captured graph, and keeps the captured graph itself where that is faster.
    `progress`, where given, receives a line per profile taken: where its time went.

    Returns:
        (profile, baseline): baseline is (captured, its profile), or None in normal mode.
    """
    from monet_like.profile import cached_profile
    from monet_like.profile import profile as take_profile

    bars = None if lines else False  # progress bars where a line goes
    captures: dict = {}  # the model at the profile's smaller batches, captured once for both
    # The captured graph's timed runs are taken beside the variants' graph's (unless its
    # profile is cached): taken minutes apart, a shared machine's speed moves between them.
    reference = None
    if graph.variants:
        reference = cached_profile(captured, profile_batch, device, progress=False)
    beside = captured if graph.variants and reference is None else None
    shared = {"progress": bars, "captures": captures}
    prof = take_profile(model, graph, profile_batch, device, repeats, beside=beside, **shared)
    if progress is not None:
        progress(profile_line(prof, "with its variants" if graph.variants else ""))
    if not graph.variants:
        return prof, None
    if reference is None:
        reference = take_profile(model, captured, profile_batch, device, repeats, **shared)
    if progress is not None:
        progress(profile_line(reference, "as captured"))
    return prof, (captured, reference)


def profile_line(prof, which: str = "") -> str:
    """One line on where a profile came from and, if taken now, where its time went."""
    graph = f"the graph {which}" if which else "the graph"
    if prof.cached:
        return f"  profile of {graph}: from the cache"
    stages = ", ".join(f"{name} {s:.1f} s" for name, s in prof.stage_seconds.items())
    return f"  profiled {graph} in {prof.profile_seconds:.1f} s" + (
        f" ({stages})" if stages else ""
    )


def _zero_gamma_batch_norms(model: nn.Module, captured, mode: str, progress) -> tuple[str, ...]:
    """The BatchNorms output-activated BatchNorm must not be rewritten into: it recovers
    its input by dividing by gamma, and these have a gamma element at zero (timm's and
    torchvision's zero-initialised last BatchNorm of each residual block). They keep their
    input for the backward pass, as PyTorch does; said in one line."""
    from monet_like.variants import parse_mode
    from monet_like.variants.multiway import GAMMA_MIN
    from monet_like.variants.sites import source

    if "multiway" not in parse_mode(mode):
        return ()
    fx_names = [n.name for n in captured.fx.graph.nodes if n.op == "placeholder"]
    names = {fx: name for fx, (_kind, name) in zip(fx_names, captured.placeholders, strict=True)}
    found, weights = [], []
    for node in captured.fx.graph.nodes:
        if node.target != torch.ops.aten.native_batch_norm.default:
            continue
        if not isinstance(node.args[1], torch.fx.Node):
            continue  # no affine weight
        gamma = source(node.args[1])
        try:
            weight = model.get_parameter(names[gamma.name])
        except (AttributeError, KeyError):
            continue  # not a parameter
        if weight.device.type != "meta" and float(weight.detach().abs().min()) < GAMMA_MIN:
            found.append(node.name)
            weights.append(names[gamma.name])
    if found and progress is not None:
        more = f" and {len(weights) - 3} more" if len(weights) > 3 else ""
        progress(
            f"  {len(found)} BatchNorms keep their input for the backward pass, their gamma"
            f" being zero ({', '.join(weights[:3])}{more}): output-activated BatchNorm"
            " divides by it"
        )
    return tuple(found)


def _solving_line(budget_bytes, mode, solver, formulation, frees, time_limit) -> str:
    return (
        f"solving: budget {budget_bytes / GIB:g} GB, mode {mode}, {solver.upper()},"
        f" {formulation} formulation"
        + (" with frees" if frees and formulation == "compact" else "")
        + (f", time limit {time_limit:g} s" if time_limit else "")
    )
