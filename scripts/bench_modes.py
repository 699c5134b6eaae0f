"""MONeT's modes compared: smallest feasible budget and predicted overhead per mode.

For each model at MONeT's batch size and each mode (normal, inplace, multiway,
newnode, conv, and all four together), the graph is rewritten with the mode's
variants, profiled on this machine (each mode's own ops timed), and
solved with HiGHS: the smallest feasible budget (the min-memory problem), then the
predicted overhead at each budget over the store-all step of the graph the schedule
runs on (the solver may turn variant sites off, or keep another graph: the captured
one, or in the full mode the one with the convolution algorithms alone; marked '*',
the CSV's kept_variants says which); the CSV also has it against the normal step. A
variant graph's times are put on the captured graph's profile's footing first
(`align_times`: the ops both run take its times), so the two columns compare like
with like. A mode's smallest budget is the lowest of its own graph's and the others
solve() falls back to (marked '*' when it is another's). Writes a CSV and a PNG.

    python scripts/bench_modes.py [--models resnet50,mobilenet_v2] [--budgets 10,8,6,5]
        [--modes normal,inplace_normal,multiway,newnode,conv_normal,inplace_conv_multiway_newnode]
        [--out out/]
"""

import argparse
import os
import time
import warnings

import pandas as pd

from monet_like.graph import capture
from monet_like.models import parse_model
from monet_like.profile import align_times, profile
from monet_like.solver import (
    DEFAULT_DEPTH,
    MIN_BUDGET_TIME_LIMIT,
    InfeasibleBudget,
    candidate_graphs,
    min_feasible_budget,
    solve,
)
from monet_like.solver.problem import build_problem
from monet_like.units import GIB
from monet_like.variants import apply

warnings.filterwarnings("ignore", category=FutureWarning)
# name: (expression, per-sample input shape, MONeT's batch, batch to profile at on this CPU)
MODELS = {
    "resnet50": ("torchvision.models.resnet50()", (3, 224, 224), 184, 4),
    "googlenet": ("torchvision.models.googlenet()", (3, 224, 224), 320, 4),
    "mobilenet_v2": ("torchvision.models.mobilenet_v2()", (3, 224, 224), 272, 4),
    "vgg16": ("torchvision.models.vgg16()", (3, 224, 224), 176, 4),
    "unet": ("unet", (3, 416, 608), 11, 1),
}
MODES = "normal,inplace_normal,multiway,newnode,conv_normal,inplace_conv_multiway_newnode"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50")
    ap.add_argument("--modes", default=MODES)
    ap.add_argument("--budgets", default="10,8,6,5")
    ap.add_argument("--time_limit", type=float, default=120)
    ap.add_argument("--out", default="out")
    ap.add_argument(
        "--frees",
        action="store_true",
        default=None,
        help="compact formulation with frees (solve.py --frees)",
    )
    ap.add_argument(
        "--min_budget_time_limit",
        type=float,
        default=MIN_BUDGET_TIME_LIMIT,
        help=f"seconds per smallest budget (default {MIN_BUDGET_TIME_LIMIT:g})",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    rows = []
    for name in args.models.split(","):
        expression, shape, batch, profile_batch = MODELS[name]
        model = parse_model(expression).build("cpu")
        captured = capture(model, shape, batch, model_name=expression)
        reference = profile(model, captured, profile_batch=profile_batch, repeats=1, progress=False)
        normal_time = reference.step_time_s  # overheads against normal eager
        print(f"\n{name} batch {batch}")
        print(
            f"{'mode':>26s} {'store-all GB':>12s} {'step s':>7s} {'smallest GB':>11s}"
            + "".join(f" {b + ' GB':>9s}" for b in args.budgets.split(","))
        )
        captured_smallest = None  # the captured graph's, which every mode may fall back to

        def smallest_budget(problem) -> int:
            return min_feasible_budget(
                problem, DEFAULT_DEPTH, False, "HIGHS", args.min_budget_time_limit, bool(args.frees)
            )

        for mode in args.modes.split(","):
            graph = apply(captured, mode)
            t0 = time.perf_counter()
            prof = profile(model, graph, profile_batch=profile_batch, repeats=1, progress=False)
            baseline = (captured, reference) if graph.variants else None
            if baseline:  # as solve() does: times on the captured profile's footing
                prof = align_times(prof, graph, reference, captured)
            problem = build_problem(graph, prof, reference=baseline and reference)
            t1 = time.perf_counter()
            smallest = own = smallest_budget(problem)
            min_budget_s = time.perf_counter() - t1
            if not graph.variants and captured_smallest is None:
                captured_smallest = own
            smallest_mark = " "
            if graph.variants:
                # solve() falls back to the captured graph (and in the full mode to the
                # algorithms alone), so the mode reaches the lowest ('*': another graph's;
                # VGG-16's full mode, for one)
                if captured_smallest is None:
                    captured_smallest = smallest_budget(build_problem(captured, reference))
                others = [captured_smallest] + [
                    smallest_budget(build_problem(g, p, reference=ref))
                    for _, g, p, ref in candidate_graphs(graph, prof, baseline)[2:]
                ]
                if min(others) < own:
                    smallest, smallest_mark = min(others), "*"
            row = {
                "model": name,
                "batch": batch,
                "mode": mode,
                "store_all_gb": problem.store_all_peak_bytes / GIB,
                "smallest_gb": smallest / GIB,
                "smallest_own_graph_gb": own / GIB,
                "store_all_time_s": problem.store_all_time_s,
                "profile_s": t1 - t0,
                "min_budget_solve_s": min_budget_s,
                "frees": args.frees,
            }
            cells = []
            for budget in (float(b) for b in args.budgets.split(",")):
                try:
                    sol = solve(
                        graph,
                        prof,
                        int(budget * GIB),
                        mode=mode,
                        time_limit=args.time_limit,
                        frees=args.frees,
                        baseline=baseline,
                    )
                    # Against the store-all step of the graph the schedule runs on; the
                    # CSV's second figure against the captured graph's (times aligned).
                    overhead = sol.overhead
                    row[f"overhead_{budget:g}gb"] = overhead
                    row[f"vs_normal_{budget:g}gb"] = sol.predicted_time_s / normal_time - 1
                    # '*': another graph's schedule was faster and is kept
                    kept = "*" if tuple(sol.variants) != graph.variants else " "
                    row[f"kept_variants_{budget:g}gb"] = "+".join(sol.variants) or "none"
                    cells.append(f"{overhead:+8.2%}{kept}")
                except InfeasibleBudget:
                    row[f"overhead_{budget:g}gb"] = None
                    cells.append(f"{'infeas.':>9s}")
            rows.append(row)
            print(
                f"{mode:>26s} {row['store_all_gb']:12.3f} {row['store_all_time_s']:7.2f}"
                f" {row['smallest_gb']:10.3f}{smallest_mark}" + "".join(f" {c}" for c in cells),
                flush=True,
            )

    df = pd.DataFrame(rows)
    csv = os.path.join(args.out, "bench_modes.csv")
    df.to_csv(csv, index=False)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, mode), g in df.groupby(["model", "mode"], sort=False):
        ax.bar(f"{name}\n{mode}".replace("_", " "), g["smallest_gb"].iloc[0])
    ax.set_ylabel("smallest feasible budget (GB)")
    ax.tick_params(axis="x", labelsize=6)
    fig.tight_layout()
    png = os.path.join(args.out, "bench_modes.png")
    fig.savefig(png, dpi=120)
    print(f"\nwrote {csv} and {png}")


if __name__ == "__main__":
    main()
