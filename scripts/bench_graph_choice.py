"""Which graph's schedule a mode keeps, over fresh profiles: with and without aligned times.

A mode solves the graph with its variants and the captured graph, and keeps the faster
schedule. The two graphs are profiled apart, and on a shared machine the same kernels
time differently from one profile to the next. This takes `--pairs` fresh pairs of
profiles back to back (no cache) and, on each pair, solves at the budget twice: with
the variant graph's times aligned to the captured graph's profile (`align_times`, what
`solve()` does), and without (the profiles as taken). It prints which graph was kept
each time and the two store-all steps' ratio, and writes a CSV and a PNG.

    python scripts/bench_graph_choice.py [--model "torchvision.models.resnet18()"]
        [--input_shape 3,64,64] [--batch 32] [--budget_gb 0.123]
        [--mode inplace_conv_multiway_newnode] [--pairs 6] [--out out/]
"""

import argparse
import os
import warnings

import pandas as pd

import monet_like.solver as solver_module
from monet_like.graph import capture
from monet_like.models import parse_input_shape, parse_model
from monet_like.profile import profile
from monet_like.units import GIB
from monet_like.variants import apply

warnings.filterwarnings("ignore", category=FutureWarning)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="torchvision.models.resnet18()")
    ap.add_argument("--input_shape", default="3,64,64")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--budget_gb", type=float, default=0.123)
    ap.add_argument("--mode", default="inplace_conv_multiway_newnode")
    ap.add_argument("--solver", default="HIGHS")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    shape = parse_input_shape(args.input_shape)
    model = parse_model(args.model).build("cpu")
    captured = capture(model, shape, args.batch, model_name=args.model)
    graph = apply(captured, args.mode)
    aligned_times = solver_module.align_times
    rows = []
    print(f"{'pair':>4s} {'steps ratio':>11s} {'aligned: kept':>22s} {'as taken: kept':>22s}")
    for pair in range(args.pairs):
        reference = profile(model, captured, use_cache=False, progress=False)
        prof = profile(model, graph, use_cache=False, progress=False)
        row = {"pair": pair, "steps_ratio": prof.step_time_s / reference.step_time_s}
        cells = []
        for name, align in (("aligned", aligned_times), ("as_taken", lambda p, *_: p)):
            solver_module.align_times = align  # what solve() calls on the variant profile
            try:
                sol = solver_module.solve(
                    graph,
                    prof,
                    int(args.budget_gb * GIB),
                    mode=args.mode,
                    solver=args.solver,
                    baseline=(captured, reference),
                )
            finally:
                solver_module.align_times = aligned_times
            kept = {(): "captured", ("conv",): "conv only"}.get(tuple(sol.variants), "variants")
            # the fastest of the schedules not kept (on the other graphs)
            other = min(sol.extra.get("kept_over", {}).values(), default=None)
            row[f"{name}_kept"] = kept
            row[f"{name}_time_s"] = sol.predicted_time_s
            row[f"{name}_other_s"] = other
            cells.append(f"{kept} {sol.predicted_time_s:.4f} s")
        rows.append(row)
        print(f"{pair:4d} {row['steps_ratio']:11.3f} {cells[0]:>22s} {cells[1]:>22s}", flush=True)

    df = pd.DataFrame(rows)
    for name in ("aligned", "as_taken"):
        counts = df[f"{name}_kept"].value_counts().to_dict()
        print(f"{name}: " + ", ".join(f"{k} kept {v} times" for k, v in sorted(counts.items())))
    csv = os.path.join(args.out, "bench_graph_choice.csv")
    df.to_csv(csv, index=False)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(df["pair"], df["aligned_time_s"], "o-", label="aligned (kept schedule)")
    ax.plot(df["pair"], df["as_taken_time_s"], "s--", label="as taken (kept schedule)")
    ax.set_xlabel("fresh profile pair")
    ax.set_ylabel("predicted step time (s)")
    ax.legend()
    fig.tight_layout()
    png = os.path.join(args.out, "bench_graph_choice.png")
    fig.savefig(png, dpi=120)
    print(f"wrote {csv} and {png}")


if __name__ == "__main__":
    main()
