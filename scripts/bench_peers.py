"""monet_like beside PyTorch's own memory tools, measured in one run per model.

    python scripts/bench_peers.py [--models resnet50,gpt] [--repeats 5] [--out out/peers]
                                  [--activation 1,0.75,0.5,0.35] [--write_docs]

For each model (ResNet-50 at batch 16, 128 px; the package's small GPT), runs
`monet_like.frontier.frontier`: monet_like's schedules (normal and full mode) at budgets
given as fractions of eager's activation memory and at the smallest feasible one, and
the peers (checkpoint_sequential
where the model is a sequence, block checkpointing with two policies, the compile
partitioner's activation_memory_budget), every step measured on this machine and timed
round-robin. Prints each table and two verdicts:

- at 50% of eager's activation memory: monet_like's measured overhead, and each peer
  that reaches that memory with its overhead there;
- at the smallest memory each peer reaches: whether a monet_like schedule reaches it,
  and at what overhead.

Writes frontier.csv/.png per model under --out; with --write_docs, replaces the "Peers"
section of docs/benchmarks.md with the tables and verdicts.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

from monet_like.frontier import frontier, table, write
from monet_like.models import parse_model

CONFIGS = {
    "resnet50": ("torchvision.models.resnet50()", (3, 128, 128), 16),
    "gpt": ("gpt(dim=256, depth=6, heads=8, dropout=0.0)", (256,), 8),
}
MODES = ("normal", "inplace_conv_multiway_newnode")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SLACK = 0.02  # a point within 2 points of activation memory of another counts as there


def verdicts(points) -> list[str]:
    """Where monet_like stands against each peer, in sentences."""
    ours = [p for p in points if p.tool.startswith("monet_like")]
    peers = [p for p in points if p.tool not in ("eager",) and not p.tool.startswith("monet")]
    lines = []
    at_half = [p for p in ours if p.activation_fraction <= 0.5 + SLACK]
    best = min(at_half, key=lambda p: p.overhead, default=None)
    if best is None:
        lines.append("- 50% of eager's activation memory: no monet_like schedule measured there.")
    else:
        lines.append(
            f"- 50% of eager's activation memory: monet_like {best.overhead:+.1%}"
            f" ({best.tool}, {best.activation_fraction:.0%} measured)."
        )
        for p in sorted(peers, key=lambda p: p.overhead):
            if p.activation_fraction <= 0.5 + SLACK:
                word = "above" if p.overhead > best.overhead else "BELOW (a peer wins)"
                lines.append(
                    f"  - {p.tool} ({p.setting}) reaches it at {p.overhead:+.1%}: {word} ours"
                )
    for tool in dict.fromkeys(p.tool for p in peers):
        smallest = min((p for p in peers if p.tool == tool), key=lambda p: p.activation_fraction)
        reach = [p for p in ours if p.activation_fraction <= smallest.activation_fraction + SLACK]
        mine = min(reach, key=lambda p: p.overhead, default=None)
        if mine is None:
            verdict = "no monet_like schedule measured that low (a peer wins)"
        elif mine.overhead < smallest.overhead:
            verdict = f"monet_like {mine.overhead:+.1%} there, lower"
        else:
            verdict = f"monet_like {mine.overhead:+.1%} there, NOT lower (a peer wins)"
        lines.append(
            f"- {tool}'s smallest, {smallest.activation_fraction:.0%} of eager's activation"
            f" memory ({smallest.setting}) at {smallest.overhead:+.1%}: {verdict}."
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(CONFIGS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--activation", default="1,0.75,0.5,0.35")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--time_limit", type=float, default=120.0)
    ap.add_argument("--out", default="out/peers")
    ap.add_argument(
        "--frees", action="store_true", default=None, help="solve.py's --frees for each solve"
    )
    ap.add_argument("--write_docs", action="store_true")
    args = ap.parse_args(argv)
    sections = []
    for key in args.models.split(","):
        expression, shape, batch = CONFIGS[key]
        torch.manual_seed(0)
        model = parse_model(expression).build()
        started = time.perf_counter()
        points = frontier(
            model, shape, batch, tuple(args.modes.split(",")), solver="HIGHS",
            activation_fractions=tuple(float(f) for f in args.activation.split(",")),
            and_smallest=True, frees=args.frees,
            repeats=args.repeats, time_limit=args.time_limit,
            progress=lambda line: print(f"  {line}", flush=True),
        )  # fmt: skip
        title = f"{expression}, batch {batch}, input {'x'.join(map(str, shape))}, CPU"
        csv, png = write(points, Path(args.out) / key, title)
        text = table(points)
        found = verdicts(points)
        print(f"\n{title} ({time.perf_counter() - started:.0f} s)\n{text}")
        print("\n".join(found))
        print(f"wrote {csv} and {png}\n")
        sections.append(f"**{title}**\n\n```\n{text}\n```\n\n" + "\n".join(found) + "\n")
    if args.write_docs:
        command = "python scripts/bench_peers.py --write_docs" + (
            "" if argv is None else " " + " ".join(a for a in argv if a != "--write_docs")
        )
        body = (
            "## Peers\n\n"
            "monet_like's schedules replayed beside PyTorch's own tools on the same model"
            " and input, measured in one run on this 2-core CPU (peak: the CPU allocator's;"
            f" time: median of {args.repeats} steps taken round-robin, over eager's;"
            " activation memory: the peak minus parameters, gradients, buffers and input)."
            " The compile partitioner runs with BatchNorm running statistics off (its"
            " recomputed BatchNorms would read statistics updated since). Reproduce with"
            f" `{command}`.\n\n" + "\n".join(sections)
        )
        text = DOCS.read_text()
        if re.search(r"^## Peers\n", text, re.M):
            text = re.sub(r"^## Peers\n.*?(?=^## |\Z)", body + "\n", text, flags=re.M | re.S)
        else:
            text = text.rstrip("\n") + "\n\n" + body
        DOCS.write_text(text)
        print(f"wrote the Peers section of {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
