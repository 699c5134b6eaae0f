"""The MILP on MONeT's benchmark configurations: size, solve time, gap, predicted overhead.

For each model at MONeT's batch size and each budget (GB), each solver: variables,
constraints, time to the first schedule within the budget (the start heuristic's
time where it found one; otherwise when the solver reported its first, "n/a" where
it reports none: CBC through cylp), solve time, final gap and the predicted overhead of
the schedule over the store-all step (from this machine's profile), and the start
heuristic's schedule beside the solver's (how it was found, its recomputation
seconds). Writes a CSV and a PNG.

    python scripts/bench_solver.py [--models resnet50,googlenet,...] [--budgets 10,9,8,7,6,5]
        [--solvers HIGHS,CBC] [--mode normal] [--time_limit 600] [--formulation compact]
        [--profiles 1] [--no_frees] [--out out/] [--saved_profiles DIR]

With `--profiles N` (N > 1) each model is profiled N times afresh (the cache neither
read nor written; each profile saved in `--out` as `profile_<model>_<mode>_<k>.json`,
`monet_like.profile.Profile.from_json` reads it back) and every budget solved on each
profile: a table then gives, per
budget and solver, the median and the worst solve time and gap over the profiles, and
how many were proved (a solve's time and proof move with the profile's noise).
`--no_frees` (as in `solve.py`) ends each solve at the compact formulation's search:
its proof alone, without the frees' search after it. `--saved_profiles DIR` solves on
the profiles an earlier run saved there (`--profiles N` of them, same model and mode)
instead of profiling: another solver, budget or limit on the same profiles.

With a mode other than `normal` (e.g. `inplace_conv_multiway_newnode`, the full mode)
the graph is rewritten with the mode's variants and profiled so, and the MILP of that
graph is solved alone: `solve.py` also solves the captured graph at the same budget
and keeps the faster schedule, a second, smaller solve that this table leaves out.
"""

import argparse
import os
import time
import warnings

import pandas as pd

from monet_like.errors import UserError
from monet_like.graph import capture
from monet_like.models import parse_model
from monet_like.profile import Profile, profile
from monet_like.solver import InfeasibleBudget, parse_mode, solve
from monet_like.units import GIB
from monet_like.variants import apply as apply_variants

