"""python -m monet_like profile | memory | frontier | zoo."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from monet_like.cli.common import (
    _MAX_BUDGET_GB,
    CheckFailed,
    _add_model_args,
    _numbers,
    _Parser,
    _run,
    _setup,
    positive_int,
)
from monet_like.errors import UserError
from monet_like.units import GIB


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
    front.add_argument(
        "--frees", action="store_true", default=None, help="solve.py's --frees for each solve"
    )
    front.add_argument("--no_peers", action="store_true", help="monet_like's schedules only")
    front.add_argument(
        "--outputs_freed",
        action="store_true",
        help="every tool's loop drops the model's outputs before backward (loss(model(x))"
        ".backward()), as solve.py's --outputs_freed; by default they are held",
    )
    front.add_argument(
        "--predict_batch",
        type=positive_int,
        help="also monet_like's schedules at this batch, predicted, not run (too large here)",
    )
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
        frees=args.frees, peers=not args.no_peers, predict_batch=args.predict_batch,
        repeats=args.repeats, time_limit=args.time_limit, device=device,
        progress=lambda line: print(line, flush=True), outputs_held=not args.outputs_freed,
    )  # fmt: skip
    for batch in dict.fromkeys(b for b in (args.batch, args.predict_batch) if b):
        points += frontier.published(model, spec.expression, batch, shape)
    print(frontier.table(points))
    title = f"{spec.expression}, batch {args.batch}, input {'x'.join(map(str, shape))}, {device}"
    if args.predict_batch:
        title += f"; dashed: monet_like at batch {args.predict_batch}, predicted"
    csv, png = frontier.write(points, args.out, title)
    print(f"wrote {csv} and {png}")
    return {"points": [p.__dict__ for p in points], "csv": str(csv), "png": str(png)}


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
    print(f"  profile on {prof.device} ({how}); workspace: {prof.workspace_method}")
    if prof.time_method:  # '' in a profile cached by an older release
        print(f"  times: {prof.time_method}")
    if prof.stage_seconds and not prof.cached:
        print(
            "  profiling took " + ", ".join(f"{k} {v:.1f} s" for k, v in prof.stage_seconds.items())
        )
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
        alone_drift=prof.alone_drift,
        alone_drift_after=prof.alone_drift_after,
        alone_contended=prof.alone_contended,
        alone_retimed=prof.alone_retimed,
        time_method=prof.time_method,
    )
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {
        "profile": cmd_profile,
        "memory": cmd_memory,
        "zoo": cmd_zoo,
        "frontier": cmd_frontier,
    }
    return _run("monet_like", args, commands[args.command])
