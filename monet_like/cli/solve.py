"""solve.py: MONeT's argument order, the zoo's answer where it has one, `auto` batches."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

from monet_like.cli.common import (
    _MAX_BUDGET_GB,
    DEFAULT_TIME_LIMIT,
    _naming,
    _Parser,
    _run,
    _setup,
    batch_or_auto,
    default_solution_name,
    positive_int,
)
from monet_like.errors import UserError
from monet_like.units import GIB


def build_solve_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="solve.py",
        description="solve for a schedule that fits one training step in BUDGET_GB",
    )
    p.add_argument("model", help='"torchvision.models.NAME(...)", unet, gpt, or pkg.module:factory')
    p.add_argument(
        "batch", type=batch_or_auto, help="batch size, or auto: the largest whose schedule fits"
    )
    p.add_argument("budget_gb", type=float, help="memory budget in GB (1 GB = 2**30 bytes)")
    p.add_argument("mode", help="normal, or MONeT flags joined by _ (e.g. inplace_normal)")
    p.add_argument("solver", help="CBC, HIGHS, GUROBI or PULP")
    p.add_argument(
        "--time_limit",
        type=float,
        default=DEFAULT_TIME_LIMIT,
        help=f"wall-clock seconds for the whole solve (default {DEFAULT_TIME_LIMIT:g}); past"
        " it, the best schedule found is kept, with its gap",
    )
    p.add_argument(
        "--max_overhead",
        type=float,
        default=None,
        help="with batch auto: the largest predicted step-time overhead over store-all"
        " accepted, in percent (e.g. 10)",
    )
    p.add_argument("--ablation", action="store_true", help="forbid recomputation")
    p.add_argument("--input_grad", action="store_true", help="also compute the input's gradient")
    p.add_argument(
        "--outputs_freed",
        action="store_true",
        help="the training loop drops the model's outputs before backward (loss(model(x))"
        ".backward()); by default the budget holds them to the step's end",
    )
    p.add_argument(
        "--formulation",
        default="compact",
        choices=("compact", "full"),
        help="compact (default): recompute depth 16; full: MONeT's T x V, every ancestor"
        " a candidate and each input freed after its last recomputed reader",
    )
    p.add_argument("--depth", type=positive_int, default=None, help="compact: recompute depth")
    frees = p.add_mutually_exclusive_group()
    frees.add_argument(
        "--frees",
        action="store_true",
        default=None,
        help="compact: free each recomputed input after its last reader, as the full"
        " formulation does, from the start (smaller budgets reachable; slower solves). By"
        " default they are tried after the solve without them, from its schedule, where"
        " their LP leaves room to save 5%% of the step",
    )
    frees.add_argument(
        "--no_frees",
        dest="frees",
        action="store_false",
        help="compact: never the frees (the solve without them only)",
    )
    p.add_argument("--input_shape", help="per-sample input shape without batch, e.g. 3,224,224")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--profile_batch", type=positive_int, help="batch to time at (scaled up)")
    p.add_argument(
        "--autocast",
        default=None,
        help="the training loop runs the forward pass under torch.autocast in this dtype"
        " (bfloat16 or float16)",
    )
    p.add_argument("--output", help="solution file (default: OUTPUT_DIR/solution_...json)")
    p.add_argument("--output_dir", default="solutions", help="folder for the default file name")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a file at the output that is not a schedule of this configuration",
    )
    p.add_argument(
        "--no_zoo",
        action="store_true",
        help="solve even where the zoo (solutions/) has this configuration's schedule",
    )
    p.add_argument("--verbose", action="store_true", help="show the solver's log")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")
    return p


def _check_solve_args(args):
    """Every argument checked before any work starts: one line and exit 2 otherwise."""
    from monet_like.files import writable_folder
    from monet_like.solver import SOLVERS, parse_mode

    if not math.isfinite(args.budget_gb) or args.budget_gb <= 0:
        raise UserError(f"the budget must be a positive number of GB, got {args.budget_gb:g}")
    if args.budget_gb > _MAX_BUDGET_GB:
        raise UserError(f"a budget of {args.budget_gb:g} GB is beyond any machine: a typo?")
    if args.time_limit is not None and not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise UserError(f"--time_limit must be a positive number of seconds, got {args.time_limit}")
    parse_mode(args.mode)
    if args.solver.upper() not in SOLVERS:
        raise UserError(f"unknown solver {args.solver!r}: choose one of {', '.join(SOLVERS)}")
    if args.autocast is not None and args.autocast not in ("bfloat16", "float16"):
        raise UserError(f"--autocast takes bfloat16 or float16, not {args.autocast!r}")
    if args.max_overhead is not None:
        if args.batch != "auto":
            raise UserError("--max_overhead goes with batch auto")
        if not (math.isfinite(args.max_overhead) and args.max_overhead >= 0):
            raise UserError(f"--max_overhead must be a percentage >= 0, got {args.max_overhead}")
    spec, shape, dtype, device = _setup(args)
    args.shape, args.torch_dtype = shape, dtype
    if args.batch == "auto":  # the file is named once the batch is known
        why = writable_folder(args.output or os.path.join(args.output_dir, "solution.json"))
        if why:
            raise UserError(why)
        return spec, shape, dtype, device, None
    out = _output_path(args, spec)
    why = writable_folder(out)
    if why:
        raise UserError(why)
    if args.no_zoo and _is_zoo_file(out):
        raise UserError(f"{out} is the zoo's schedule: give --output for a solve of your own")
    if os.path.exists(out) and not args.force and not _same_configuration(out, spec, args):
        raise UserError(
            f"{out} exists and is not a schedule of this configuration: pass --force to"
            " replace it, or --output another file"
        )
    return spec, shape, dtype, device, out


def _output_path(args, spec) -> str:
    """--output, else MONeT's file name for this configuration in --output_dir."""
    return args.output or os.path.join(
        args.output_dir,
        default_solution_name(spec, args.batch, args.mode, args.budget_gb, **_naming(args)),
    )


