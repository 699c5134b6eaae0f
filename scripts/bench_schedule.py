"""Replayed schedules on this CPU: measured peak, predicted peak, time against eager.

For each model at a size this CPU steps through in seconds, at budgets from the
store-all peak down to the smallest feasible one: solve (HiGHS, mode normal),
replay with ScheduleWrapper, and measure one step's peak (the CPU allocator's own
events, so workspace counts) and its time against eager PyTorch (steps interleaved:
the median of each pair's ratio, and a 95% interval for it). Writes a CSV and a PNG
of memory against overhead.

    python scripts/bench_schedule.py [--models resnet50,...] [--points 5] [--iterations 5]
        [--fractions 1,0.7,0.5] [--input_shape 3,224,224 --batch 8]
        [--modes normal,inplace_normal,multiway,newnode,conv_normal,inplace_conv_multiway_newnode]

With several modes, each is solved with its variants (the solver may turn sites off
or keep the captured graph) at the same budgets: from the normal store-all peak down
to the smallest budget any of the modes reaches.
"""

import argparse
import os
import statistics
import time
import warnings

import pandas as pd
import torch

from monet_like.graph import default_loss
from monet_like.memory import measure_allocator, state_tensors, training_step
from monet_like.models import make_input, parse_model
from monet_like.pipeline import capture_graphs, compile_schedule, profile_graphs
from monet_like.solver import DEFAULT_DEPTH, InfeasibleBudget, min_feasible_budget
from monet_like.solver.problem import build_problem
from monet_like.wrapper import ScheduleWrapper

warnings.filterwarnings("ignore", category=FutureWarning)
MIB = 2**20
MODELS = {
    "resnet18": ("torchvision.models.resnet18()", (3, 64, 64), 32),
    "resnet50": ("torchvision.models.resnet50()", (3, 64, 64), 16),
    "googlenet": ("torchvision.models.googlenet()", (3, 64, 64), 16),
    "mobilenet_v2": ("torchvision.models.mobilenet_v2()", (3, 64, 64), 32),
    "vgg16": ("torchvision.models.vgg16()", (3, 32, 32), 16),
    "unet": ("unet(base=16)", (3, 128, 128), 4),
}


