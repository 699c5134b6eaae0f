"""A few SGD steps on synthetic data, with and without a schedule: losses and peaks.

    python examples/train.py            # ResNet-18 at 64 px, batch 32

It solves a schedule (through monet_like.compile; the profile is cached after the first
run) for a budget halfway between the smallest feasible one and the store-all peak,
then trains two copies of the same model side by side from the same initialisation:
eager PyTorch and ScheduleWrapper. Their losses must match
step for step; the wrapped model's peak must stay inside its budget.
"""

import argparse
import copy

import torch

from monet_like.models import parse_model
from monet_like.pipeline import compile_schedule
from monet_like.units import GIB
from monet_like.verify import measured_peak
from monet_like.wrapper import ScheduleWrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="torchvision.models.resnet18(num_classes=10)")
    ap.add_argument("--input_shape", default="3,64,64")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--solution", default="out/train_example_solution.json")
    args = ap.parse_args()
    shape = tuple(int(d) for d in args.input_shape.split(","))

    torch.manual_seed(0)
    model = parse_model(args.model).build()
    # Halfway between the smallest feasible budget and the store-all peak.
    compiled = compile_schedule(
        model, shape, args.batch, budget_fraction=0.5, model_name=args.model, output=args.solution
    )
    sol = compiled.solution
    budget = sol.budget_bytes
    print(
        f"schedule for {budget / GIB:.4f} GB (store-all {sol.store_all_peak_bytes / GIB:.4f},"
        f" smallest feasible {compiled.min_budget_bytes / GIB:.4f}):"
        f" {sum(len(s['recompute']) for s in sol.stages)} recomputations, written to"
        f" {args.solution}"
    )

    eager = copy.deepcopy(model)
    wrapped = ScheduleWrapper(copy.deepcopy(model), args.solution, shape)
    nets = {"eager": eager, "schedule": wrapped}
    opts = {k: torch.optim.SGD(n.parameters(), lr=0.05, momentum=0.9) for k, n in nets.items()}
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x = torch.randn(args.batch, *shape, generator=gen)
        y = torch.randint(0, 10, (args.batch,), generator=gen)
        line = [f"step {step}"]
        for name, net in nets.items():
            opts[name].zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opts[name].step()
            line.append(f"{name} loss {loss.item():.6f}")
        print("  ".join(line))
    x = torch.randn(args.batch, *shape, generator=gen)
    # The whole step's peak as the CPU allocator sees it (parameters, gradients, input,
    # activations, scratch), the budget's own terms; optimizer state is outside both.
    peak = measured_peak(wrapped, x)
    print(
        f"one step with the schedule: measured {peak / GIB:.4f} GB, predicted"
        f" {sol.predicted_peak_bytes / GIB:.4f} GB, budget {budget / GIB:.4f} GB"
        f" (eager PyTorch: {sol.store_all_peak_bytes / GIB:.4f} GB)"
    )


if __name__ == "__main__":
    main()