def _is_zoo_file(path: str) -> bool:
    from monet_like import zoo

    where = Path(path).resolve()
    return any(where == (zoo.ZOO_DIR / e.file).resolve() for e in zoo.load_index())


def _same_configuration(path: str, spec, args) -> bool:
    """Whether `path` holds a schedule solved for the same model, batch, shape, dtype,
    mode and budget (replacing it with a new solve loses nothing)."""
    from monet_like.solution import SolutionFileError, load

    try:
        sol = load(path)
    except SolutionFileError:
        return False
    return (
        sol.model == spec.expression
        and sol.batch == args.batch
        and tuple(sol.input_shape) == tuple(args.shape)
        and sol.dtype == str(args.torch_dtype).removeprefix("torch.")
        and sol.mode == args.mode
        and sol.budget_bytes == int(args.budget_gb * GIB)
    )


def _from_zoo(args, spec, shape, dtype, device, out) -> dict | None:
    """The zoo's schedule for this configuration, checked and copied to `out`; None
    where the zoo has none (or one for another torch, device kind or graph), said so."""
    from monet_like import zoo
    from monet_like.schedule import build, check_budget
    from monet_like.solution import load
    from monet_like.wrapper import solution_graph

    options = _naming(args)
    options.pop("input_shape"), options.pop("dtype")
    if any(v not in (None, False) for v in options.values()):
        return None  # the zoo holds default formulations only
    dtype_name = str(dtype).removeprefix("torch.")
    budget = int(args.budget_gb * GIB)
    entry = zoo.lookup(spec.expression, args.batch, shape, dtype_name, args.mode, budget)
    if entry is None:
        return None
    if entry.torch_version != torch.__version__ or entry.device != device.type:
        print(
            f"the zoo's {entry.name} was solved with torch {entry.torch_version} on"
            f" {entry.device}; this is torch {torch.__version__} on {device.type}: solving",
            flush=True,
        )
        return None
    path = zoo.resolve(entry.name)
    sol = load(path)
    graph = solution_graph(spec.build("meta"), sol, device)
    if graph.fingerprint != sol.fingerprint:
        print(f"the zoo's {entry.name} is for another graph of this model: solving", flush=True)
        return None
    peak = check_budget(graph, build(graph, sol), sol)  # validated and re-simulated
    if Path(path).resolve() != Path(out).resolve():
        sol.save(out)
    print(
        f"from the zoo: {entry.name} ({entry.solver}, {entry.status}; solved on"
        f" {entry.device}, torch {entry.torch_version})\n"
        f"  predicted peak {peak / GIB:.3f} GB (budget {args.budget_gb:g} GB, store-all"
        f" {sol.store_all_peak_bytes / GIB:.3f} GB); predicted overhead {sol.overhead:+.2%}\n"
        f"  solution written to {out} (--no_zoo solves instead)\n"
        "  check: the schedule validated and simulated on fake tensors within the budget: ok"
    )
    report = sol.summary()
    report.update(solution_file=str(out), overhead=sol.overhead, from_zoo=entry.name)
    return report


