"""The memory/time frontier of one model and batch: monet_like's schedules from the
store-all peak down to the smallest feasible budget, measured beside what a user would
pick instead, in one run on one input (`python -m monet_like frontier`).

Peers, each replayed eagerly so that only the plan differs:

- `checkpoint_sequential` at 2, 4 and 8 segments, where the model is an nn.Sequential;
- block checkpointing (`apply_activation_checkpointing` on each block: every child of
  an nn.Sequential or nn.ModuleList below the root), recomputing everything, and with
  a selective-checkpointing policy that keeps the outputs of matrix products and
  convolutions (`create_selective_checkpoint_contexts`);
- the compile partitioner's `activation_memory_budget` (AOTAutograd's min-cut
  partitioner through `torch.compile` with a backend that runs the partitioned graphs
  as they are, no fusion). Its recomputed BatchNorms would read running statistics the
  forward has since updated (autograd's version check refuses the step), so it runs on
  a copy whose BatchNorms keep no running statistics: that is said in its rows.

Every point's peak is the CPU allocator's (kernels' scratch included) or, on CUDA, the
caching allocator's bytes requested; its time is the median of `repeats` steps taken
round-robin with eager's and every other point's, as a ratio to eager's.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from monet_like.errors import UserError
from monet_like.units import GIB

FRACTIONS = (1.0, 0.75, 0.5, 0.25, 0.0)  # of the way from the smallest budget to store-all
SEGMENTS = (2, 4, 8)
PARTITIONER_BUDGETS = (0.75, 0.5, 0.25, 0.1)


@dataclass
class Point:
    """One tool at one setting, measured (and predicted, for monet_like's)."""

    tool: str  # "monet_like normal", "checkpoint_sequential", ...
    setting: str  # "budget 0.123 GB", "4 segments", "budget 0.5", ...
    measured_peak_bytes: int
    memory_fraction: float  # of eager's measured peak
    activation_fraction: float  # of eager's peak above the fixed part (see fixed_bytes)
    overhead: float  # median step time over eager's, minus one
    predicted_peak_bytes: int | None = None
    predicted_overhead: float | None = None
    note: str = ""
    # "measured", or "predicted at batch N": monet_like's schedule at a batch too large to
    # run here, its peak and overhead predicted (fractions of its store-all prediction)
    basis: str = "measured"


def frontier(
    model: nn.Module,
    input_shape: tuple[int, ...],
    batch: int,
    modes: tuple[str, ...] = ("normal",),
    fractions: tuple[float, ...] = FRACTIONS,
    solver: str = "HIGHS",
    *,
    budgets_bytes: tuple[int, ...] = (),
    activation_fractions: tuple[float, ...] = (),
    and_smallest: bool = False,
    frees: bool | None = None,
    peers: bool = True,
    predict_batch: int | None = None,
    repeats: int = 5,
    time_limit: float = 120.0,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
    outputs_held: bool = True,
) -> list[Point]:
    """Measure monet_like's schedules and the peers on one model, batch and input.

    Args:
        model: the model (random weights are fine), on `device`.
        input_shape: one sample's input shape; batch: the batch size.
        modes: monet_like's modes to sweep.
        fractions: budgets as points between each mode's smallest feasible budget (0.0)
            and the store-all peak (1.0); ignored where `budgets_bytes` is given.
        budgets_bytes: budgets in bytes instead of fractions.
        activation_fractions: budgets instead as fractions of eager's measured
            activation memory (its peak above `fixed_bytes`).
        and_smallest: with budgets in bytes or activation fractions, also each mode's
            smallest feasible budget.
        frees: as `solve.py --frees` (True: each recomputed value freed after its last
            reader from the start; smaller budgets reachable, slower solves), `--no_frees`
            (False), or neither (None: tried where they could pay, `solver.solve`).
        peers: also measure the peers (see the module's docstring).
        predict_batch: also monet_like's schedules at this batch, predicted only (for a
            batch too large to run here; the peers are measured at `batch`): at
            `activation_fractions` of its predicted store-all activation memory where
            given, else at `fractions`.
        repeats: timed steps per point (median), after one warm-up round.
        outputs_held: the training loop every tool is measured with, and monet_like's
            schedules are solved for: the model's outputs held until backward ends
            (`out = model(x); loss(out).backward()`, solve.py's default), or dropped
            before it (solve.py's --outputs_freed). One loop for all: a GPT's logits
            held or not moved block checkpointing's peak by 8 MiB (0.0968 -> 0.1046 GB).

    Returns:
        One `Point` per tool and setting, eager's first.
    """
    from monet_like.inputs import make_input
    from monet_like.pipeline import compile_schedule
    from monet_like.verify import measured_peak, step_peak
    from monet_like.wrapper import ScheduleWrapper

    say = progress or (lambda _line: None)
    device = torch.device(device)
    x = make_input(model, tuple(input_shape), batch, torch.float32, "cpu").to(device)
    steps: dict[tuple[str, str], Callable[[], None]] = {}
    peaks: dict[tuple[str, str], int] = {}
    predicted: dict[tuple[str, str], tuple[int, float]] = {}
    notes: dict[tuple[str, str], str] = {}
    eager = ("eager", "store-all")
    steps[eager] = _step(model, x, outputs_held=outputs_held)
    steps[eager]()  # warm-up: the libraries' first-call allocations are not the step's
    peaks[eager] = step_peak(model, steps[eager], x)
    say(f"eager: peak {peaks[eager] / GIB:.4f} GB")
    fixed = fixed_bytes(model, x)
    if activation_fractions:
        budgets_bytes = tuple(int(fixed + f * (peaks[eager] - fixed)) for f in activation_fractions)

    # Schedule files are read once (ScheduleWrapper, or not run at all) and removed with
    # the folder.
    with tempfile.TemporaryDirectory(prefix="monet_like_frontier_") as temporary:
        folder = Path(temporary)
        for mode in modes:
            low = None
            points = [("budget", b) for b in budgets_bytes] or [("fraction", f) for f in fractions]
            if budgets_bytes and and_smallest:
                points.append(("fraction", 0.0))
            for kind, value in points:
                key_args = (
                    {"budget_bytes": value} if kind == "budget" else {"budget_fraction": value}
                )
                try:
                    compiled = compile_schedule(
                        model, input_shape, batch, mode=mode, solver=solver, device=device,
                        min_budget_bytes=low, time_limit=time_limit, frees=frees,
                        outputs_held=outputs_held,
                        output=folder / f"{mode}_{kind}_{value}.json", **key_args,
                    )  # fmt: skip
                except UserError as exc:  # infeasible, or stopped by the time limit: said
                    where = (
                        f"budget {value / GIB:.4f} GB" if kind == "budget" else f"{kind} {value}"
                    )
                    say(f"monet_like {mode}, {where}: no schedule ({exc})")
                    continue
                low = compiled.min_budget_bytes
                sol = compiled.solution
                key = (f"monet_like {mode}", f"budget {sol.budget_bytes / GIB:.4f} GB")
                if key in steps:  # budgets within 0.0001 GB: told apart, not one replaced
                    key = (key[0], f"budget {sol.budget_bytes / GIB:.9f} GB")
                if key in steps:
                    say(f"{key[0]}, {key[1]}: the same budget as an earlier point, measured once")
                    continue
                wrapped = ScheduleWrapper(
                    model, folder / f"{mode}_{kind}_{value}.json", input_shape
                )
                steps[key] = _step(wrapped, x, model, outputs_held)
                peaks[key] = measured_peak(wrapped, x)
                predicted[key] = (sol.predicted_peak_bytes, sol.overhead)
                say(
                    f"{key[0]}, {key[1]}: predicted {sol.predicted_peak_bytes / GIB:.4f} GB"
                    f" {sol.overhead:+.2%}, measured {peaks[key] / GIB:.4f} GB"
                )
        at_predict_batch = []
        if predict_batch is not None:
            at_predict_batch = _predicted_points(
                model, input_shape, predict_batch, modes, fractions, activation_fractions,
                solver, frees, time_limit, device, folder, say, outputs_held,
            )  # fmt: skip

    if peers:
        for key, build, note in _peers(model):
            try:
                net = build()
                steps[key] = _step(net, x, outputs_held=outputs_held)
                steps[key]()  # warm-up (the partitioner compiles here), or it cannot run
                peaks[key] = step_peak(net, steps[key], x)
            except Exception as exc:  # noqa: BLE001 (reported, and the others go on)
                steps.pop(key, None)
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                say(f"{key[0]}, {key[1]}: cannot run here ({type(exc).__name__}: {first})")
                continue
            notes[key] = note
            say(f"{key[0]}, {key[1]}: measured {peaks[key] / GIB:.4f} GB")

    say(f"timing {len(steps)} points round-robin, {repeats} steps each after a warm-up")
    times = _interleaved_times(steps, repeats)
    base_time, base_peak = times[eager], peaks[eager]
    measured = [
        Point(
            tool,
            setting,
            peaks[(tool, setting)],
            peaks[(tool, setting)] / base_peak,
            (peaks[(tool, setting)] - fixed) / max(1, base_peak - fixed),
            times[(tool, setting)] / base_time - 1,
            *predicted.get((tool, setting), (None, None)),
            notes.get((tool, setting), ""),
        )
        for tool, setting in steps
    ]
    return measured + at_predict_batch


def _predicted_points(
    model, input_shape, batch, modes, fractions, activation_fractions, solver, frees,
    time_limit, device, folder, say, outputs_held=True,
) -> list[Point]:  # fmt: skip
    """monet_like's schedules at `batch`, compiled (profiled at small batches, captured
    and simulated on fake tensors) but not run: predicted points."""
    from monet_like.pipeline import compile_schedule

    basis = f"predicted at batch {batch}"
    x = torch.empty((batch, *input_shape), device="meta")
    fixed = fixed_bytes(model, x)
    found = []
    for mode in modes:
        common = dict(
            mode=mode, solver=solver, device=device, time_limit=time_limit, frees=frees,
            outputs_held=outputs_held,
        )  # fmt: skip
        top = compile_schedule(model, input_shape, batch, budget_fraction=1.0, **common)
        store_all = top.solution.store_all_peak_bytes
        low = None
        if activation_fractions:
            points = [
                {"budget_bytes": int(fixed + f * (store_all - fixed))} for f in activation_fractions
            ]
        else:
            points = [{"budget_fraction": f} for f in fractions]
        for k, budget in enumerate(points):
            try:
                compiled = compile_schedule(
                    model, input_shape, batch, min_budget_bytes=low,
                    output=folder / f"{mode}_predicted_{batch}_{k}.json", **budget, **common,
                )  # fmt: skip
            except UserError as exc:
                say(f"monet_like {mode}, {basis}, {budget}: no schedule ({exc})")
                continue
            low = compiled.min_budget_bytes if low is None else low
            sol = compiled.solution
            found.append(
                Point(
                    f"monet_like {mode}",
                    f"budget {sol.budget_bytes / GIB:.4f} GB",
                    sol.predicted_peak_bytes,
                    sol.predicted_peak_bytes / store_all,
                    (sol.predicted_peak_bytes - fixed) / max(1, store_all - fixed),
                    sol.overhead,
                    sol.predicted_peak_bytes,
                    sol.overhead,
                    "",
                    basis,
                )
            )
            say(
                f"monet_like {mode}, {basis}, budget {sol.budget_bytes / GIB:.4f} GB:"
                f" predicted {sol.predicted_peak_bytes / GIB:.4f} GB {sol.overhead:+.2%}"
            )
    return found


def published(model: nn.Module, expression: str, batch: int, input_shape) -> list[Point]:
    """MONeT's published points (a P100 GPU, its paper's table) where `expression` at
    `batch` and `input_shape` is one of its five configurations: peaks as fractions of
    its PyTorch peak, activation memory above this model's fixed part at that batch."""
    from monet_like.zoo import published_points

    fixed = fixed_bytes(model, torch.empty((batch, *input_shape), device="meta"))
    points = []
    for gb, overhead, pytorch_gb in published_points(expression, batch, input_shape):
        peak, top = int(gb * GIB), int(pytorch_gb * GIB)
        points.append(
            Point(
                "MONeT",
                f"peak {gb:g} GB",
                peak,
                peak / top,
                (peak - fixed) / max(1, top - fixed),
                overhead,
                basis="published: P100 GPU, MONeT's paper",
            )
        )
    return points


def fixed_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """What every tool holds whatever its plan: parameters, their gradients, buffers and
    the input. The rest of a step's peak is activations and workspace."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return 2 * params + buffers + x.numel() * x.element_size()


def _step(
    net: nn.Module, x: torch.Tensor, params: nn.Module | None = None, outputs_held: bool = True
):
    """One training step of `net` on `x` (gradients of `params`, default `net`, reset),
    with the outputs held to its end (`outputs_held`) or dropped before backward."""
    from monet_like.memory import training_step

    owner = params if params is not None else net

    def step() -> None:
        owner.zero_grad(set_to_none=True)
        training_step(net, x, hold_outputs=outputs_held)
        if x.is_cuda:  # kernels run on after backward returns: a step's time ends with them
            torch.cuda.synchronize(x.device)

    return step


def _interleaved_times(steps: dict, repeats: int) -> dict:
    """Median seconds per step of each entry, taken round-robin so that load on a shared
    machine falls on every entry alike; the first round is a warm-up."""
    samples: dict = {key: [] for key in steps}
    for round_ in range(repeats + 1):
        for key, step in steps.items():
            started = time.perf_counter()
            step()
            if round_:
                samples[key].append(time.perf_counter() - started)
    return {key: statistics.median(values) for key, values in samples.items()}


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost children of an nn.Sequential or nn.ModuleList that hold parameters
    (a network's repeated blocks; the root's own children where it is one), none inside
    another (a ResNet block's downsample stays in its block)."""
    found = []
    for container in model.modules():
        if isinstance(container, nn.Sequential | nn.ModuleList):
            found += [m for m in container.children() if any(True for _ in m.parameters())]
    inner = {id(d) for m in found for d in m.modules() if d is not m}
    return [m for m in found if id(m) not in inner]


def _peers(model: nn.Module):
    """(key, a function that builds the module to step, note) for every peer that
    applies to `model`."""
    from functools import partial

    if isinstance(model, nn.Sequential):
        for segments in SEGMENTS:
            if segments < len(model):
                key = ("checkpoint_sequential", f"{segments} segments")
                yield key, partial(_Segmented, model, segments), ""
    blocks = _blocks(model)
    if blocks:
        for policy in ("recompute all", "save matmul/conv outputs"):
            key = ("block checkpointing", f"{policy}, {len(blocks)} blocks")
            yield key, partial(_checkpointed_blocks, model, policy), ""
    for budget in PARTITIONER_BUDGETS:
        key = ("compile partitioner", f"activation_memory_budget {budget}")
        yield key, partial(_partitioned, model, budget), "BatchNorm running statistics off"


class _Segmented(nn.Module):
    """`model` (an nn.Sequential) run through checkpoint_sequential in `segments`."""

    def __init__(self, model: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.model, self.segments = model, segments

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint_sequential

        return checkpoint_sequential(self.model, self.segments, t, use_reentrant=False)


def _checkpointed_blocks(model: nn.Module, policy: str) -> nn.Module:
    """A copy of `model` (same weights) whose blocks run under torch.utils.checkpoint."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    net = copy.deepcopy(model)
    targets = set(map(id, _blocks(net)))
    aten = torch.ops.aten
    compute = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default}

    def keep_compute(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in compute else CheckpointPolicy.PREFER_RECOMPUTE

    kwargs = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT}
    if policy != "recompute all":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, keep_compute)
    apply_activation_checkpointing(
        net,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, **kwargs),
        check_fn=lambda m: id(m) in targets,
    )
    return net


def _partitioned(model: nn.Module, budget: float) -> nn.Module:
    """A copy of `model` (same weights, BatchNorms without running statistics) compiled
    with AOTAutograd's min-cut partitioner at `budget`, its graphs run unfused."""
    import torch._functorch.config as functorch_config
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    net = copy.deepcopy(model)
    for m in net.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None

    def as_is(gm, _inputs):
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=as_is, bw_compiler=as_is, partition_fn=min_cut_rematerialization_partition
    )
    compiled = torch.compile(net, backend=backend, dynamic=False)

    class Budgeted(nn.Module):  # the budget must hold while the first call compiles
        def __init__(self) -> None:
            super().__init__()
            self.net = compiled

        def forward(self, t):
            with functorch_config.patch(activation_memory_budget=budget):
                return self.net(t)

    return Budgeted()


def write(points: list[Point], folder: str | Path, title: str) -> tuple[Path, Path]:
    """frontier.csv (one row per tool and setting, `tool` first) and frontier.png
    (activation memory against overhead, one line per tool) in `folder`."""
    import matplotlib
    import pandas as pd

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame([asdict(p) for p in points])
    csv = folder / "frontier.csv"
    df.to_csv(csv, index=False)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (tool, basis), g in df.groupby(["tool", "basis"], sort=False):
        g = g.sort_values("activation_fraction")
        measured = basis == "measured"
        ax.plot(
            100 * g["activation_fraction"],
            100 * g["overhead"],
            marker="o" if measured else "x",
            linestyle="-" if measured else "--",
            label=tool if measured else f"{tool}, {basis}",
        )
    predicted = (df["basis"] != "measured").any()
    ax.set_xlabel(
        "activation memory (peak minus weights, gradients, input), % of eager's"
        + (" (dashed: predicted, % of the store-all prediction)" if predicted else ", measured")
    )
    ax.set_ylabel("step time over eager's (%)" + (", dashed: predicted" if predicted else ""))
    ax.set_title(title, fontsize=9)
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = folder / "frontier.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return csv, png


def table(points: list[Point]) -> str:
    """The points as a fixed-width table."""
    tool_w = max(len("tool"), *(len(p.tool) for p in points))
    setting_w = max(len("setting"), *(len(p.setting) for p in points))
    lines = [
        f"{'tool':{tool_w}s} {'setting':{setting_w}s} {'peak GB':>9s} {'of eager':>8s}"
        f" {'act.':>6s} {'overhead':>9s} {'predicted':>16s}"
    ]
    if any(p.basis != "measured" for p in points):
        lines[0] += "  basis"
    for p in points:
        pred = ""
        if p.predicted_peak_bytes is not None:
            pred = f"{p.predicted_peak_bytes / GIB:.4f} {p.predicted_overhead:+.1%}"
        row = (
            f"{p.tool:{tool_w}s} {p.setting:{setting_w}s} {p.measured_peak_bytes / GIB:9.4f}"
            f" {p.memory_fraction:8.1%} {p.activation_fraction:6.1%} {p.overhead:+9.1%}"
            f" {pred:>16s}"
        )
        if p.basis != "measured":
            row += f"  {p.basis}"
        lines.append(row.rstrip())
    return "\n".join(lines)
