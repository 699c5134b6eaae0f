"""Does timing ops one by one overstate a CUDA step? For scripts/gpu_check.sh.

On an H200 the profile's store-all step (each op timed between two CUDA events) was 1%
(normal mode) and 7% (full mode) above eager PyTorch's step for ResNet-50 at batch 184,
while each schedule ran at its predicted time. A suspect: while Python dispatches an op,
the GPU, idle, has already passed the op's start event, so the dispatch is counted in
the op's time; eager PyTorch's queue hides it. This prints, for one model, eager's step
(median of interleaved steps), the sum of the ops' medians timed as the profiler times
them, and the same with the GPU kept busy (`torch.cuda._sleep`) before each op's start
event, so that the op's kernels are queued before it is passed. Where the second sum
meets eager's step and the first does not, the profiler should keep the GPU busy so.

Usage: python scripts/gpu_timing_probe.py [--batch 184] [--mode normal] [--repeats 5]
       (on a machine without CUDA: the CPU, ResNet-18 at 32 px, to try the script)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision

from monet_like.graph import capture
from monet_like.profile import _real_args
from monet_like.profile.timing import _median_times, _OpRunner
from monet_like.variants import apply as apply_variants

SPIN_CYCLES = 200_000  # about 0.1 ms at 2 GHz: longer than one op's dispatch


class _BusyStartEvents:
    """torch.cuda.Event made in pairs (start, end), as `_median_times` makes them: each
    start event's record() is preceded by a spin kernel."""

    def __init__(self) -> None:
        self.real = torch.cuda.Event
        self.made = 0

    def __call__(self, *args, **kwargs):
        event = self.real(*args, **kwargs)
        if self.made % 2 == 0:
            record = event.record

            def busy_record(*a, **k):
                torch.cuda._sleep(SPIN_CYCLES)
                return record(*a, **k)

            event.record = busy_record
        self.made += 1
        return event


def eager_step_s(model, x, steps: int) -> float:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    times = []
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        model(x).sum().backward()
        sync()
        if i:  # the first warms up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=184 if cuda else 8)
    parser.add_argument("--mode", default="normal", help="normal, or a mode whose variants")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    model = (torchvision.models.resnet50() if cuda else torchvision.models.resnet18()).to(device)
    shape = (3, 224, 224) if cuda else (3, 32, 32)
    graph = capture(model, shape, args.batch, torch.float32, device, "resnet")
    if args.mode != "normal":
        graph = apply_variants(graph, args.mode)
    x = torch.randn(args.batch, *shape, device=device)
    fresh = _real_args(model, graph, device, torch.float32)

    def ops_sum() -> float:
        return sum(_median_times(_OpRunner(graph, device), fresh, args.repeats, lambda _n: None))

    eager = eager_step_s(model, x, 10)
    plain = ops_sum()
    print(f"{device.type}, batch {args.batch}, {args.mode}: {len(graph.ops)} ops")
    print(f"eager step (median of 10):           {eager:.4f} s")
    print(f"ops timed one by one, summed:        {plain:.4f} s ({plain / eager:.3f} of eager)")
    if cuda:
        busy = _BusyStartEvents()
        torch.cuda.Event = busy
        try:
            padded = ops_sum()
        finally:
            torch.cuda.Event = busy.real
        print(f"the same, GPU busy before each op:  {padded:.4f} s ({padded / eager:.3f} of eager)")
    print(f"eager step again:                    {eager_step_s(model, x, 10):.4f} s")


if __name__ == "__main__":
    main()