warnings.filterwarnings("ignore", category=FutureWarning)
# name: (expression, per-sample input shape, MONeT's batch, batch to profile at on this CPU)
MODELS = {
    "resnet50": ("torchvision.models.resnet50()", (3, 224, 224), 184, 4),
    "googlenet": ("torchvision.models.googlenet()", (3, 224, 224), 320, 4),
    "mobilenet_v2": ("torchvision.models.mobilenet_v2()", (3, 224, 224), 272, 4),
    "vgg16": ("torchvision.models.vgg16()", (3, 224, 224), 176, 4),
    "unet": ("unet", (3, 416, 608), 11, 1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50")
    ap.add_argument("--budgets", default="10,9,8,7,6,5")
    ap.add_argument("--solvers", default="HIGHS,CBC")
    ap.add_argument("--time_limit", type=float, default=600)
    ap.add_argument("--formulation", default="compact")
    ap.add_argument("--mode", default="normal")
    ap.add_argument("--profiles", type=int, default=1, help="fresh profiles per model")
    ap.add_argument("--no_frees", action="store_true", help="no frees' search after the first")
    ap.add_argument("--out", default="out")
    ap.add_argument("--saved_profiles", help="folder of an earlier run's saved profiles")
    args = ap.parse_args()
    parse_mode(args.mode)  # a bad mode fails before any capture or profiling
    if args.profiles < 1:
        ap.error("--profiles must be at least 1")
    if args.saved_profiles:
        missing = [
            path
            for name in args.models.split(",")
            for k in range(args.profiles)
            if not os.path.isfile(path := saved_profile(args.saved_profiles, name, args.mode, k))
        ]
        if missing:
            ap.error(f"--saved_profiles: no {', '.join(missing)}")
    os.makedirs(args.out, exist_ok=True)

    rows = []
    for name in args.models.split(","):
        expression, shape, batch, profile_batch = MODELS[name]
        model = parse_model(expression).build("cpu")
        graph = apply_variants(capture(model, shape, batch, model_name=expression), args.mode)
        for k in range(args.profiles):
            rows += solved_on_a_profile(args, name, model, graph, batch, profile_batch, k)

    df = pd.DataFrame(rows)
    csv = os.path.join(args.out, "bench_solver.csv")
    df.to_csv(csv, index=False)
    if args.profiles > 1:
        print_across_profiles(df)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ok = df[df["status"].isin(["optimal", "feasible", "store-all"])]
    for (name, solver), g in ok.groupby(["model", "solver"]):
        g = g.groupby("budget_gb", as_index=False)["overhead"].median()  # over the profiles
        ax.plot(g["budget_gb"], 100 * g["overhead"], marker="o", label=f"{name} {solver}")
    ax.set_xlabel("budget (GB)")
    ax.set_ylabel("predicted overhead vs store-all (%)")
    ax.invert_xaxis()
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = os.path.join(args.out, "bench_solver.png")
    fig.savefig(png, dpi=120)
    print(f"\nwrote {csv} and {png}")


def print_across_profiles(df: pd.DataFrame) -> None:
    """Per model, budget and solver: solve time and gap over the profiles, median and
    worst, and how many of the solves were proved."""
    print("\nacross profiles: solve s, gap of the step and of the recomputation, median / worst;")
    print("proved of solved; the search before the frees (where they were searched, the status")
    print("is theirs): proved, its s")
    print(
        f"{'model':>12s} {'GB':>4s} {'solver':>6s} {'solve s':>15s} {'step gap':>17s}"
        f" {'recompute gap':>17s} {'proved':>7s} {'frees':>5s} {'before: proved':>14s}"
        f" {'its s':>15s}"
    )
    solved = df[df["status"].isin(["optimal", "feasible"])]
    for (name, budget, solver), g in solved.groupby(["model", "budget_gb", "solver"]):
        gaps, step_gaps = g["gap"].dropna(), g["step_gap"].dropna()
        gap = "n/a" if gaps.empty else f"{gaps.median():.2%} / {gaps.max():.2%}"
        step_gap = "n/a" if step_gaps.empty else f"{step_gaps.median():.3%} / {step_gaps.max():.3%}"
        proved = int((g["status"] == "optimal").sum())
        first_proved = int((g["first_status"] == "optimal").sum())
        print(
            f"{name:>12s} {budget:4g} {solver:>6s}"
            f" {g['solve_s'].median():6.1f} / {g['solve_s'].max():6.1f} {step_gap:>17s} {gap:>17s}"
            f" {proved:3d} of {len(g)} {int(g['frees_improved'].sum()):5d}"
            f" {first_proved:7d} of {len(g)}"
            f" {g['first_seconds'].median():6.1f} / {g['first_seconds'].max():6.1f}"
        )


def saved_profile(folder: str, name: str, mode: str, k: int) -> str:
    """Where a run with `--profiles` saves its `k`th profile (from 0) in `folder`."""
    return os.path.join(folder, f"profile_{name}_{mode}_{k + 1}.json")


def solved_on_a_profile(args, name, model, graph, batch, profile_batch, k) -> list[dict]:
    """The rows of one profile (the cached one, the `k`th fresh one, or the `k`th saved
    in `--saved_profiles`): each budget solved by each solver, printed as they come."""
    rows = []
    t0 = time.perf_counter()
    which = f" (profile {k + 1} of {args.profiles})" if args.profiles > 1 else ""
    if args.saved_profiles:
        path = saved_profile(args.saved_profiles, name, args.mode, k)
        with open(path) as fh:
            prof = Profile.from_json(fh.read())
        how = f" read from {path}"
    else:
        fresh = args.profiles > 1
        prof = profile(
            model, graph, profile_batch=profile_batch, progress=False, use_cache=not fresh
        )
        how = f" profiled at batch {profile_batch} in {time.perf_counter() - t0:.0f} s"
        how += " (cached)" if prof.cached else ""
        if fresh:  # kept, so that a slow or unproved solve can be solved again on its profile
            saved = saved_profile(args.out, name, args.mode, k)
            with open(saved, "w") as fh:
                fh.write(prof.to_json())
            which += f", saved to {saved}"
    print(f"\n{name} batch {batch}, mode {args.mode}{which}: {len(graph.nodes)} nodes;{how}")
    print(
        f"{'GB':>4s} {'solver':>6s} {'vars':>7s} {'cons':>7s} {'status':>10s} {'gap':>7s}"
        f" {'of step':>8s}"
        f" {'first s':>8s} {'solve s':>8s} {'peak GB':>8s} {'overhead':>9s}"
        f" {'start (recompute s)':>24s} {'recompute s':>11s}"
    )
    for budget in (float(b) for b in args.budgets.split(",")):
        for solver in args.solvers.split(","):
            row = {
                "profile": k,
                "model": name,
                "batch": batch,
                "mode": args.mode,
                "budget_gb": budget,
                "solver": solver,
            }
            try:
                sol = solve(
                    graph,
                    prof,
                    int(budget * GIB),
                    solver=solver,
                    time_limit=args.time_limit,
                    formulation=args.formulation,
                    mode=args.mode,
                    frees=False if args.no_frees else None,
                )
                row.update(
                    status=sol.status,
                    variables=sol.stats.get("variables", 0),
                    constraints=sol.stats.get("constraints", 0),
                    gap=sol.gap,
                    step_gap=sol.step_gap,
                    first_feasible_s=sol.stats.get("first_feasible_s"),
                    start=sol.stats.get("start"),
                    start_recompute_s=sol.stats.get("start_objective_s"),
                    recompute_s=sol.objective_s,
                    solve_s=sol.solve_time_s,
                    peak_gb=sol.predicted_peak_bytes / GIB,
                    overhead=sol.overhead,
                )
                tried = sol.stats.get("frees_tried") or {}
                row.update(
                    frees_improved=bool(tried.get("improved")),
                    frees_s=tried.get("seconds", 0.0),
                    frees_best_s=tried.get("best_found_s"),
                )
                before = sol.stats.get("first_search") or {}
                row.update({f"first_{key}": value for key, value in before.items()})
            except InfeasibleBudget as exc:
                row.update(status="infeasible", min_budget_gb=exc.min_budget_bytes / GIB)
            except UserError as exc:  # a time-limited solve with nothing in the budget
                row.update(status="no schedule", message=str(exc))
            rows.append(row)
            if row["status"] == "infeasible":
                print(
                    f"{budget:4g} {solver:>6s} infeasible: smallest feasible budget "
                    f"{row['min_budget_gb']:.2f} GB"
                )
                continue
            if row["status"] == "no schedule":
                print(f"{budget:4g} {solver:>6s} {row['message']}")
                continue
            gap = "n/a" if row["gap"] is None else f"{row['gap']:.2%}"
            step_gap = "n/a" if row["step_gap"] is None else f"{row['step_gap']:.3%}"
            first = row["first_feasible_s"]
            first = "n/a" if first is None else f"{first:.1f}"
            start = (
                "none"
                if row.get("start") is None
                else f"{row['start']} ({row['start_recompute_s']:.3f})"
            )
            print(
                f"{budget:4g} {solver:>6s} {row['variables']:7d} {row['constraints']:7d}"
                f" {row['status']:>10s} {gap:>7s} {step_gap:>8s} {first:>8s} {row['solve_s']:8.1f}"
                f" {row['peak_gb']:8.3f} {row['overhead']:+9.2%}"
                f" {start:>24s} {row['recompute_s']:11.3f}",
                flush=True,
            )
            if row["frees_improved"] or row["frees_s"] > 1:
                # the frees were searched after it (their status above where they improved)
                first_gap = "n/a" if row["first_gap"] is None else f"{row['first_gap']:.2%}"
                outcome = "nothing cheaper"
                if row["frees_improved"]:
                    best_s = row["frees_best_s"]
                    outcome = "improved" + (
                        "" if best_s is None else f"; its best after {best_s:.1f} s"
                    )
                print(
                    f"{'':>4s} {'':>6s} the frees searched {row['frees_s']:.1f} s ({outcome});"
                    f" the search before them: {row['first_status']}, gap {first_gap},"
                    f" {row['first_recompute_s']:.3f} s recomputed,"
                    f" after {row['first_seconds']:.1f} s"
                )

    return rows


if __name__ == "__main__":
    main()
