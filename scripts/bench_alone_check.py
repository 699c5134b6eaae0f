"""A slow spell while ops are timed alone, with and without the check that finds it.

    python scripts/bench_alone_check.py [--model "torchvision.models.resnet50()"]
        [--input_shape 3,64,64] [--batch 16] [--hog_s 1.0] [--hogs 2] [--spell_at 0]

Profiles the model four times with no cache: quiet; with `--hogs` busy processes
started `--spell_at` seconds after the ops alone begin and stopped `--hog_s` seconds
later (a slow spell over the pass's start, by default), checked as a profile is
(`workspace._check_alone`); the same spell unchecked; quiet again. Prints, for each, the
check's drift, the ops run beside other work ("beside": other processes took over a
fifth of the machine) and those timed again ("again"), where the whole pass was timed
again how far its first ops' kept times were from a third timing ("after"), the
forward convolutions' and the whole step's times, the seconds the ops alone took (their
stage), and what the profile says of its noise: checked, the spelled profile's times
should match the quiet ones; unchecked, they do not.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import warnings

import torch

import monet_like.profile as profile_module
from monet_like.graph import capture
from monet_like.models import parse_input_shape, parse_model
from monet_like.profile import workspace as workspace_module

warnings.filterwarnings("ignore", category=FutureWarning)


def with_spell(remeasure, hog_s: float, hogs: int, spell_at: float = 0.0):
    """`remeasure` (`_remeasure_alone`) with `hogs` busy processes from `spell_at` seconds
    into it for `hog_s` seconds."""

    def spelled(*args, **kwargs):
        busy: list[subprocess.Popen] = []

        def start() -> None:
            busy.extend(
                subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)
            )
            stopper.start()

        def stop() -> None:
            for p in busy:
                p.kill()
                p.wait()

        stopper = threading.Timer(hog_s, stop)
        starter = threading.Timer(spell_at, start)
        starter.start()
        try:
            return remeasure(*args, **kwargs)
        finally:
            starter.cancel()
            starter.join()
            stopper.cancel()
            stop()

    return spelled


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="torchvision.models.resnet50()")
    ap.add_argument("--input_shape", default="3,64,64")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hog_s", type=float, default=1.0, help="seconds of the slow spell")
    ap.add_argument("--hogs", type=int, default=2, help="busy processes during it")
    ap.add_argument("--spell_at", type=float, default=0.0, help="its start, s into the pass")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    spec = parse_model(args.model)
    model = spec.build("cpu")
    graph = capture(model, parse_input_shape(args.input_shape), args.batch)
    forward_convs = [
        op.index
        for op in graph.ops
        if op.target == "aten.convolution.default" or op.name.startswith("conv2d_")
    ]
    real_remeasure = profile_module._remeasure_alone
    real_ops, real_others = workspace_module.ALONE_CHECK_OPS, workspace_module._others_cpu_s
    spelled = with_spell(real_remeasure, args.hog_s, args.hogs, args.spell_at)
    runs = [
        ("quiet", real_remeasure, True),
        ("slow spell, checked", spelled, True),
        ("slow spell, no check", spelled, False),
        ("quiet again", real_remeasure, True),
    ]
    alone_stage = f"ops alone at batch {graph.batch}"
    print(
        f"{'profile':22s} {'drift':>7s} {'beside':>6s} {'again':>5s} {'after':>6s}"
        f" {'fwd convs s':>11s}"
        f" {'step s':>7s} {'stage s':>7s}  noise"
    )
    for name, remeasure, checked in runs:
        profile_module._remeasure_alone = remeasure
        if not checked:  # neither the first ops timed again nor other work's CPU time read
            workspace_module.ALONE_CHECK_OPS = 10**9
            workspace_module._others_cpu_s = lambda: None
        try:
            prof = profile_module.profile(model, graph, use_cache=False, progress=False)
        finally:
            profile_module._remeasure_alone = real_remeasure
            workspace_module.ALONE_CHECK_OPS = real_ops
            workspace_module._others_cpu_s = real_others
        drift = "-" if prof.alone_drift is None else f"{prof.alone_drift:+.1%}"
        after = "-" if prof.alone_drift_after is None else f"{prof.alone_drift_after:+.1%}"
        times = prof.op_times_s
        print(
            f"{name:22s} {drift:>7s} {prof.alone_contended:6d} {prof.alone_retimed:5d}"
            f" {after:>6s} {sum(times[i] for i in forward_convs):11.3f} {sum(times):7.3f}"
            f" {prof.stage_seconds.get(alone_stage, 0.0):7.1f}  {prof.noisy or '-'}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
