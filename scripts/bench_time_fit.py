"""How far a profile's fitted times are from a real step at the solved batch.

    python scripts/bench_time_fit.py [--model "torchvision.models.resnet50()"]
        [--batch 184] [--budgets 10,9,8,7,6,5] [--solver HIGHS] [--repeats 1]

On CPU a profile is taken at batches 4 and 8 and each op's time fitted to the solved
batch as a + b * batch. This script takes such a profile (the cache neither read nor
written), then runs the captured step at the solved batch for real, op by op (one
warm-up run, then `--repeats` timed; the step must fit in the memory available), and
prints the two step times by phase and op class. Then it solves each budget (normal
mode, compact formulation) on both, and prices each schedule with the real step's
times: the fitted profile's predicted overhead, what its schedule costs on the real
times, and the best schedule on the real times (the regret: how much the fit's errors
cost in the choice, not only in the figure).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

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
    started = time.perf_counter()
    fitted = profile(model, graph, repeats=3, use_cache=False, progress=False)
    print(f"profiled in {time.perf_counter() - started:.1f} s: {fitted.workspace_method}")
    started = time.perf_counter()
    real = real_profile(model, graph, fitted, args.repeats)
    print(f"real step timed op by op in {time.perf_counter() - started:.1f} s (with a warm-up)")

    fit_cls, real_cls = by_class(graph, fitted.op_times_s), by_class(graph, real.op_times_s)
    title = f"seconds at batch {args.batch}"
    print(f"\n{title:28s} {'fitted':>8s} {'real':>8s} {'ratio':>6s}")
    for name in sorted(real_cls):
        f, r = fit_cls.get(name, 0.0), real_cls[name]
        print(f"{name:28s} {f:8.2f} {r:8.2f} {r / f if f else float('nan'):6.2f}")
    f, r = fitted.step_time_s, real.step_time_s
    print(f"{'step':28s} {f:8.2f} {r:8.2f} {r / f:6.2f}")
    if fitted.alone_over_fitted is not None:
        alone = dict(fitted.alone_seconds)
        in_real = sum(real.op_times_s[i] for i in alone)
        print(
            f"the {len(alone)} ops run alone at batch {args.batch} for their workspace:"
            f" alone {sum(alone.values()):.2f} s, {fitted.alone_over_fitted:.2f}x their fitted"
            f" times, {sum(alone.values()) / in_real:.2f}x their time in the real step"
        )

    print(
        f"\n{'budget':>7s} {'fitted: predicted':>18s} {'its schedule, real':>19s}"
        f" {'best on real':>13s} {'regret':>7s}"
    )
    for gb in (float(b) for b in args.budgets.split(",")):
        budget = int(gb * GIB)
        common = {"mode": "normal", "solver": args.solver, "time_limit": args.time_limit}
        on_fit = solve(graph, fitted, budget, frees=False, **common)
        on_real = solve(graph, real, budget, frees=False, **common)
        predicted = recompute_on(on_fit, fitted) / fitted.step_time_s
        its_real = recompute_on(on_fit, real) / real.step_time_s
        best = recompute_on(on_real, real) / real.step_time_s
        print(
            f"{gb:5g} GB {predicted:+17.2%} {its_real:+19.2%} {best:+13.2%}"
            f" {100 * (its_real - best):6.2f}p"
            + ("" if on_fit.status == on_real.status == "optimal" else " (not all proved)"),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
