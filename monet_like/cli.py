"""Command line: `python -m monet_like COMMAND ...`.

  profile MODEL BATCH   capture the graph, predict the store-all peak, profile every node
  memory  MODEL BATCH   capture and predict only (nothing allocated: any batch size)
  frontier MODEL BATCH  budgets from store-all down, measured beside PyTorch's own tools
  zoo list|verify|download   the solution zoo

Bad input gets one line on stderr and exit code 2; with --json the last line of
standard output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch

from monet_like.errors import UserError
from monet_like.units import GIB

DEFAULT_TIME_LIMIT = 600.0  # seconds: "solved in minutes"; the start is kept if nothing better
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, as for every other bad input
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_dtype(text: str) -> torch.dtype:
    dtype = _DTYPES.get(text.lower().removeprefix("torch."))
    if dtype is None:
        raise UserError(
            f"dtype {text!r} is not one a model can train in: use float32, bfloat16, "
            "float16 or float64"
        )
    return dtype


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def batch_or_auto(text: str) -> int | str:
    """A batch size, or "auto" (solve.py: the largest batch whose schedule fits)."""
    return "auto" if text.strip().lower() == "auto" else positive_int(text)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help='"torchvision.models.NAME(...)", unet, gpt, or pkg.module:factory')
    p.add_argument("batch", type=positive_int, help="batch size")
    p.add_argument("--input_shape", help="per-sample input shape without batch, e.g. 3,224,224")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="monet_like", description="schedule compiler for memory-bounded training")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    prof = sub.add_parser("profile", help="capture, predict the store-all peak, profile nodes")
    _add_model_args(prof)
    prof.add_argument("--profile_batch", type=positive_int, help="batch to time at (scaled up)")
    prof.add_argument("--repeats", type=positive_int, default=3, help="timed runs (median)")
    prof.add_argument("--no_cache", action="store_true", help="ignore and do not write the cache")
    prof.add_argument("--csv", help="write the per-node profile to this CSV file")
    mem = sub.add_parser("memory", help="capture and predict the store-all peak only")
    _add_model_args(mem)
    mem.add_argument("--simulate", action="store_true", help="also run a fake-tensor eager step")
    front = sub.add_parser(
        "frontier", help="budgets from store-all down, measured beside PyTorch's own tools"
    )
    _add_model_args(front)
    front.add_argument("--modes", default="normal", help="modes to sweep, comma-separated")
    front.add_argument(
        "--fractions",
        default="1,0.75,0.5,0.25,0",
        help="budgets between each mode's smallest (0) and the store-all peak (1)",
    )
    front.add_argument("--budgets", help="budgets in GB instead of --fractions, e.g. 0.15,0.14")
    front.add_argument(
        "--activation",
        help="budgets instead as fractions of eager's activation memory, e.g. 0.75,0.5",
    )
    front.add_argument("--solver", default="HIGHS")
    front.add_argument("--time_limit", type=float, default=120.0, help="seconds per solve")
    front.add_argument("--repeats", type=positive_int, default=5, help="timed steps per point")
    front.add_argument("--no_peers", action="store_true", help="monet_like's schedules only")
    front.add_argument("--out", default="frontier", help="folder for frontier.csv and .png")
    zoo = sub.add_parser("zoo", help="the solution zoo: list, verify, download")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True, parser_class=_Parser)
    listing = zoo_sub.add_parser("list", help="the zoo as MONeT's results tables")
    listing.add_argument("--model", help="only entries whose model expression contains this")
    listing.add_argument("--json", action="store_true", help="the index's entries as JSON")
    verify = zoo_sub.add_parser("verify", help="check every local file against the index")
    verify.add_argument("--json", action="store_true")
    get = zoo_sub.add_parser("download", help="fetch entries from a mirror, sha256 checked")
    get.add_argument("names", nargs="*", help="entry names (zoo list --json shows them)")
    get.add_argument("--all", action="store_true", help="every entry of the index")
    get.add_argument("--url", help="the mirror's base address (default: $MONET_LIKE_ZOO_URL)")
    get.add_argument("--dest", help="folder to put them in (default: the cache's zoo/)")
    get.add_argument("--retries", type=positive_int, default=3)
    get.add_argument("--timeout", type=float, default=30.0, help="seconds per connection")
    get.add_argument("--json", action="store_true")
    return parser


def cmd_frontier(args) -> dict:
    from monet_like import frontier
    from monet_like.files import writable_folder
    from monet_like.solver import SOLVERS, parse_mode

    modes = tuple(m for m in args.modes.split(",") if m)
    for mode in modes:
        parse_mode(mode)
    if args.solver.upper() not in SOLVERS:
        raise UserError(f"unknown solver {args.solver!r}: choose one of {', '.join(SOLVERS)}")
    fractions = _numbers(args.fractions, "--fractions", 0.0, 1.0)
    budgets = _numbers(args.budgets, "--budgets", 1e-9, _MAX_BUDGET_GB) if args.budgets else ()
    activation = _numbers(args.activation, "--activation", 0.0, 1.0) if args.activation else ()
    if budgets and activation:
        raise UserError("give --budgets or --activation, not both")
    why = writable_folder(os.path.join(args.out, "frontier.csv"))
    if why:
        raise UserError(why)
    spec, shape, dtype, device = _setup(args)
    if dtype != torch.float32:
        raise UserError("frontier measures float32 training steps: leave --dtype out")
    model = spec.build("cpu").to(device)
    points = frontier.frontier(
        model, shape, args.batch, modes, fractions, args.solver.upper(),
        budgets_bytes=tuple(int(b * GIB) for b in budgets), activation_fractions=activation,
        peers=not args.no_peers,
        repeats=args.repeats, time_limit=args.time_limit, device=device,
        progress=lambda line: print(line, flush=True),
    )  # fmt: skip
    print(frontier.table(points))
    title = f"{spec.expression}, batch {args.batch}, input {'x'.join(map(str, shape))}, {device}"
    csv, png = frontier.write(points, args.out, title)
    print(f"wrote {csv} and {png}")
    return {"points": [p.__dict__ for p in points], "csv": str(csv), "png": str(png)}


def _numbers(text: str, option: str, low: float, high: float) -> tuple[float, ...]:
    """Comma-separated numbers within [low, high], or one line saying which is not."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{option} takes comma-separated numbers, got {text!r}") from None
    bad = [v for v in values if not (math.isfinite(v) and low <= v <= high)]
    if not values or bad:
        raise UserError(f"{option}: every value must be within [{low:g}, {high:g}], got {text!r}")
    return values