def cmd_solve(args) -> dict:
    from monet_like.pipeline import compile_schedule

    spec, shape, dtype, device, out = _check_solve_args(args)
    if args.batch == "auto":
        return _solve_auto(args, spec, shape, dtype, device)
    if not args.no_zoo:
        report = _from_zoo(args, spec, shape, dtype, device, out)
        if report is not None:
            return report
    model = spec.build("cpu").to(device)
    budget = int(args.budget_gb * GIB)
    compiled = compile_schedule(
        model, shape, args.batch, budget, args.mode, args.solver, output=out,
        progress=lambda line: print(line, flush=True), **_compile_options(args, spec, device),
    )  # fmt: skip
    return _report_solution(args, compiled.solution, out)


def _compile_options(args, spec, device) -> dict:
    """solve.py's options as `compile_schedule` takes them."""
    return dict(
        dtype=args.torch_dtype,
        device=device,
        model_name=spec.expression,
        time_limit=args.time_limit,
        formulation=args.formulation,
        depth=args.depth,
        frees=args.frees,
        ablation=args.ablation,
        input_grad=args.input_grad,
        outputs_held=not args.outputs_freed,
        autocast=None if args.autocast is None else getattr(torch, args.autocast),
        profile_batch=args.profile_batch,
        verbose=args.verbose,
    )


def _solve_auto(args, spec, shape, dtype, device) -> dict:
    """solve.py MODEL auto ...: the largest batch whose schedule fits, solved and saved."""
    from monet_like.batch_search import largest_batch

    model = spec.build("cpu").to(device)
    budget = int(args.budget_gb * GIB)
    limit = None if args.max_overhead is None else args.max_overhead / 100
    print(
        f"searching for the largest batch that fits {args.budget_gb:g} GB"
        + ("" if limit is None else f" at a predicted overhead of at most +{limit:.2%}"),
        flush=True,
    )
    found = largest_batch(
        model, shape, budget, args.mode, args.solver, max_overhead=limit,
        progress=lambda line: print(line, flush=True), **_compile_options(args, spec, device),
    )  # fmt: skip
    args.batch = found.batch
    out = _output_path(args, spec)
    found.compiled.solution.save(out)
    nxt = found.probes[-1]
    source = " and ".join(map(str, nxt.estimated_from))
    how = f", estimated from the profiles at batches {source}" if source else ""
    print(f"batch {found.batch} fits; batch {nxt.batch} does not ({nxt.detail}{how})")
    report = _report_solution(args, found.compiled.solution, out)
    report["batches_tried"] = [{"batch": p.batch, "fits": p.fits, "detail": p.detail}
                               for p in found.probes]  # fmt: skip
    return report


