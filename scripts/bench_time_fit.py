"""How far a CPU profile's times are from a real step at the solved batch.

    python scripts/bench_time_fit.py [--model "torchvision.models.resnet50()"]
        [--batch 184] [--budgets 10,9,8,7,6,5] [--solver HIGHS] [--repeats 1] [--whole]

On CPU a profile is taken at batch 4 (and 8), and its times at the solved batch come
from each distinct op run alone there (`profile`'s default; at a quarter of a large
batch and scaled but for the convolutions), or, where too few ops can run alone, from a
fit a + b * batch of timed runs at batches 4 and 8. This script takes both profiles side
by side (the cache neither read nor written; the fit forced for the second; with
`--whole`, a third between them with every op alone at the batch itself), then runs
the captured step at the solved batch for real, op by op (one warm-up run, then
`--repeats` timed; the step must fit in the memory available), and prints the step's
times by phase and op class. Then it solves each budget (normal
mode, compact formulation) on each profile and on the real times, and prices each
schedule with the real step's times: the profile's predicted overhead, what its
schedule costs on the real times, and the best schedule on the real times (the
regret: how much the profile's errors cost in the choice, not only in the figure).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from unittest import mock

import torch

import monet_like.profile as profile_module
from monet_like.graph import FORWARD, capture
from monet_like.memory import store_all_peak
from monet_like.models import parse_model
from monet_like.profile import _real_args, _with_op_times, profile
from monet_like.profile.timing import _median_times, _OpRunner
from monet_like.profile.workspace import _available_memory_bytes
from monet_like.solver import solve
from monet_like.units import GIB


def real_profile(model, graph, fitted, repeats: int):
    """`fitted` with every op's time taken from a real step of `graph` at its own batch."""
    device = torch.device("cpu")
    runner = _OpRunner(graph, device)
    args = _real_args(model, graph, device, torch.float32)
    times = _median_times(runner, args, repeats, lambda _n: None)
    return _with_op_times(fitted, graph, times)


def by_class(graph, times) -> dict[str, float]:
    """Seconds per (phase, convolution or other)."""
    out: collections.Counter = collections.Counter()
    for op in graph.ops:
        phase = "forward" if op.phase == FORWARD else "backward"
        kind = "convolution" if "conv" in str(op.target) else "other"
        out[f"{phase} {kind}"] += times[op.index]
    return dict(out)


def recompute_on(sol, prof) -> float:
    """Seconds `sol`'s recomputations take with `prof`'s node times."""
    node_s = {n.node: n.recompute_s for n in prof.nodes}
    return sum(
        node_s.get(n, 0.0) for stage in sol.stages for u in stage["recompute"] for n in sol.units[u]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="torchvision.models.resnet50()")
    ap.add_argument("--batch", type=int, default=184)
    ap.add_argument("--input_shape", default="3,224,224")
    ap.add_argument("--budgets", default="10,9,8,7,6,5", help="GB")
    ap.add_argument("--solver", default="HIGHS")
    ap.add_argument("--time_limit", type=float, default=300)
    ap.add_argument("--repeats", type=int, default=1, help="timed real steps (median)")
    ap.add_argument(
        "--whole",
        action="store_true",
        help="also a profile with every op alone at the batch (none at a quarter of it)",
    )
    args = ap.parse_args(argv)
    shape = tuple(int(v) for v in args.input_shape.split(","))
    torch.manual_seed(0)
    model = parse_model(args.model).build("cpu")
    graph = capture(model, shape, args.batch, model_name=args.model)
    needed, available = store_all_peak(graph), _available_memory_bytes() or 0
    if needed > 0.9 * available:
        sys.exit(
            f"a real step at batch {args.batch} needs {needed / GIB:.1f} GiB, "
            f"{available / GIB:.1f} GiB is available: try a smaller --batch"
        )
    profiles = {}
    least = profile_module.workspace.ALONE_REDUCED_LEAST
    methods = [("alone", profile_module.ALONE_COVERAGE, least)]
    if args.whole:  # every op alone at the batch itself, none at a quarter of it
        methods.append(("whole", profile_module.ALONE_COVERAGE, args.batch + 1))
    methods.append(("fit", 1.01, least))
    for method, coverage, least in methods:
        started = time.perf_counter()
        with (
            mock.patch.object(profile_module, "ALONE_COVERAGE", coverage),
            mock.patch.object(profile_module.workspace, "ALONE_REDUCED_LEAST", least),
        ):
            profiles[method] = profile(model, graph, repeats=3, use_cache=False, progress=False)
        print(
            f"{method}: profiled in {time.perf_counter() - started:.1f} s;"
            f" times: {profiles[method].time_method}"
        )
    started = time.perf_counter()
    real = real_profile(model, graph, profiles["alone"], args.repeats)
    print(f"real step timed op by op in {time.perf_counter() - started:.1f} s (with a warm-up)")

    classes = {m: by_class(graph, p.op_times_s) for m, p in profiles.items()}
    real_cls = by_class(graph, real.op_times_s)
    print(
        f"\nseconds at batch {args.batch:<11d} {'real':>8s}"
        + "".join(f" {m:>8s} {'ratio':>6s}" for m in profiles)
    )
    rows = [
        (name, real_cls[name], {m: classes[m].get(name, 0.0) for m in profiles})
        for name in sorted(real_cls)
    ]
    rows.append(("step", real.step_time_s, {m: p.step_time_s for m, p in profiles.items()}))
    for name, r, by_method in rows:
        print(
            f"{name:28s} {r:8.2f}"
            + "".join(f" {t:8.2f} {t / r if r else float('nan'):6.2f}" for t in by_method.values())
        )

    print(
        f"\n{'budget':>7s} {'profile':>7s} {'predicted':>10s} {'its schedule, real':>19s}"
        f" {'best on real':>13s} {'regret':>7s}"
    )
    common = {"mode": "normal", "solver": args.solver, "time_limit": args.time_limit}
    for gb in (float(b) for b in args.budgets.split(",")):
        budget = int(gb * GIB)
        on_real = solve(graph, real, budget, frees=False, **common)
        best = recompute_on(on_real, real) / real.step_time_s
        for method, prof in profiles.items():
            on_prof = solve(graph, prof, budget, frees=False, **common)
            predicted = recompute_on(on_prof, prof) / prof.step_time_s
            its_real = recompute_on(on_prof, real) / real.step_time_s
            proved = on_prof.status == on_real.status == "optimal"
            print(
                f"{gb:5g} GB {method:>7s} {predicted:+10.2%} {its_real:+19.2%} {best:+13.2%}"
                f" {100 * (its_real - best):6.2f}p" + ("" if proved else " (not all proved)"),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