def cmd_zoo(args) -> dict:
    from monet_like import zoo

    entries = zoo.load_index()
    if args.zoo_command == "list":
        if args.model:
            entries = [e for e in entries if args.model in e.model]
        if not entries:
            print("the zoo has no entry" + (f" for {args.model!r}" if args.model else ""))
        elif not args.json:
            print(zoo.tables(entries, zoo.load_infeasible()))
            print("cells: predicted overhead over the store-all step (predicted peak, GB);")
            print("use one as ScheduleWrapper(model, 'zoo:NAME', input_shape), NAME from")
            print("`python -m monet_like zoo list --json`")
        return {"entries": [e.__dict__ | {"input_shape": list(e.input_shape)} for e in entries]}
    if args.zoo_command == "verify":
        problems = zoo.verify()
        for line in problems:
            print(f"  {line}")
        print(f"{len(entries)} entries, {len(problems)} problems")
        if problems:
            args.failed_report = {"problems": problems}
            raise CheckFailed(f"{len(problems)} zoo entries do not match the index")
        return {"entries": len(entries), "problems": []}
    if args.all == bool(args.names):
        raise UserError("name the entries to download, or give --all")
    wanted = entries if args.all else [zoo.find(n) for n in args.names]
    fetched = []
    for entry in wanted:
        path = zoo.download(entry, args.url, args.dest, args.retries, args.timeout)
        print(f"  {entry.name}: {path}")
        fetched.append(str(path))
    return {"downloaded": fetched}


def _setup(args):
    from monet_like.models import parse_input_shape, parse_model

    spec = parse_model(args.model)
    if args.input_shape:
        shape = parse_input_shape(args.input_shape)
    else:
        shape = spec.default_input_shape()
        if shape is None:
            raise UserError(f"{args.model}: give the per-sample input shape with --input_shape")
    dtype = parse_dtype(args.dtype)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {args.device!r}: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {args.device!r} is not supported: use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA device is available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} GPUs")
    return spec, shape, dtype, device