def _report_solution(args, sol, out) -> dict:
    """What solve.py prints of a solved schedule, and its JSON report."""
    if sol.gap is None:
        gap = "unknown (stopped before the solver's tolerance; it reports no bound)"
    else:
        gap = f"{sol.step_gap:.3%} of the step ({sol.gap:.2%} of the recomputation)"
        if sol.bound_s is None and sol.status == "optimal" and sol.gap > 0:
            gap = f"<= {gap}, the solver's tolerance (it reports no bound)"
    recomputed = sum(len(s["recompute"]) for s in sol.stages)
    print(
        f"  status {sol.status}; {sum(sol.keep)} of {len(sol.keep)} units kept,"
        f" {recomputed} recomputation{'' if recomputed == 1 else 's'}"
        + (f"; variant sites turned off: {len(sol.variants_off)}" if sol.variants_off else "")
        + (_algorithms(sol.algorithms) if sol.algorithms else "")
        + "\n"
        f"  predicted peak {sol.predicted_peak_bytes / GIB:.3f} GB (budget {args.budget_gb:g} GB,"
        f" store-all {sol.store_all_peak_bytes / GIB:.3f} GB, fixed part"
        f" {sol.fixed_bytes / GIB:.3f} GB)\n"
        f"  predicted step time {sol.predicted_time_s:.3f} s vs store-all"
        f" {sol.store_all_time_s:.3f} s: overhead {sol.overhead:+.2%}{_noise(sol)}\n"
        f"  gap {gap}{_before_frees(sol)}; solve time {sol.solve_time_s:.1f} s; {_first(sol)}\n"
        f"  {_size(sol.stats)}\n"
        f"  solution written to {out}\n"
        "  check: predicted peak <= budget: ok (the schedule simulated on fake tensors,"
        " workspace included)"
    )
    report = sol.summary()
    report.update(
        solution_file=out, predicted_time_s=sol.predicted_time_s, overhead=sol.overhead,
        step_gap=sol.step_gap,
    )  # fmt: skip
    return report


def _before_frees(sol) -> str:
    """Where the frees improved on the search before them, how that search ended: the
    gap above is the frees' formulation's, whose LP bound is far weaker (docs/solver.md),
    so a proved schedule just before them would otherwise read as a poor one."""
    first = sol.stats.get("first_search")
    if not (sol.stats.get("frees_tried") or {}).get("improved") or not first:
        return ""
    if first["status"] == "optimal":
        how = "proved optimal"
    elif first["gap"] is not None:
        how = f"left at a {first['gap']:.2%} gap of its recomputation"
    else:
        how = "left unproved"
    return (
        f" (with the frees, which improved on the schedule without them: {first['recompute_s']:.3f}"
        f" s recomputed, {how} after {first['seconds']:.1f} s; --no_frees stops there)"
    )


def _noise(sol) -> str:
    """' (the profile's timed runs spread 3.1%, its ops timed alone 2.0% off when
    checked)', as far as the profile recorded them."""
    spread = sol.extra.get("profile_time_spread")
    drift = sol.extra.get("profile_alone_drift")
    said = [] if spread is None else [f"the profile's timed runs spread {spread:.1%}"]
    if drift is not None:
        whose = "its" if said else "the profile's"
        said.append(f"{whose} ops timed alone {abs(drift):.1%} off when checked")
        if (after := sol.extra.get("profile_alone_drift_after")) is not None:
            said[-1] += f", {abs(after):.1%} once all were timed again"
    if contended := sol.extra.get("profile_alone_contended"):
        said.append(f"{contended} of them run beside other work, timed again")
    return f" ({', '.join(said)})" if said else ""


def _algorithms(chosen: dict[str, list[int]]) -> str:
    """'; convolution algorithms other than PyTorch's: 5 forward, 3 backward-data, ...'."""
    counts = [sum(1 for a in chosen.values() if a[i] != -1) for i in range(3)]
    named = zip(counts, ("forward", "backward-data", "backward-weight"), strict=True)
    return "; convolution algorithms other than PyTorch's: " + ", ".join(
        f"{n} {what}" for n, what in named
    )


def _first(sol) -> str:
    seconds = sol.stats.get("first_feasible_s")
    if sol.status == "store-all":
        return "store-all needs no solve"
    if sol.stats.get("returned_start"):
        return (
            f"{sol.solver} found no better schedule than the start ({sol.stats['start']},"
            f" {seconds:.1f} s), which is returned"
        )
    if seconds is None:
        return f"time to the first schedule within the budget: not reported by {sol.solver}"
    return f"first schedule within the budget after {seconds:.1f} s"


def _size(stats: dict) -> str:
    if "variables" not in stats:
        return "no MILP needed"
    return (
        f"MILP: {stats['variables']} variables ({stats['binaries']} binary),"
        f" {stats['constraints']} constraints, {stats['nonzeros']} nonzeros"
    )


def solve_main(argv: list[str] | None = None) -> int:
    """Entry point of solve.py: MONeT's argument order."""
    return _run("solve.py", build_solve_parser().parse_args(argv), cmd_solve)
