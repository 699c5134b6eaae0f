"""The compact formulation against MONeT's full T x V one, on small graphs run here.

For each graph (64 px inputs, or 64 tokens), normal mode, HiGHS: the smallest feasible
budget in each formulation (the min-memory problem), then the least recomputation
(ms, from this machine's profile) in each at the compact formulation's smallest
budget and 20% and 50% of the way from it to the store-all peak, and the columns of
each formulation. A solve stopped by its time limit is marked '*' (its schedule may
be costlier than the optimum, its bound is in the CSV; a smallest budget so marked is
the smallest found). Its table is docs/benchmarks.md's compact-vs-full one; `tests/test_solver.py`
asserts its 20% and 50% columns within 2% on the graphs without long chains. Writes a
CSV and a PNG.

    python scripts/bench_formulations.py [--graphs resnet18,mobilenet_v2,googlenet,unet,gpt]
        [--time_limit 120] [--min_budget_time_limit 300] [--out out/]
"""

import argparse
import os
import time
import warnings

import pandas as pd

from monet_like.graph import capture
from monet_like.models import parse_model
from monet_like.profile import profile
from monet_like.solver import DEFAULT_DEPTH, MIN_BUDGET_TIME_LIMIT, min_feasible_budget, solve
from monet_like.solver.problem import build_problem

warnings.filterwarnings("ignore", category=FutureWarning)
MIB = 2**20
# name: (expression, per-sample input shape, batch); the test's SMALL_GRAPHS
GRAPHS = {
    "resnet18": ("torchvision.models.resnet18()", (3, 64, 64), 16),
    "mobilenet_v2": ("torchvision.models.mobilenet_v2()", (3, 64, 64), 8),
    "googlenet": ("torchvision.models.googlenet()", (3, 64, 64), 8),
    "unet": ("unet(base=8)", (3, 64, 64), 4),
    "gpt": ("gpt(depth=2, dim=64)", (64,), 8),
}
FRACTIONS = (0.0, 0.2, 0.5)  # of the way from compact's smallest budget to store-all


def _ms(sol) -> str:
    return f"{sol.objective_s * 1e3:.2f}{'' if sol.status == 'optimal' else '*'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", default=",".join(GRAPHS))
    ap.add_argument("--time_limit", type=float, default=120, help="seconds per solve")
    ap.add_argument(
        "--min_budget_time_limit",
        type=float,
        default=MIN_BUDGET_TIME_LIMIT,
        help=f"seconds per smallest budget (default {MIN_BUDGET_TIME_LIMIT:g})",
    )
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    unknown = set(args.graphs.split(",")) - set(GRAPHS)
    if unknown:
        ap.error(f"unknown graphs {sorted(unknown)}; choose from {', '.join(GRAPHS)}")
    os.makedirs(args.out, exist_ok=True)

    rows, lines = [], []
    for name in args.graphs.split(","):
        expression, shape, batch = GRAPHS[name]
        model = parse_model(expression).build("cpu")
        graph = capture(model, shape, batch, model_name=expression)
        prof = profile(model, graph, repeats=1, progress=False)
        problem = build_problem(graph, prof)
        smallest, marks = {}, {}
        for formulation, depth in (("compact", DEFAULT_DEPTH), ("full", None)):
            t0 = time.perf_counter()
            smallest[formulation] = min_feasible_budget(
                problem, depth, False, "HIGHS", time_limit=args.min_budget_time_limit
            )
            took = time.perf_counter() - t0
            # The search stops at its limit with the smallest budget it found, unproved.
            marks[formulation] = "*" if took >= 0.99 * args.min_budget_time_limit else ""
            print(
                f"{name}: smallest budget, {formulation}: {smallest[formulation] / MIB:.2f} MiB"
                f" in {took:.0f} s",
                flush=True,
            )
        low, high = smallest["compact"], problem.store_all_peak_bytes
        cells = {}
        for fraction in FRACTIONS:
            budget = int(low + fraction * (high - low))
            for formulation in ("compact", "full"):
                sol = solve(
                    graph, prof, budget, solver="HIGHS", formulation=formulation,
                    time_limit=args.time_limit,
                )  # fmt: skip
                cells[fraction, formulation] = sol
                rows.append(
                    dict(
                        graph=name, expression=expression, batch=batch, fraction=fraction,
                        budget_mib=budget / MIB, formulation=formulation,
                        smallest_mib=smallest[formulation] / MIB,
                        smallest_proved=not marks[formulation],
                        store_all_mib=high / MIB, status=sol.status,
                        recompute_ms=sol.objective_s * 1e3,
                        bound_ms=None if sol.bound_s is None else sol.bound_s * 1e3,
                        solve_s=sol.solve_time_s, columns=sol.stats.get("variables"),
                    )
                )  # fmt: skip
                print(
                    f"  {fraction:4.0%} {formulation:>7s}: {sol.objective_s * 1e3:9.2f} ms,"
                    f" {sol.status}, {sol.solve_time_s:.1f} s",
                    flush=True,
                )
        columns = [cells[FRACTIONS[0], f].stats.get("variables") for f in ("compact", "full")]
        lines.append(
            f"| {name} ({batch}) | {smallest['compact'] / MIB:.2f}{marks['compact']} /"
            f" {smallest['full'] / MIB:.2f}{marks['full']} MiB | "
            + " | ".join(
                f"{_ms(cells[fr, 'compact'])} / {_ms(cells[fr, 'full'])}" for fr in FRACTIONS
            )
            + f" | {columns[0]:,} / {columns[1]:,} |"
        )

    print(
        "\n| graph (batch) | smallest budget, compact / full | at compact's smallest"
        " | 20% | 50% | columns, compact / full |\n|---|---|---|---|---|---|"
    )
    print("\n".join(lines))
    print("* stopped by its time limit (a smallest budget: the smallest found)")
    df = pd.DataFrame(rows)
    csv = os.path.join(args.out, "bench_formulations.csv")
    df.to_csv(csv, index=False)
    _plot(df, os.path.join(args.out, "bench_formulations.png"))
    print(f"wrote {csv}")


def _plot(df: pd.DataFrame, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graphs = list(dict.fromkeys(df["graph"]))
    fig, axes = plt.subplots(1, len(graphs), figsize=(3.2 * len(graphs), 3), squeeze=False)
    for ax, name in zip(axes[0], graphs, strict=True):
        part = df[df["graph"] == name]
        table = part.pivot(index="fraction", columns="formulation", values="recompute_ms")
        table.index = [f"{f:.0%}" for f in table.index]
        table.plot.bar(ax=ax, rot=0)
        ax.set_title(name)
        ax.set_xlabel("of the way to store-all")
        ax.set_ylabel("recomputation (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