def _memory_report(graph) -> dict:
    from monet_like.memory import fixed_bytes, store_all_timeline

    fixed = fixed_bytes(graph)
    timeline = store_all_timeline(graph)
    peak_op = graph.ops[timeline.peak_op]
    return {
        "model": graph.model,
        "batch": graph.batch,
        "input_shape": list(graph.input_shape),
        "dtype": graph.dtype,
        "nodes": len(graph.nodes),
        "aten_ops": len(graph.ops),
        "fingerprint": graph.fingerprint,
        "fixed_bytes": fixed.total,
        "param_bytes": fixed.params,
        "buffer_bytes": fixed.buffers,
        "grad_bytes": fixed.grads,
        "input_bytes": fixed.input,
        "store_all_peak_bytes": timeline.peak_bytes,
        "store_all_peak_at": f"{peak_op.phase} {peak_op.name}",
    }


def _print_memory(r: dict, out) -> None:
    print(
        f"{r['model']}  batch {r['batch']}  input {tuple(r['input_shape'])}  {r['dtype']}\n"
        f"  graph: {r['nodes']} nodes from {r['aten_ops']} aten ops"
        f" (fingerprint {r['fingerprint']})\n"
        f"  fixed: {r['fixed_bytes'] / GIB:.3f} GiB = params {r['param_bytes'] / GIB:.3f}"
        f" + grads {r['grad_bytes'] / GIB:.3f} + buffers {r['buffer_bytes'] / GIB:.3f}"
        f" + input {r['input_bytes'] / GIB:.3f}\n"
        f"  predicted store-all peak of one training step:"
        f" {r['store_all_peak_bytes'] / GIB:.3f} GiB"
        f" (reached at {r['store_all_peak_at']})",
        file=out,
    )


def cmd_memory(args) -> dict:
    from monet_like.graph import capture
    from monet_like.memory import simulate

    spec, shape, dtype, device = _setup(args)
    started = time.perf_counter()
    model = spec.build("meta")
    graph = capture(model, shape, args.batch, dtype, device, spec.expression)
    report = _memory_report(graph)
    report["device"] = str(device)
    report["seconds"] = round(time.perf_counter() - started, 3)
    _print_memory(report, sys.stdout)
    if args.simulate:
        sim = simulate(model, shape, args.batch, dtype, device)
        report["simulated_peak_bytes"] = sim.peak_bytes
        print(f"  simulated eager step on fake tensors:         {sim.peak_bytes / GIB:.3f} GiB")
    print(f"  ({report['seconds']:.1f} s, nothing allocated)")
    return report


