"""schedule.py: replay a solved schedule and check its peak, time and exactness."""

from __future__ import annotations

import argparse
import os
import time

import torch

from monet_like.cli.common import (
    CheckFailed,
    _naming,
    _Parser,
    _run,
    _setup,
    default_solution_name,
    positive_int,
)
from monet_like.errors import UserError
from monet_like.units import GIB


def build_check_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="schedule.py", description="replay a solved schedule and check it")
    p.add_argument("model", help='"torchvision.models.NAME(...)", unet, gpt, or pkg.module:factory')
    p.add_argument("batch", type=positive_int, help="batch size")
    p.add_argument("budget_gb", type=float, help="the budget the schedule was solved for (GB)")
    p.add_argument("mode", help="the mode it was solved in")
    p.add_argument("solver", help="the solver it was solved with")
    p.add_argument(
        "--solution_file", help="a file or zoo:NAME (default: solutions/solution_<model>_...json)"
    )
    p.add_argument("--input_shape", help="per-sample input shape without batch, e.g. 3,224,224")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--run_bs", action="store_true", help="one step: measured peak and time")
    p.add_argument("--check_runtime", action="store_true", help="time vs eager, interleaved")
    p.add_argument("--iterations", type=positive_int, default=5, help="for --check_runtime")
    p.add_argument("--check_diff", action="store_true", help="outputs and gradients vs eager")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")
    return p


