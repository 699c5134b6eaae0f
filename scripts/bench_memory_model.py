"""Predicted store-all peak vs measured peak of a real eager step, on this machine.

Prints a table (and writes a PNG) for the small configurations the memory model
must get within 3%, then ResNet-50 at batch 184, 224 px, predicted on fake tensors
and compared with MONeT's measured 15.06 GB for PyTorch.

    python scripts/bench_memory_model.py [--out out/bench_memory_model.png]
"""

import argparse
import os
import time
import warnings

import torch

from monet_like.graph import capture
from monet_like.memory import (
    fixed_bytes,
    measure_allocator,
    measure_training_step,
    simulate,
    state_tensors,
    store_all_timeline,
    training_step,
)
from monet_like.models import make_input, parse_model
from monet_like.profile import profile
from monet_like.units import GIB

warnings.filterwarnings("ignore", category=FutureWarning)
MIB = 2**20
CASES = [
    ("torchvision.models.resnet18()", (3, 32, 32), 8),
    ("torchvision.models.mobilenet_v2()", (3, 32, 32), 8),
    ("torchvision.models.vgg11()", (3, 32, 32), 8),
    ("torchvision.models.googlenet()", (3, 64, 64), 4),
    ("torchvision.models.densenet121()", (3, 32, 32), 4),
    ("unet(base=16)", (3, 96, 96), 2),
    ("gpt(depth=4, dim=128)", (128,), 4),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/bench_memory_model.png")
    args = ap.parse_args()

    rows = []
    header = f"{'model':32s} {'input':>12s} {'batch':>5s} {'predicted':>10s} {'measured':>10s}"
    header += f" {'simulated':>10s} {'error':>7s} |"
    header += f" {'pred+ws':>10s} {'allocator':>10s} {'error':>7s}"
    print(header + "\n" + "-" * len(header))
    for expression, shape, batch in CASES:
        torch.manual_seed(0)
        model = parse_model(expression).build("cpu")
        graph = capture(model, shape, batch, model_name=expression)
        predicted = store_all_timeline(graph).peak_bytes
        measured = measure_training_step(model, make_input(model, shape, batch, torch.float32))
        simulated = simulate(model, shape, batch).peak_bytes
        err = predicted / measured.peak_bytes - 1
        # With each op's measured workspace, against what the CPU allocator really saw.
        prof = profile(model, graph, profile_batch=batch, repeats=1, progress=False)
        with_ws = store_all_timeline(graph, prof.workspace_by_op()).peak_bytes
        x = make_input(model, shape, batch, torch.float32)
        model.zero_grad(set_to_none=True)
        allocator = measure_allocator(
            lambda m=model, x=x: training_step(m, x), [*state_tensors(model), x]
        )
        model.zero_grad(set_to_none=True)
        rows.append((expression, predicted, measured.peak_bytes, with_ws, allocator))
        print(
            f"{expression:32s} {str(shape):>12s} {batch:5d} {predicted / MIB:8.1f}Mi"
            f" {measured.peak_bytes / MIB:8.1f}Mi {simulated / MIB:8.1f}Mi {err:+7.2%} |"
            f" {with_ws / MIB:8.1f}Mi {allocator / MIB:8.1f}Mi {with_ws / allocator - 1:+7.2%}"
        )

    print("\nResNet-50, batch 184, 3x224x224, fp32 (capture on fake tensors, nothing allocated)")
    t0 = time.perf_counter()
    model = parse_model("torchvision.models.resnet50()").build("meta")
    graph = capture(model, (3, 224, 224), 184)
    timeline = store_all_timeline(graph)
    seconds = time.perf_counter() - t0
    fixed = fixed_bytes(graph)
    monet = 15.06
    print(
        f"  predicted store-all peak {timeline.peak_bytes / GIB:.3f} GiB in {seconds:.1f} s"
        f" (MONeT measured {monet} GB on a P100: {timeline.peak_bytes / GIB / monet - 1:+.2%})\n"
        f"  fixed part {fixed.total / GIB:.3f} GiB (params {fixed.params / GIB:.3f},"
        f" grads {fixed.grads / GIB:.3f}, input {fixed.input / GIB:.3f});"
        f" peak at {graph.ops[timeline.peak_op].phase} op {graph.ops[timeline.peak_op].name}"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(rows))
    labels = ["predicted", "measured (live storages)", "predicted + workspace", "CPU allocator"]
    for k, label in enumerate(labels):
        ax.bar([x - 0.3 + 0.2 * k for x in xs], [r[k + 1] / MIB for r in rows], 0.2, label=label)
    ax.set_xticks(list(xs), [r[0].split("(")[0].split(".")[-1] for r in rows], rotation=20)
    ax.set_ylabel("peak of one training step (MiB)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Store-all peak: predicted from the graph vs measured eager step (CPU)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"\nplot written to {args.out}")


if __name__ == "__main__":
    main()