def cmd_profile(args) -> dict:
    from monet_like.graph import capture
    from monet_like.profile import profile

    spec, shape, dtype, device = _setup(args)
    model = spec.build("cpu").to(device)
    graph = capture(model, shape, args.batch, dtype, device, spec.expression)
    report = _memory_report(graph)
    _print_memory(report, sys.stdout)
    prof = profile(
        model,
        graph,
        profile_batch=args.profile_batch,
        device=device,
        repeats=args.repeats,
        use_cache=not args.no_cache,
    )
    how = "from the cache" if prof.cached else f"in {prof.profile_seconds:.1f} s"
    scaled = (
        f", times scaled x{prof.batch / prof.profile_batch:g} from batch {prof.profile_batch}"
        if prof.scaled
        else ""
    )
    print(f"  profile on {prof.device} ({how}{scaled}); workspace: {prof.workspace_method}")
    print(
        f"  step time {prof.step_time_s * 1e3:.1f} ms = forward {prof.op_forward_s * 1e3:.1f}"
        f" + backward {prof.op_backward_s * 1e3:.1f}"
        + ("" if prof.time_spread is None else f"; timed runs spread {prof.time_spread:.1%}")
    )
    df = prof.to_dataframe()
    top = df.sort_values("output_bytes", ascending=False).head(5)
    print("  largest node outputs:")
    for row in top.itertuples():
        print(
            f"    {row.name:28s} {row.kind:24s} {row.output_bytes / 2**20:10.1f} MiB"
            f"  fwd {row.forward_s * 1e3:8.2f} ms  bwd {row.backward_s * 1e3:8.2f} ms"
        )
    if args.csv:
        prof.to_csv(args.csv)
        print(f"  per-node profile written to {args.csv}")
    report.update(
        device=prof.device,
        profile_batch=prof.profile_batch,
        scaled=prof.scaled,
        cached=prof.cached,
        step_time_s=prof.step_time_s,
        forward_time_s=prof.op_forward_s,
        backward_time_s=prof.op_backward_s,
        time_spread=prof.time_spread,
    )
    return report


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
    p.add_argument(
        "--frees",
        action="store_true",
        help="compact: free each recomputed input after its last reader, as the full"
        " formulation does (smaller budgets reachable; slower solves)",
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


def default_solution_name(spec, batch: int, mode: str, budget_gb: float, **config) -> str:
    """MONeT's file name, `solution_<model>_<batch>_<mode>_<budget>.json`, with what else
    makes a schedule different appended where it is not the default: a short hash of the
    model's arguments, the input shape, the dtype, and the options in `config` (name ->
    value; a value that is False, None or the default is left out)."""
    import hashlib

    parts = [spec.name, str(batch), mode, f"{budget_gb:g}"]
    if spec.args or spec.kwargs:
        parts.append(hashlib.sha256(repr((spec.args, spec.kwargs)).encode()).hexdigest()[:8])
    shape = config.pop("input_shape", None)
    if shape is not None and tuple(shape) != spec.default_input_shape():
        parts.append("x".join(str(d) for d in shape))
    dtype = config.pop("dtype", "float32")
    if dtype != "float32":
        parts.append(dtype)
    for name, value in config.items():
        if value is True:
            parts.append(name)
        elif value not in (None, False):
            parts.append(f"{name}{value}")
    return "solution_" + "_".join(parts) + ".json"


_MAX_BUDGET_GB = 2.0**20  # a PiB: beyond any machine, so a typo rather than a budget


def _naming(args) -> dict:
    """The options that make a schedule different, for its default file name."""
    return dict(
        input_shape=getattr(args, "shape", None),
        dtype=str(args.torch_dtype).removeprefix("torch."),
        full=args.formulation == "full" if hasattr(args, "formulation") else False,
        depth=getattr(args, "depth", None),
        frees=getattr(args, "frees", False),
        ablation=getattr(args, "ablation", False),
        inputgrad=getattr(args, "input_grad", False),
        outputsfreed=getattr(args, "outputs_freed", False),
        autocast=getattr(args, "autocast", None),
    )


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
    out = args.output or os.path.join(
        args.output_dir,
        default_solution_name(spec, args.batch, args.mode, args.budget_gb, **_naming(args)),
    )
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
    out = args.output or os.path.join(
        args.output_dir,
        default_solution_name(spec, args.batch, args.mode, args.budget_gb, **_naming(args)),
    )
    found.compiled.solution.save(out)
    nxt = found.probes[-1]
    print(
        f"batch {found.batch} fits; batch {nxt.batch} does not ({nxt.detail}, estimated"
        f" from the profiles at batches {' and '.join(map(str, nxt.estimated_from))})"
    )
    report = _report_solution(args, found.compiled.solution, out)
    report["batches_tried"] = [{"batch": p.batch, "fits": p.fits, "detail": p.detail}
                               for p in found.probes]  # fmt: skip
    return report


def _report_solution(args, sol, out) -> dict:
    """What solve.py prints of a solved schedule, and its JSON report."""
    if sol.gap is None:
        gap = "unknown (stopped before the solver's tolerance; it reports no bound)"
    elif sol.bound_s is None and sol.status == "optimal" and sol.gap > 0:
        gap = f"<= {sol.gap:.2%} (the solver's tolerance; it reports no bound)"
    else:
        gap = f"{sol.gap:.2%}"
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
        f"  gap {gap}; solve time {sol.solve_time_s:.1f} s; {_first(sol)}\n"
        f"  {_size(sol.stats)}\n"
        f"  solution written to {out}\n"
        "  check: predicted peak <= budget: ok (the schedule simulated on fake tensors,"
        " workspace included)"
    )
    report = sol.summary()
    report.update(solution_file=out, predicted_time_s=sol.predicted_time_s, overhead=sol.overhead)
    return report


def _noise(sol) -> str:
    """' (the profile's timed runs spread 3.1%)', where the profile recorded it."""
    spread = sol.extra.get("profile_time_spread")
    return "" if spread is None else f" (the profile's timed runs spread {spread:.1%})"


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


