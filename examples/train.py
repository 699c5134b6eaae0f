"""A few SGD steps on synthetic data, with and without a schedule: losses and peaks.

    python examples/train.py            # solves ResNet-18 at 64 px, batch 32, if needed

It solves (or reuses) a schedule for a budget between the smallest feasible one and
the store-all peak, then trains two copies of the same model side by side from the
same initialisation: eager PyTorch and ScheduleWrapper. Their losses must match
step for step; the wrapped model's peak must stay inside its budget.
"""

import argparse
import copy

import torch

from monet_like.graph import capture
from monet_like.memory import measure_training_step
from monet_like.models import parse_model
from monet_like.profile import profile
from monet_like.schedule import finalize
from monet_like.solver import DEFAULT_DEPTH, min_feasible_budget, solve
from monet_like.solver.problem import build_problem
from monet_like.units import GIB
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
    graph = capture(model, shape, args.batch, model_name=args.model)
    prof = profile(model, graph)
    problem = build_problem(graph, prof)
    low = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS")
    budget = (low + problem.store_all_peak_bytes) // 2
    sol = solve(graph, prof, budget, solver="HIGHS")
    finalize(graph, sol, prof)
    sol.save(args.solution)
    print(
        f"schedule for {budget / GIB:.4f} GB (store-all {problem.store_all_peak_bytes / GIB:.4f},"
        f" smallest feasible {low / GIB:.4f}): {sum(len(s['recompute']) for s in sol.stages)}"
        f" recomputations, written to {args.solution}"
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
    for name, net in nets.items():
        peak = measure_training_step(net, x).peak_bytes
        print(f"peak of one step, {name}: {peak / GIB:.4f} GB")
    print(f"budget {budget / GIB:.4f} GB, predicted {sol.predicted_peak_bytes / GIB:.4f} GB")


if __name__ == "__main__":
    main()
