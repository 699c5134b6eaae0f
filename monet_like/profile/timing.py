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
    runs: list | None = None,
) -> list[float]:
    """Each op's median time over `repeats` timed runs of the whole graph, after one
    warm-up run (`warm_up` False: the caller has just run the graph). `spread`, where
    given, receives the relative spread of the runs' totals, (max - min) / median: how
    far the machine's noise moved the step; `runs` each timed run's times, per op."""
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
    if runs is not None:
        runs.extend([s[r] if len(s) > r else 0.0 for s in samples] for r in range(repeats))
    return [statistics.median(s) if s else 0.0 for s in samples]


def _pooled_medians(
    a_runs: list[list[float]], b_runs: list[list[float]], pairs: dict[int, int]
) -> tuple[list[float], list[float]]:
    """Per-op times of two graphs from their timed runs at one batch, taken one after
    the other, put on one footing: each run is scaled so that the ops the graphs share
    (`pairs`: op index in a -> op index in b, the same kernels) take the same total in
    every run, which takes out the machine's speed during that run; then each op gets
    its median over its graph's runs, and each shared op one time for both, the median
    over both graphs' runs. Each graph's own ops are so measured against the shared
    ones, not against a speed estimated after fitting times to another batch (which
    multiplies a busy spell's error by the distance between the batches). Each graph
    has at least one run."""

    def scaled(runs: list[list[float]], shared: list[float], middle: float) -> list[list[float]]:
        if middle <= 0:  # nothing shared took time: nothing to scale by
            return runs
        return [
            [t * middle / s for t in r] if s > 0 else r for r, s in zip(runs, shared, strict=True)
        ]

    def medians(runs: list[list[float]]) -> list[float]:
        return [statistics.median(col) for col in zip(*runs, strict=True)]

    shared_a = [sum(r[i] for i in pairs) for r in a_runs]
    shared_b = [sum(r[j] for j in pairs.values()) for r in b_runs]
    middle = statistics.median(shared_a + shared_b)
    a, b = scaled(a_runs, shared_a, middle), scaled(b_runs, shared_b, middle)
    times_a, times_b = medians(a), medians(b)
    for i, j in pairs.items():
        times_a[i] = times_b[j] = statistics.median([r[i] for r in a] + [r[j] for r in b])
    return times_a, times_b


def _bar_hidden(progress: bool | None) -> bool | None:
    """tqdm's `disable` for a `progress` flag: None lets tqdm ask the terminal."""
    return None if progress is None else not progress


def _fastest_interleaved(
    calls: list, device: torch.device, rounds: int, warm_up: bool = True
) -> list[float]:
    """Seconds of each call: the least over `rounds` rounds that run every call once in
    turn, after a warm-up round where `warm_up`. Interleaved, so a busy spell of a
    shared machine falls on all of them alike; the least, because noise only ever adds
    time."""
    cuda = device.type == "cuda"
    best = [float("inf")] * len(calls)
    for r in range(0 if warm_up else 1, rounds + 1):
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
