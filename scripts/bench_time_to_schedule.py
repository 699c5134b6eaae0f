"""Time to a schedule, in units of one eager training step measured in the same run.

    python scripts/bench_time_to_schedule.py [--model "torchvision.models.resnet50()"]
        [--batch 184] [--budget 10] [--mode inplace_conv_multiway_newnode] [--solver CBC]
        [--unit_batch 8] [--keep DIR]

The README's headline command, stage by stage, as `solve.py --no_zoo` runs it (one
call of `compile_schedule`, each stage timed inside it): first with an empty profile
cache (cold), then again with the profiles it cached (warm); each profile stage's
seconds are printed against the progress bar's estimate of it.
The unit is one eager training step of the same model at `--unit_batch` (224 px),
the median of three, measured in this run before and after (the machine's speed
moves): each stage's seconds are printed as a multiple of it. Targets: the
cold run within 60 units, its profiling within 30; the warm run within 3 units plus
the solve.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from unittest import mock

import torch

from monet_like import pipeline
from monet_like.graph import default_loss
from monet_like.inputs import make_input
from monet_like.models import parse_model
from monet_like.profile import progress as progress_module
from monet_like.units import GIB


def eager_step_seconds(model, shape, batch: int, repeats: int = 3) -> float:
    """The median time of one eager training step (after a warm-up step)."""
    x = make_input(model, shape, batch, torch.float32, "cpu")
    times = []
    for k in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        default_loss(model(x)).backward()
        if k:
            times.append(time.perf_counter() - started)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def stages(model, shape, batch, budget, mode, solver) -> dict[str, float]:
    """Seconds of each stage of one solve, as `solve.py` runs it (one compile_schedule
    call): the capture (with the mode's rewrite), the profiles, and the rest (solve,
    schedule, simulation)."""
    seconds: dict[str, float] = {}

    def timed(name, fn):  # compile_schedule looks its stages up in the module at each call
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] = time.perf_counter() - started

        return run

    started = time.perf_counter()

    def line(text: str) -> None:  # the run's own lines, timed from its start
        print(f"    {time.perf_counter() - started:6.1f} s {text}", flush=True)

    estimates: list[tuple[str, float, float]] = []  # profile stage, its ETA, its seconds
    stage_done = progress_module.Stages.done

    def done(self, name: str) -> None:
        expected = self.expected.get(name)
        stage_done(self, name)
        if expected is not None:
            estimates.append((name, expected, self.seconds[name]))

    with (
        mock.patch.object(pipeline, "capture_graphs", timed("capture", pipeline.capture_graphs)),
        mock.patch.object(pipeline, "profile_graphs", timed("profile", pipeline.profile_graphs)),
        mock.patch.object(progress_module.Stages, "done", done),
    ):
        compiled = pipeline.compile_schedule(
            model, shape, batch, budget, mode, solver, time_limit=600, progress=line
        )
    total = time.perf_counter() - started
    for name, expected, took in estimates:  # how far the progress bar's estimates were off
        print(f"    {name}: estimated {expected:.1f} s, took {took:.1f} s ({took / expected:.2f}x)")
    sol = compiled.solution
    print(
        f"    schedule: {sol.status}, peak {sol.predicted_peak_bytes / GIB:.3f} GB,"
        f" overhead {sol.overhead:+.2%}, solve {sol.solve_time_s:.1f} s"
    )
    prof = compiled.profile
    if prof.alone_drift is not None and not prof.cached:  # how sure its times are
        print(
            f"    ops timed alone: their pass's first ops ran {prof.alone_drift:+.1%} slower"
            f" than timed again at its end; {prof.alone_contended} ran beside other work;"
            f" {prof.alone_retimed} timed again"
        )
    seconds["solve, check"] = total - seconds["capture"] - seconds["profile"]
    seconds["total"] = total
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="torchvision.models.resnet50()")
    ap.add_argument("--batch", type=int, default=184)
    ap.add_argument("--budget", type=float, default=10.0, help="GB")
    ap.add_argument("--mode", default="inplace_conv_multiway_newnode")
    ap.add_argument("--solver", default="CBC")
    ap.add_argument("--unit_batch", type=int, default=8)
    ap.add_argument(
        "--keep", metavar="DIR", help="profile into DIR and keep it (default: a temporary one)"
    )
    args = ap.parse_args(argv)
    if args.keep and os.path.exists(os.path.join(args.keep, "profiles")):
        ap.error(f"{args.keep} holds profiles already: the cold run needs an empty cache")
    spec = parse_model(args.model)
    torch.manual_seed(0)
    model = spec.build("cpu")
    shape = spec.default_input_shape() or (3, 224, 224)
    budget = int(args.budget * GIB)
    units = [eager_step_seconds(model, shape, args.unit_batch)]
    print(f"unit: one eager step at batch {args.unit_batch}, {units[0]:.2f} s")
    with (
        tempfile.TemporaryDirectory()
        if not args.keep
        else contextlib.nullcontext(args.keep) as cache
    ):
        os.environ["MONET_LIKE_CACHE"] = cache  # cold: nothing cached, the zoo's profiles
        import monet_like.profile as profile_module  # not read either

        profile_module.SHIPPED_PROFILES = profile_module.SHIPPED_PROFILES / "none"
        runs = {}
        for run in ("cold", "warm"):
            print(f"{run} run:", flush=True)
            runs[run] = stages(model, shape, args.batch, budget, args.mode, args.solver)
    units.append(eager_step_seconds(model, shape, args.unit_batch))
    unit = statistics.mean(units)
    print(f"unit: {units[0]:.2f} s before, {units[1]:.2f} s after; {unit:.2f} s used")
    print(f"\n{'stage':18s} {'cold s':>9s} {'cold units':>10s} {'warm s':>9s} {'warm units':>10s}")
    for stage in runs["cold"]:
        cold, warm = runs["cold"][stage], runs["warm"][stage]
        print(f"{stage:18s} {cold:9.1f} {cold / unit:10.1f} {warm:9.1f} {warm / unit:10.1f}")
    warm_setup = runs["warm"]["total"] - runs["warm"]["solve, check"]
    print(
        f"\ntargets: cold total <= 60 units: {runs['cold']['total'] / unit:.1f};"
        f" cold profiling <= 30: {runs['cold']['profile'] / unit:.1f};"
        f" warm, without the solve, <= 3: {warm_setup / unit:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
