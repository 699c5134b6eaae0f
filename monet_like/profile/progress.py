"""A profile's progress: each stage's seconds as it ends, and one bar for the whole
profile whose length is the seconds spent plus those estimated for the stages left, so
that it says how long the profile has to go. The estimates come from what the profile
has measured so far (its timed runs, its ops' times and fitted workspace) and are
replaced as it measures more; each stage's end puts the bar back on the clock."""

from __future__ import annotations

import sys
import time

import torch

from monet_like.graph import Graph
from monet_like.profile.timing import _bar_hidden

# Ratios the estimates use, measured in cold profiles on this project's 2-core CPU: rough
# (each stage's end puts the bar back on the clock).
# A run recording allocations (the workspace run) over a timed run of the same graph:
# 1.0 in ResNet-50's (184) profile at batches 4 and 8.
WORKSPACE_RUN = 1.0
# An op measured alone at the solved batch (random inputs written, the library's first
# call at those shapes) over its time at the profile's batch scaled linearly, an op
# under ALONE_REPEAT_BELOW counted 1 + ALONE_REPEATS times (it is timed again so): in
# full-mode profiles, the variants' graph's pass, 1.21 for ResNet-50 (184; 44.3 s alone
# where the times so counted were 36.6 s), 1.19 for ResNet-18 (32, 64 px) and 1.16 for
# GoogLeNet (32, 112 px). The captured graph's few ops left run 1.4 to 2.9 times their
# estimate (at 184 writing their inputs outweighs them), a second or two.
ALONE_OVER_STEP = 1.2
# A convolution site's algorithms timed and measured (each algorithm of each direction,
# a recorded call and two timed rounds, and their workspace at a second batch) over the
# site's forward and backward in the step, at the batch they are timed at: 22.8 in
# ResNet-50's (184) full-mode profile, 22.2 in ResNet-18's (32, 64 px) and 22.4 in
# GoogLeNet's (32, 112 px), whose layers are timed at the batch itself.
ALGORITHM_CALLS = 22.5


class Stages:
    """Each stage's seconds, in order (`seconds`), and the profile's bar.

    `expect(name, seconds)` sets the estimate of a stage to come; `done(name)` ends the
    running stage; `tick()` moves the bar within one (an op, a site). Without an
    estimate yet there is no bar. Without a terminal (`progress` None) the bar is hidden
    and a line per stage as it ends keeps a log telling where a long profile is."""

    def __init__(self, model: str, progress: bool | None, desc: str) -> None:
        self.model = model
        self.seconds: dict[str, float] = {}
        self.expected: dict[str, float] = {}
        self.began = self.started = time.perf_counter()
        self.lines = progress is None and not sys.stderr.isatty()
        self.hidden = _bar_hidden(progress)
        self.desc = desc
        self.bar = None

    def expect(self, name: str, seconds: float) -> None:
        self.expected[name] = max(0.0, seconds)
        self.tick()

    def left_s(self) -> float:
        """The seconds the stages expected are estimated to take from now: those of the
        running stage already spent are taken off."""
        spent = time.perf_counter() - self.started
        return max(0.0, sum(self.expected.values()) - spent)

    def tick(self) -> None:
        if not self.expected or self.hidden is True:
            return
        from tqdm import tqdm

        left = self.left_s()
        elapsed = time.perf_counter() - self.began
        if self.bar is None:
            self.bar = tqdm(
                total=elapsed + left,
                desc=self.desc,
                disable=self.hidden,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}{postfix}",
            )
        self.bar.total = elapsed + left
        self.bar.n = elapsed
        self.bar.set_postfix_str(f"about {tqdm.format_interval(left)} left", refresh=False)
        self.bar.refresh()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self.started = now - self.started, now
        self.expected.pop(name, None)
        if self.lines:
            print(f"  profiling {self.model}: {name}, {self.seconds[name]:.1f} s", flush=True)
        self.tick()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.n = self.bar.total
            self.bar.set_postfix_str("done", refresh=False)
            self.bar.close()


def alone_seconds(
    graph: Graph,
    times: list[float],
    device: torch.device,
    done=None,
    profile_batch: int | None = None,
) -> float:
    """Estimated seconds of `_remeasure_alone(graph, device, ...)`: each distinct op it
    will run (by `_op_signature`, not in `done`, the signatures measured already)
    ALONE_OVER_STEP times its estimated time in the step at the solved batch (`times`, per
    op), at the smaller batch `reduced_batch` gives where it allows one (from
    `profile_batch`) and the op is not `_sized_by_shape`, and 1 + ALONE_REPEATS times that
    where it is under ALONE_REPEAT_BELOW (timed again so)."""
    from monet_like.profile.workspace import (
        ALONE_REPEAT_BELOW,
        ALONE_REPEATS,
        _alone_ops,
        _sized_by_shape,
        reduced_batch,
    )

    if device.type != "cpu" or graph.fx is None:
        return 0.0
    reduced = None if profile_batch is None else reduced_batch(graph.batch, profile_batch)
    to_run: dict[tuple, float] = {}
    for op, node, signature in _alone_ops(graph, device):
        if signature not in (done or {}):
            share = 1.0 if reduced is None or _sized_by_shape(node) else reduced / graph.batch
            seconds = times[op.index] * share
            calls = 1 + ALONE_REPEATS if seconds < ALONE_REPEAT_BELOW else 1
            to_run.setdefault(signature, seconds * calls)
    return ALONE_OVER_STEP * sum(to_run.values())


def algorithm_seconds(graph: Graph, times: list[float], profile_batch: int) -> float:
    """Estimated seconds of `_algorithm_options(graph, ...)`: each distinct convolution
    site ALGORITHM_CALLS times its forward and backward in the step (`times`, per op, at
    the solved batch) scaled to the batch its algorithms are timed at."""
    from monet_like.profile.algorithms import _site_signature, _timing_batch
    from monet_like.variants import algorithm_sites

    if graph.fx is None:
        return 0.0
    nodes = {n.name: n for n in graph.fx.graph.nodes}
    index = {op.name: op.index for op in graph.ops}
    per_site: dict[tuple, float] = {}
    for site in algorithm_sites(graph):
        forward = nodes[site["forward"][0]]
        weight, out = forward.args[1].meta["val"].shape, forward.meta["val"].shape
        timed_at = _timing_batch(weight, out, graph.batch, profile_batch)
        step_s = times[index[site["forward"][0]]]
        if site["backward"]:
            step_s += times[index[site["backward"]]]
        per_site.setdefault(_site_signature(site, nodes), step_s * timed_at / graph.batch)
    return ALGORITHM_CALLS * sum(per_site.values())