def build_check_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="schedule.py", description="replay a solved schedule and check it")
    p.add_argument("model", help='"torchvision.models.NAME(...)", unet, gpt, or pkg.module:factory')
    p.add_argument("batch", type=positive_int, help="batch size")
    p.add_argument("budget_gb", type=float, help="the budget the schedule was solved for (GB)")
    p.add_argument("mode", help="the mode it was solved in")
    p.add_argument("solver", help="the solver it was solved with")
    p.add_argument(
        "--solution_file", help="a file or zoo:NAME (default: solutions/solution_<model>_...json)"
    )
    p.add_argument("--input_shape", help="per-sample input shape without batch, e.g. 3,224,224")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--run_bs", action="store_true", help="one step: measured peak and time")
    p.add_argument("--check_runtime", action="store_true", help="time vs eager, interleaved")
    p.add_argument("--iterations", type=positive_int, default=5, help="for --check_runtime")
    p.add_argument("--check_diff", action="store_true", help="outputs and gradients vs eager")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")
    return p


class CheckFailed(Exception):
    """schedule.py's check found the peak over budget or the gradients off: exit 1."""


def cmd_check(args) -> dict:
    import copy
    import statistics

    from monet_like.graph import default_loss
    from monet_like.models import make_input
    from monet_like.variants.conv import eager_with_algorithms
    from monet_like.verify import (
        ROUNDING_RATIO,
        VARIANT_TOLERANCE,
        autocast_context,
        compare_steps,
        full_float32,
        measured_peak,
        runs_native_lstm,
        training_step,
        with_float64_ratio,
    )
    from monet_like.wrapper import ScheduleWrapper

    spec, shape, dtype, device = _setup(args)
    args.shape, args.torch_dtype = shape, dtype
    path = args.solution_file or os.path.join(
        "solutions",
        default_solution_name(spec, args.batch, args.mode, args.budget_gb, **_naming(args)),
    )
    torch.manual_seed(0)
    model = spec.build("cpu").to(device=device, dtype=dtype)
    wrapped = ScheduleWrapper(model, path, shape)  # refuses a file that does not fit
    sol = wrapped.solution
    if sol.batch != args.batch:
        raise UserError(f"{path} was solved for batch {sol.batch}, not {args.batch}")
    report = {
        "solution_file": str(path),
        "predicted_peak_bytes": sol.predicted_peak_bytes,
        "budget_bytes": sol.budget_bytes,
    }
    print(f"{spec.expression} batch {args.batch}: schedule {path} ({sol.status}, {sol.mode})")
    x = make_input(model, shape, args.batch, dtype, device).requires_grad_(sol.input_grad)
    failures = []
    if args.run_bs or not (args.check_runtime or args.check_diff):
        t0 = time.perf_counter()
        peak = measured_peak(wrapped, x)
        seconds = time.perf_counter() - t0
        report.update(measured_peak_bytes=peak, step_time_s=seconds)
        ok = peak <= sol.budget_bytes
        how = "CPU allocator" if device.type == "cpu" else "CUDA allocator"
        print(
            f"  one step: measured peak {peak / GIB:.4f} GB ({how}), predicted"
            f" {sol.predicted_peak_bytes / GIB:.4f} GB, budget {sol.budget_bytes / GIB:.4f}"
            f" GB: {'within budget' if ok else 'OVER BUDGET'}; {seconds:.2f} s (measured)"
        )
        if not ok:
            failures.append("the measured peak exceeds the budget")
    if args.check_diff:
        replayed = copy.deepcopy(model)
        wrapped_copy = ScheduleWrapper(replayed, path, shape)
        references = [("eager PyTorch", "", copy.deepcopy(model))]
        if sol.algorithms:
            # The replay's own exactness: eager PyTorch running the same convolution
            # algorithms. Against plain eager, im2col's other summation order can flip
            # a value at a ReLU's threshold, and that moves every gradient below it.
            same = eager_with_algorithms(model, wrapped.graph, sol.algorithms)
            label = "eager PyTorch with the same convolution algorithms"
            references.append((label, "_same_kernels", same))
        if device.type == "cuda":
            print("  compared in full float32 (TF32 off on both sides)")
        with full_float32():
            replay_step = training_step(wrapped_copy, replayed, x, sol.input_grad, sol.autocast)
        for label, suffix, eager in references:
            with full_float32():
                eager_step = training_step(eager, eager, x, sol.input_grad, sol.autocast)
            diff = compare_steps(eager, eager_step, replayed, replay_step)
            report.update({f"{key}{suffix}": value for key, value in diff.as_dict().items()})
            if diff.max_abs_input_grad_diff is not None:
                print(
                    f"  input gradient vs {label}: largest difference"
                    f" {diff.max_abs_input_grad_diff:.3g}"
                )
            print(
                f"  vs {label}: largest output difference {diff.max_abs_output_diff:.3g},"
                f" gradient {diff.max_abs_grad_diff:.3g} absolute,"
                f" {diff.max_rel_grad_diff:.3g} relative, buffers {diff.max_abs_buffer_diff:.3g}"
            )
        # The verdict, against the reference running the replay's kernels: bitwise where
        # those are eager's own, within VARIANT_TOLERANCE where variants or a CPU LSTM run.
        bitwise = not sol.variants and not runs_native_lstm(model, device)
        rule = "bitwise" if bitwise else f"within {VARIANT_TOLERANCE:g} relative"
        if not bitwise:
            diff = with_float64_ratio(diff, model, x, sol, eager, eager_step, replayed, replay_step)
        ratio = diff.float64_error_ratio
        if ratio is not None:
            print(
                f"  vs the same step in float64: the replay's error is at most {ratio:.2f}"
                f" times eager's own, tensor by tensor (rounding: <= {ROUNDING_RATIO:g})"
            )
            rule += f", or rounding against float64 (<= {ROUNDING_RATIO:g} times eager's)"
            report["float64_error_ratio"] = ratio
        exact = diff.bitwise if bitwise else diff.within(VARIANT_TOLERANCE)
        print(f"  check: equal to {label} ({rule}): {'ok' if exact else 'FAILED'}")
        report["exact"] = exact
        if not exact:
            failures.append(f"the replay differs from {label} beyond {rule}")
    if args.check_runtime:
        times: dict[str, list[float]] = {"eager": [], "schedule": []}
        for _ in range(args.iterations + 1):  # interleaved; the first pair warms up
            for name, net in (("eager", model), ("schedule", wrapped)):
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                with autocast_context(device.type, sol.autocast):
                    out = net(x)
                default_loss(out).backward()
                del out
                times[name].append(time.perf_counter() - t0)
        eager_s = statistics.median(times["eager"][1:])
        sched_s = statistics.median(times["schedule"][1:])
        report.update(time_ratio=sched_s / eager_s, eager_step_s=eager_s, schedule_step_s=sched_s)
        print(
            f"  step time: schedule {sched_s:.3f} s, eager {eager_s:.3f} s, ratio"
            f" {sched_s / eager_s:.3f} (median of {args.iterations}, interleaved)"
        )
    if failures:
        args.failed_report = report
        raise CheckFailed("; ".join(failures))
    return report