def cmd_check(args) -> dict:
    import copy
    import statistics

    from monet_like.graph import default_loss
    from monet_like.models import make_input
    from monet_like.variants.conv import eager_with_algorithms
    from monet_like.verify import (
        ROUNDING_RATIO,
        VARIANT_TOLERANCE,
        autocast_context,
        compare_steps,
        full_float32,
        measured_peak,
        runs_native_lstm,
        training_step,
        with_float64_ratio,
    )
    from monet_like.wrapper import ScheduleWrapper

    spec, shape, dtype, device = _setup(args)
    args.shape, args.torch_dtype = shape, dtype
    path = args.solution_file or os.path.join(
        "solutions",
        default_solution_name(spec, args.batch, args.mode, args.budget_gb, **_naming(args)),
    )
    torch.manual_seed(0)
    model = spec.build("cpu").to(device=device, dtype=dtype)
    wrapped = ScheduleWrapper(model, path, shape)  # refuses a file that does not fit
    sol = wrapped.solution
    if sol.batch != args.batch:
        raise UserError(f"{path} was solved for batch {sol.batch}, not {args.batch}")
    report = {
        "solution_file": str(path),
        "predicted_peak_bytes": sol.predicted_peak_bytes,
        "budget_bytes": sol.budget_bytes,
    }
    print(f"{spec.expression} batch {args.batch}: schedule {path} ({sol.status}, {sol.mode})")
    x = make_input(model, shape, args.batch, dtype, device).requires_grad_(sol.input_grad)
    failures = []
    if args.run_bs or not (args.check_runtime or args.check_diff):
        t0 = time.perf_counter()
        peak = measured_peak(wrapped, x)
        seconds = time.perf_counter() - t0
        report.update(measured_peak_bytes=peak, step_time_s=seconds)
        ok = peak <= sol.budget_bytes
        how = "CPU allocator" if device.type == "cpu" else "CUDA allocator"
        print(
            f"  one step: measured peak {peak / GIB:.4f} GB ({how}), predicted"
            f" {sol.predicted_peak_bytes / GIB:.4f} GB, budget {sol.budget_bytes / GIB:.4f}"
            f" GB: {'within budget' if ok else 'OVER BUDGET'}; {seconds:.2f} s (measured)"
        )
        if not ok:
            failures.append("the measured peak exceeds the budget")
    if args.check_diff:
        replayed = copy.deepcopy(model)
        wrapped_copy = ScheduleWrapper(replayed, path, shape)
        references = [("eager PyTorch", "", copy.deepcopy(model))]
        if sol.algorithms:
            # The replay's own exactness: eager PyTorch running the same convolution
            # algorithms. Against plain eager, im2col's other summation order can flip
            # a value at a ReLU's threshold, and that moves every gradient below it.
            same = eager_with_algorithms(model, wrapped.graph, sol.algorithms)
            label = "eager PyTorch with the same convolution algorithms"
            references.append((label, "_same_kernels", same))
        if device.type == "cuda":
            print("  compared in full float32 (TF32 off on both sides)")
        with full_float32():
            replay_step = training_step(wrapped_copy, replayed, x, sol.input_grad, sol.autocast)
        for label, suffix, eager in references:
            with full_float32():
                eager_step = training_step(eager, eager, x, sol.input_grad, sol.autocast)
            diff = compare_steps(eager, eager_step, replayed, replay_step)
            report.update({f"{key}{suffix}": value for key, value in diff.as_dict().items()})
            if diff.max_abs_input_grad_diff is not None:
                print(
                    f"  input gradient vs {label}: largest difference"
                    f" {diff.max_abs_input_grad_diff:.3g}"
                )
            print(
                f"  vs {label}: largest output difference {diff.max_abs_output_diff:.3g},"
                f" gradient {diff.max_abs_grad_diff:.3g} absolute,"
                f" {diff.max_rel_grad_diff:.3g} relative, buffers {diff.max_abs_buffer_diff:.3g}"
            )
        # The verdict, against the reference running the replay's kernels: bitwise where
        # those are eager's own, within VARIANT_TOLERANCE where variants or a CPU LSTM run.
        # On CUDA eager is not bitwise equal to itself (atomic adds in pooling and
        # convolution backward sum in any order), so there the rule is the tolerance.
        bitwise = not sol.variants and not runs_native_lstm(model, device) and device.type == "cpu"
        rule = "bitwise" if bitwise else f"within {VARIANT_TOLERANCE:g} relative"
        if not bitwise:
            diff = with_float64_ratio(diff, model, x, sol, eager, eager_step, replayed, replay_step)
        ratio = diff.float64_error_ratio
        if ratio is not None:
            print(
                f"  vs the same step in float64: the replay's error is at most {ratio:.2f}"
                f" times eager's own, tensor by tensor (rounding: <= {ROUNDING_RATIO:g})"
            )
            rule += f", or rounding against float64 (<= {ROUNDING_RATIO:g} times eager's)"
            report["float64_error_ratio"] = ratio
        exact = diff.bitwise if bitwise else diff.within(VARIANT_TOLERANCE)
        print(f"  check: equal to {label} ({rule}): {'ok' if exact else 'FAILED'}")
        report["exact"] = exact
        if not exact:
            failures.append(f"the replay differs from {label} beyond {rule}")
    if args.check_runtime:
        times: dict[str, list[float]] = {"eager": [], "schedule": []}
        for _ in range(args.iterations + 1):  # interleaved; the first pair warms up
            for name, net in (("eager", model), ("schedule", wrapped)):
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                with autocast_context(device.type, sol.autocast):
                    out = net(x)
                default_loss(out).backward()
                del out
                if device.type == "cuda":  # backward returns before its kernels end
                    torch.cuda.synchronize(device)
                times[name].append(time.perf_counter() - t0)
        eager_s = statistics.median(times["eager"][1:])
        sched_s = statistics.median(times["schedule"][1:])
        report.update(time_ratio=sched_s / eager_s, eager_step_s=eager_s, schedule_step_s=sched_s)
        print(
            f"  step time: schedule {sched_s:.3f} s, eager {eager_s:.3f} s, ratio"
            f" {sched_s / eager_s:.3f} (median of {args.iterations}, interleaved)"
        )
    if failures:
        args.failed_report = report
        raise CheckFailed("; ".join(failures))
    return report


def check_main(argv: list[str] | None = None) -> int:
    """Entry point of schedule.py."""
    return _run("schedule.py", build_check_parser().parse_args(argv), cmd_check)
