"""The differential corpus: every third-party model solved, replayed and compared.

    python scripts/bench_corpus.py [--modes normal,inplace_conv_multiway_newnode]
                                   [--models NAME,...] [--torchvision] [--out docs/corpus.md]

For each model (monet_like/models/corpus.py; with --torchvision also every torchvision
classifier at 32 px, batch 2) and mode: schedules at the store-all peak, halfway and
near the smallest feasible budget, each replayed through ScheduleWrapper against eager
PyTorch (verify.replay_entry). Prints a table and writes it to --out with the command
that made it. A failing model is a row that says so, not a crash of the run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from monet_like.models.corpus import CORPUS, Entry
from monet_like.verify import replay_entry

MIB = 2**20


def torchvision_entries() -> list[Entry]:
    from monet_like.models import classification_models

    skip = {"inception_v3", "googlenet"}  # their aux heads need 75 px and more
    return [
        Entry(f"tv_{name}", f"torchvision.models.{name}(num_classes=10)", (3, 32, 32), 2, "")
        for name in classification_models()
        if name not in skip and not name.startswith(("vit_", "swin", "maxvit", "regnet_y_128"))
    ]


FRACTIONS = (1.0, 0.5, 0.1)  # of the way from the smallest feasible budget to store-all


def run(entry: Entry, mode: str, folder: Path, time_limit: float) -> dict:
    started = time.perf_counter()
    try:
        rows = replay_entry(
            entry.expression, entry.input_shape, entry.batch, mode, folder, FRACTIONS,
            time_limit=time_limit,
        )  # fmt: skip
    except Exception as exc:  # a row that says so
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return {"model": entry.name, "mode": mode, "error": f"{type(exc).__name__}: {first}"}
    store_all, _, near = rows
    worst = max(r.comparison.max_rel_grad_diff for r in rows)
    return {
        "model": entry.name,
        "mode": mode,
        "nodes": store_all.nodes,
        "store_all_mib": store_all.solution.budget_bytes / MIB,
        "smallest_mib": near.min_budget_bytes / MIB,
        "near_mib": near.solution.budget_bytes / MIB,
        "exact": all(r.exact() for r in rows),
        "bitwise": all(r.comparison.bitwise for r in rows),
        "worst_rel_grad": worst,
        "predicted_mib": near.solution.predicted_peak_bytes / MIB,
        "measured_mib": near.measured_peak_bytes / MIB,
        "fits": all(r.fits() for r in rows),
        "seconds": time.perf_counter() - started,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| model | mode | nodes | store-all MiB | smallest MiB | exact | near the smallest:"
        " budget / predicted / measured (MiB) | within budget |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | | | | **failed**: {r['error']} | | |")
            continue
        exact = "bitwise" if r["bitwise"] else f"yes ({r['worst_rel_grad']:.1e})"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['nodes']} | {r['store_all_mib']:.3f} |"
            f" {r['smallest_mib']:.3f} ({r['smallest_mib'] / r['store_all_mib']:.2f}) |"
            f" {exact if r['exact'] else '**no**'} |"
            f" {r['near_mib']:.3f} / {r['predicted_mib']:.3f} / {r['measured_mib']:.3f} |"
            f" {'yes' if r['fits'] else '**no**'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="normal,inplace_conv_multiway_newnode")
    p.add_argument("--models", help="names from monet_like/models/corpus.py (default: all)")
    p.add_argument("--torchvision", action="store_true", help="also every torchvision classifier")
    p.add_argument("--out", default="docs/corpus.md")
    p.add_argument("--time_limit", type=float, default=60.0, help="seconds per solve")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    entries = list(CORPUS)
    if args.models:
        wanted = args.models.split(",")
        entries = [e for e in entries if e.name in wanted]
    if args.torchvision:
        entries += torchvision_entries()
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for entry in entries:
            for mode in args.modes.split(","):
                r = run(entry, mode, Path(folder), args.time_limit)
                results.append(r)
                status = r.get("error") or (
                    f"exact {r['exact']}, fits {r['fits']}, {r['seconds']:.0f} s"
                )
                print(f"{entry.name:16s} {mode:30s} {status}", flush=True)
    text = table(results)
    print(text)
    command = "python scripts/bench_corpus.py " + " ".join(argv or sys.argv[1:])
    Path(args.out).write_text(
        "# The differential corpus\n\n"
        "Third-party models built from code (random weights, dropout and drop_path on),\n"
        "each solved at its store-all peak, halfway, and near its smallest feasible budget\n"
        "(a tenth of the way from it to the store-all peak; the smallest is searched for\n"
        "within the time limit, so it is the smallest found), and replayed through\n"
        "`ScheduleWrapper` against an eager step from the same state.\n"
        "*exact*: outputs, gradients and buffers bitwise equal to eager PyTorch, or, where\n"
        "the schedule runs other kernels (the full mode's variants and convolution\n"
        "algorithms), within 1e-4 relative of eager running the same convolution\n"
        "algorithms (the largest relative gradient difference in brackets). *within\n"
        "budget*: the CPU allocator's measured peak at or below the prediction, and the\n"
        "prediction at or below the budget, at all three budgets.\n\n"
        f"Made by `{command.strip()}` on this CPU, torch {torch.__version__}.\n\n" + text + "\n"
    )
    print(f"written to {args.out}")
    return 0 if all(r.get("exact") and r.get("fits") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
