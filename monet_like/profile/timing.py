"""Timing ops: a captured graph run op by op on real tensors (the median of repeats per
op), and calls timed interleaved (the least of rounds)."""

from __future__ import annotations

import statistics
import time

import torch

from monet_like.graph import Graph


class _OpRunner:
    """Runs a captured joint graph on real tensors, one fx node at a time, timing each."""

    def __init__(self, graph: Graph, device: torch.device) -> None:
        self.graph = graph
        self.device = device
        self.index = {op.name: op.index for op in graph.ops}

    def run(self, args: list, on_op=None) -> None:
        from torch.fx import Interpreter

        runner = self

        class Timed(Interpreter):
            def run_node(self, n):
                idx = runner.index.get(n.name)
                if idx is None or on_op is None:
                    return super().run_node(n)
                return on_op(idx, lambda: super(Timed, self).run_node(n))

        with torch.no_grad():
            Timed(self.graph.fx).run(*args)


def _median_times(
    runner: _OpRunner,
    args_fn,
    repeats: int,
    progress,
    spread: list | None = None,
    warm_up: bool = True,
) -> list[float]:
    """Each op's median time over `repeats` timed runs of the whole graph, after one
    warm-up run (`warm_up` False: the caller has just run the graph). `spread`, where
    given, receives the relative spread of the runs' totals, (max - min) / median: how
    far the machine's noise moved the step."""
    n = len(runner.graph.ops)
    samples: list[list[float]] = [[] for _ in range(n)]
    cuda = runner.device.type == "cuda"

    first = 0 if warm_up else 1
    for r in range(first, repeats + 1):  # run 0 warms up and is dropped
        events: list[tuple[int, object, object]] = []

        def on_op(idx, fn, events=events):
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                out = fn()
                end.record()
                events.append((idx, start, end))
                return out
            t0 = time.perf_counter()
            out = fn()
            events.append((idx, time.perf_counter() - t0, None))
            return out

        runner.run(args_fn(), on_op)
        if cuda:
            torch.cuda.synchronize(runner.device)
        if r > 0:
            for idx, a, b in events:
                samples[idx].append(a.elapsed_time(b) / 1e3 if cuda else a)
        progress(1)
    if spread is not None:
        totals = [sum(s[r] for s in samples if len(s) > r) for r in range(repeats)]
        middle = statistics.median(totals) if totals else 0.0
        spread.append((max(totals) - min(totals)) / middle if middle > 0 else 0.0)
    return [statistics.median(s) if s else 0.0 for s in samples]


def _bar_hidden(progress: bool | None) -> bool | None:
    """tqdm's `disable` for a `progress` flag: None lets tqdm ask the terminal."""
    return None if progress is None else not progress


def _fastest_interleaved(calls: list, device: torch.device, rounds: int) -> list[float]:
    """Seconds of each call: the least over `rounds` rounds that run every call once in
    turn, after a warm-up round. Interleaved, so a busy spell of a shared machine falls
    on all of them alike; the least, because noise only ever adds time."""
    cuda = device.type == "cuda"
    best = [float("inf")] * len(calls)
    for r in range(rounds + 1):
        for i, call in enumerate(calls):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            call()
            if cuda:
                torch.cuda.synchronize(device)
            if r:
                best[i] = min(best[i], time.perf_counter() - t0)
    return best
