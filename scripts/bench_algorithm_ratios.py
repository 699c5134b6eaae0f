"""How well the convolution algorithms' time ratios at the timing batch stand for the
solved batch.

    python scripts/bench_algorithm_ratios.py [--model "torchvision.models.resnet50()"]
        [--batch 184] [--input_shape 3,224,224] [--sites N] [--rounds 3] [--csv FILE]
        [--timing_flops F]

The profile times each convolution layer's algorithm options at the largest batch whose
forward costs at most ALGORITHM_TIMING_FLOPS (often far below the solved batch), and the
solver prices an option as PyTorch's own algorithm's time in the step times the option's
ratio to it there. This script times every option of each distinct layer (the first
`--sites` of them) as the profile does (at that timing batch, the batch chunks in
chunks of their size at the solved batch) and at the solved batch itself, all calls of
a layer interleaved in one set of rounds (the least of `--rounds` each), and prints
each option's ratio to PyTorch's own algorithm (same direction) at both batches: where
the two differ, the solver's price of that option is off by as much. A ratio at the
timing batch below the one at the batch makes the schedule slower than its plan. The
summary also gives the chunk options' error when each is timed as one call over the
timing batch.
`--timing_flops` sets ALGORITHM_TIMING_FLOPS (1e9) for the run: a larger timing batch,
its cost printed at the end as one round of every option at either batch.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys

import torch

from monet_like.models import parse_model
from monet_like.pipeline import capture_graphs
from monet_like.profile import algorithms
from monet_like.profile.algorithms import (
    _calls_at,
    _site_signature,
    _timing_batch,
    _timing_calls,
)
from monet_like.profile.timing import _fastest_interleaved
from monet_like.variants import algorithm_sites

NAMES = {-1: "aten", 0: "im2col", -2: "2 chunks", -8: "8 chunks"}
OPTIONS = ("im2col", "2 chunks", "8 chunks")  # the summary's rows, PyTorch's own left out


def site_ratios(
    site, nodes, batch: int, profile_batch: int, rounds: int, gen, cost: dict[str, float]
) -> list[dict]:
    """One row per option (but PyTorch's own) of one convolution site: its time over
    PyTorch's own algorithm's in the same direction, at the timing batch and at `batch`.
    `cost` sums one round of the site's calls at either batch ("timing", "batch")."""
    cpu = torch.device("cpu")
    fwd = nodes[site["forward"][0]]
    weight, out = fwd.args[1].meta["val"].shape, fwd.meta["val"].shape
    timed_at = _timing_batch(weight, out, batch, profile_batch)
    # as the profile times them (`_timing_calls`: each at its own batch, scaled to the
    # solved one), and at the solved batch; once where the layer is timed there
    keys, calls, scale = [], [], []
    built: dict[int, dict] = {}  # rows -> the site's calls there, drawn once
    for direction, algo, at, call in _timing_calls(site, nodes, timed_at, batch, cpu, gen, built):
        keys.append(("timing", direction, algo))
        calls.append(call)
        scale.append(batch / at)
    if timed_at != batch:
        for direction, options in _calls_at(built, site, nodes, batch, cpu, gen).items():
            for algo, call in options:
                keys.append(("batch", direction, algo))
                calls.append(call)
                scale.append(1.0)
        # for comparison, the batch chunks over the timing batch itself
        for direction, options in _calls_at(built, site, nodes, timed_at, cpu, gen).items():
            for algo, call in options:
                if algo <= -2:
                    keys.append(("whole timing batch", direction, algo))
                    calls.append(call)
                    scale.append(batch / timed_at)
    seconds, spent = {}, {"timing": 0.0, "batch": 0.0, "whole timing batch": 0.0}
    for key, t, s in zip(keys, _fastest_interleaved(calls, cpu, rounds), scale, strict=True):
        spent[key[0]] += t
        seconds[key] = t * s
    if timed_at == batch:  # the same calls stand for both
        spent["batch"] = spent["timing"]
        seconds.update({("batch", d, a): t for (_, d, a), t in list(seconds.items())})
    cost["timing"] += spent["timing"]
    cost["batch"] += spent["batch"]
    found = []
    for where, direction, algo in keys:
        if where != "timing" or algo == -1 or direction == "both":
            continue
        at_timing = seconds[("timing", direction, algo)] / seconds[("timing", direction, -1)]
        at_batch = seconds[("batch", direction, algo)] / seconds[("batch", direction, -1)]
        whole = seconds.get(
            ("whole timing batch", direction, algo), seconds[where, direction, algo]
        )
        at_whole = whole / seconds[("timing", direction, -1)]
        found.append({
            "layer": "x".join(map(str, weight)) + f" -> {out[2]}x{out[3]}",
            "timing batch": timed_at,
            "direction": direction,
            "option": NAMES.get(algo, str(algo)),
            "ratio at timing batch": at_timing,
            "ratio at batch": at_batch,
            "error": at_timing / at_batch - 1,
            "error, chunks over the timing batch": at_whole / at_batch - 1,
        })  # fmt: skip
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="torchvision.models.resnet50()")
    ap.add_argument("--batch", type=int, default=184)
    ap.add_argument("--input_shape", default="3,224,224")
    ap.add_argument("--profile_batch", type=int, default=4)
    ap.add_argument("--sites", type=int, default=0, help="the first N distinct layers (0: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--timing_flops", type=float, default=algorithms.ALGORITHM_TIMING_FLOPS)
    args = ap.parse_args(argv)
    algorithms.ALGORITHM_TIMING_FLOPS = args.timing_flops  # read by _timing_batch at each call

    torch.manual_seed(0)
    model = parse_model(args.model).build()
    shape = tuple(int(s) for s in args.input_shape.split(","))
    _, graph = capture_graphs(model, shape, args.batch, "conv")
    nodes = {n.name: n for n in graph.fx.graph.nodes}
    distinct, seen = [], set()
    for site in algorithm_sites(graph):
        signature = _site_signature(site, nodes)
        if signature not in seen:
            seen.add(signature)
            distinct.append(site)
    if args.sites:
        distinct = distinct[: args.sites]
    gen = torch.Generator().manual_seed(0)
    rows, cost = [], {"timing": 0.0, "batch": 0.0}
    header = (
        f"{'layer':<28} {'timed at':>8} {'part':<7} {'option':<9} {'at timing':>9}"
        f" {'at batch':>9} {'error':>7}"
    )
    print(f"{args.model}, batch {args.batch}: {len(distinct)} distinct convolution layers")
    print(header)
    for site in distinct:
        for r in site_ratios(site, nodes, args.batch, args.profile_batch, args.rounds, gen, cost):
            rows.append(r)
            print(
                f"{r['layer']:<28} {r['timing batch']:>8} {r['direction']:<7} {r['option']:<9}"
                f" {r['ratio at timing batch']:>9.2f} {r['ratio at batch']:>9.2f}"
                f" {r['error']:>+7.0%}",
                flush=True,
            )
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print()
    print(f"{'option':<32} {'rows':>5} {'median |error|':>15} {'priced >10% low':>16} {'worst':>7}")
    chunked = ("2 chunks", "8 chunks")
    summaries = [(option, "error") for option in (*OPTIONS, "all")]
    summaries += [
        (f"{option}, over the timing batch", "error, chunks over the timing batch")
        for option in chunked
    ]  # each chunk option timed as one call over the timing batch, for comparison
    for label, column in summaries:
        option = label.split(",")[0]
        mine = [r for r in rows if option in ("all", r["option"])]
        if not mine:
            continue
        errors = [r[column] for r in mine]
        low = [e for e in errors if e < -0.10]
        print(
            f"{label:<32} {len(mine):>5} {statistics.median(abs(e) for e in errors):>15.0%}"
            f" {len(low):>16} {min(errors):>+7.0%}"
        )
    print(
        f"one round of every option: {cost['timing']:.1f} s at the timing batches"
        f" (ALGORITHM_TIMING_FLOPS {args.timing_flops:.0e}), {cost['batch']:.1f} s at {args.batch}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