def check_main(argv: list[str] | None = None) -> int:
    """Entry point of schedule.py."""
    return _run("schedule.py", build_check_parser().parse_args(argv), cmd_check)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {
        "profile": cmd_profile,
        "memory": cmd_memory,
        "zoo": cmd_zoo,
        "frontier": cmd_frontier,
    }
    return _run("monet_like", args, commands[args.command])


class Terminated(KeyboardInterrupt):
    """SIGTERM, taken like Ctrl-C: every `finally` runs (the solver's racing processes
    are stopped, no file is left half written)."""


def _terminate(signum, frame):
    raise Terminated()


def _run(prog: str, args, command) -> int:
    """Run a command: one line on stderr and exit 2 for the user's errors, 1 for a check
    that failed, the JSON report as the last line of stdout with --json."""
    from monet_like.solver import InfeasibleBudget

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        report = command(args)
    except InfeasibleBudget as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        if args.json:
            print(
                json.dumps(
                    {
                        "status": "infeasible",
                        "min_feasible_budget_bytes": exc.min_budget_bytes,
                        "fixed_bytes": exc.fixed_bytes,
                    }
                )
            )
        return 2
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except CheckFailed as exc:
        print(f"{prog}: check failed: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps(getattr(args, "failed_report", {})))
        return 1
    except Terminated:
        print(f"{prog}: terminated; nothing written", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; nothing written", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