def step_time(net, x, params_of) -> float:
    params_of.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    default_loss(net(x)).backward()
    return time.perf_counter() - t0


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of `values`: order statistics k and
    n + 1 - k, where the count of values below the true median is binomial(n, 1/2).
    None where too few values give that confidence (5 give 94%, 6 give 97%)."""
    from scipy.stats import binom

    ordered, n = sorted(values), len(values)
    k = 0
    while k + 1 <= n // 2 and 2 * binom.cdf(k, n, 0.5) <= 1 - confidence:
        k += 1  # ranks k + 1 and n - k (1-based) still cover the median so often
    return None if k == 0 else (ordered[k - 1], ordered[n - k])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,googlenet,mobilenet_v2,vgg16,unet")
    ap.add_argument("--modes", default="normal")
    ap.add_argument("--points", type=int, default=4, help="budgets per model")
    ap.add_argument(
        "--fractions",
        help="budgets as fractions of the store-all peak, e.g. 1,0.5 (instead of --points)",
    )
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--input_shape", help="C,H,W for every model (default: its own below)")
    ap.add_argument("--batch", type=int, help="batch for every model (default: its own below)")
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    print(
        f"{'model':12s} {'mode':>24s} {'budget':>9s} {'predicted':>9s} {'measured':>9s}"
        f" {'recomp':>6s} {'off':>4s} {'pred':>7s} {'ratio':>6s} {'95% interval':>13s}"
        "  (MiB; off = variant sites turned off, '-' = captured graph kept; pred = predicted"
        " overhead over eager's store-all step; ratio = median over the interleaved pairs of"
        " the schedule's step time / eager's; interval: for that median, from the pairs'"
        " order statistics, nan below 6 pairs)"
    )
    modes = args.modes.split(",")
    for name in args.models.split(","):
        expression, shape, batch = MODELS[name]
        if args.input_shape:
            shape = tuple(int(d) for d in args.input_shape.split(","))
        batch = args.batch or batch
        torch.manual_seed(0)
        model = parse_model(expression).build()
        setups = {}
        for mode in modes:
            captured, graph = capture_graphs(model, shape, batch, mode, model_name=expression)
            prof, baseline = profile_graphs(model, captured, graph, lines=False)
            reference = prof if baseline is None else baseline[1]
            # Fixed fractions need no smallest budget (a 300 s solve per mode): a budget
            # below it is reported by the solve itself.
            low = (
                0
                if args.fractions
                else min_feasible_budget(build_problem(graph, prof), DEFAULT_DEPTH, False, "HIGHS")
            )
            setups[mode] = low
        store_all = build_problem(captured, reference).store_all_peak_bytes
        x = make_input(model, shape, batch, torch.float32)
        if args.fractions:
            budgets = [int(float(f) * store_all) for f in args.fractions.split(",")]
        else:
            # The MILP's in-stage bound is conservative: at some sizes no schedule it can
            # express beats store-all, and store-all is then the only point.
            low = min(setups.values())
            points = args.points if low < store_all else 1
            low = min(low, store_all)
            budgets = [
                int(low + (1 - k / max(1, points - 1)) * (store_all - low)) for k in range(points)
            ]
        for (k, budget), mode in ((kb, m) for kb in enumerate(budgets) for m in modes):
            if budget < setups[mode]:
                print(f"{name:12s} {mode:>24s} {budget / MIB:9.1f}  below this mode's smallest")
                continue
            path = os.path.join(args.out, f"bench_schedule_{name}_{mode}_{k}.json")
            try:  # the profiles are cached: this captures again and solves
                sol = compile_schedule(
                    model, shape, batch, budget, mode, "HIGHS", model_name=expression,
                    time_limit=300, output=path,
                ).solution  # fmt: skip
            except InfeasibleBudget as exc:
                print(f"{name:12s} {mode:>24s} {budget / MIB:9.1f}  infeasible: {exc}")
                continue
            wrapped = ScheduleWrapper(model, path, shape)
            model.zero_grad(set_to_none=True)
            measured = measure_allocator(
                lambda w=wrapped, x=x: training_step(w, x), [*state_tensors(model), x]
            )
            steps = []  # (eager, replayed) seconds, interleaved
            for k in range(args.iterations + 1):
                eager_s = step_time(model, x, model)
                replay_s = step_time(wrapped, x, model)
                if k:  # the first pair warms up
                    steps.append((eager_s, replay_s))
            pairs = [r / e for e, r in steps]  # each replayed step over the eager one before it
            ratio = statistics.median(pairs)
            interval = median_interval(pairs)
            low_r, high_r = interval if interval else (float("nan"), float("nan"))
            recomputed = sum(len(s["recompute"]) for s in sol.stages)
            off = len(sol.variants_off) if sol.variants else "-"
            rows.append(
                dict(
                    model=name,
                    mode=mode,
                    variants_off=off,
                    budget_mib=budget / MIB,
                    predicted_mib=sol.predicted_peak_bytes / MIB,
                    measured_mib=measured / MIB,
                    store_all_mib=store_all / MIB,
                    recomputations=recomputed,
                    predicted_overhead=sol.overhead,
                    time_ratio=ratio,
                    ratio_of_medians=statistics.median(r for _, r in steps)
                    / statistics.median(e for e, _ in steps),
                    ratio_low=low_r,
                    ratio_high=high_r,
                    pairs=len(pairs),
                )
            )
            print(
                f"{name:12s} {mode:>24s} {budget / MIB:9.1f} {sol.predicted_peak_bytes / MIB:9.1f}"
                f" {measured / MIB:9.1f} {recomputed:6d} {off!s:>4s} {sol.overhead:+7.2%}"
                f" {ratio:6.3f} {low_r:6.3f} {high_r:6.3f}",
                flush=True,
            )
    df = pd.DataFrame(rows)
    df.to_csv(os.path.join(args.out, "bench_schedule.csv"), index=False)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, mode), g in df.groupby(["model", "mode"]):
        ax.plot(
            100 * g["measured_mib"] / g["store_all_mib"],
            100 * (g["time_ratio"] - 1),
            marker="o",
            label=f"{name} {mode}",
        )
    ax.set_xlabel("measured peak, % of the store-all peak")
    ax.set_ylabel("measured overhead vs eager (%)")
    ax.invert_xaxis()
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = os.path.join(args.out, "bench_schedule.png")
    fig.savefig(png, dpi=120)
    print(f"wrote {os.path.join(args.out, 'bench_schedule.csv')} and {png}")


if __name__ == "__main__":
    main()
