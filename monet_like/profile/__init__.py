"""Stage 2: measure each node's time and workspace on the device in use.

Bytes come from the graph (exact, from shapes, at the full batch). Times and
workspace are measured by running the captured joint graph op by op on real
tensors: a warm-up run, then `repeats` timed runs, the median kept per op; one
more run under torch.profiler with memory recording gives each op's workspace
(the peak of what it allocates while it runs, above what it returns). On CUDA,
times come from CUDA events and workspace from the allocator's peak statistics.

On a slow device the profile may be taken at a smaller batch than the one solved
for (`scaled`, `profile_batch`). Workspace is not linear in the batch (a library picks
its blocking by shape), so on CPU it is measured in one run at the solved batch when
that run fits in half the available memory. Then each distinct op is run alone at the
solved batch on random inputs: timed there (its time in the profile), and, where the
step does not fit, its workspace measured there (at a quarter of a large solved batch
for an op other than a convolution: `workspace.reduced_batch`, its time scaled and its
workspace the line through the two batches); an op that cannot run alone (integer
inputs) and has workspace at the profile's batch that grows with it is measured at a
second batch too and fitted as a + b * batch. A view keeps its time at the profile's
batch, and an op that cannot run alone takes it scaled linearly; where those are too
large a share, the times are fitted from timed runs at both batches (per-op overhead
does not grow with the batch), and where no second batch fits (the batch is 1 or 2)
they scale linearly. `time_method` says which. Convolution algorithms (conv
mode) are timed apart, at or near the solved batch: see `_algorithm_options`.
Profiles are cached on disk as JSON, keyed by graph fingerprint, profile batch,
dtype, device and torch version.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch
from torch import nn

from monet_like.errors import UserError
from monet_like.files import atomic_write, cache_dir
from monet_like.graph import Graph, capture, tangents_for
from monet_like.profile.algorithms import (
    _algorithm_options,
    _aten_options_take,
    algorithm_workspace,
    backward_option,
    option,
    weight_grad_bytes,
)
from monet_like.profile.align import (
    _counterparts,
    _with_op_times,
    align_times,
    derived_profile,
)
from monet_like.profile.progress import (
    WORKSPACE_RUN,
    Stages,
    algorithm_seconds,
    alone_seconds,
)
from monet_like.profile.timing import _median_times, _OpRunner, _pooled_medians
from monet_like.profile.types import (
    BUSY_LOAD_PER_CORE,
    PROFILE_FORMAT,
    NodeProfile,
    Profile,
    _node_profiles,
    device_name,
    load_per_core,
)
from monet_like.profile.workspace import (
    AloneRuns,
    _alone_ops,
    _extrapolate,
    _extrapolate_float,
    _fits_in_memory,
    _remeasure_alone,
    _workspace_cpu,
    _workspace_cuda,
    _workspace_of,
    alone_runs_of,
)

__all__ = [
    "PROFILE_FORMAT",
    "SHIPPED_PROFILES",
    "NodeProfile",
    "Profile",
    "_with_op_times",
    "_workspace_of",
    "algorithm_workspace",
    "align_times",
    "backward_option",
    "cache_path",
    "cached_profile",
    "derived_profile",
    "device_name",
    "option",
    "profile",
    "weight_grad_bytes",
]

# Profiles the solution zoo was solved from (solutions/profiles/), read like the cache's.
SHIPPED_PROFILES = Path(__file__).resolve().parents[2] / "solutions" / "profiles"


def cache_path(graph: Graph, profile_batch: int, device: torch.device) -> Path:
    """Where `graph`'s profile at `profile_batch` on `device` is cached."""
    return cache_dir() / "profiles" / f"{_cache_key(graph, profile_batch, device)}.json"


def _cache_key(graph: Graph, profile_batch: int, device: torch.device) -> str:
    text = "|".join(
        [graph.fingerprint, str(profile_batch), graph.dtype, device_name(device), torch.__version__]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _real_args(model: nn.Module, graph: Graph, device: torch.device, dtype: torch.dtype):
    """Placeholders for the joint graph: parameters, copies of buffers, input, tangents."""
    from monet_like.inputs import make_input

    gen = torch.Generator(device="cpu").manual_seed(0)

    def prep(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(device)
        return t.to(dtype) if t.is_floating_point() else t

    params = [prep(p) for p in model.parameters()]
    x = make_input(model, graph.input_shape, graph.batch, dtype, "cpu", gen).to(device)
    tangents = tangents_for(graph, device)

    def fresh():  # buffers are updated in place by BatchNorm: never touch the model's
        return [*params, *[prep(b).clone() for b in model.buffers()], x, *tangents]

    return fresh


def profile(
    model: nn.Module,
    graph: Graph,
    profile_batch: int | None = None,
    device: str | torch.device | None = None,
    repeats: int = 3,
    use_cache: bool = True,
    progress: bool | None = None,
    captures: dict | None = None,
    beside: Graph | None = None,
) -> Profile:
    """Measure per-node times and workspace of `graph` (captured from `model`).

    `model` must hold real parameters (not "meta"). `profile_batch` defaults to the
    graph's batch on CUDA and to min(batch, 4) on CPU. `progress`: True shows a bar
    with the time left (`monet_like.profile.progress`), False nothing, None the bar on a
    terminal and otherwise a line per stage.
    `captures`: a dict kept by the caller across profiles of `model`'s graphs (the
    captured graph and its variants'): the model captured at each smaller batch is
    kept there and taken again by the next profile instead of being captured again.
    `beside`: another graph of `model` (the captured graph, where `graph` has variants)
    to be profiled next with the same `captures`: its timed runs at each batch are taken
    right after `graph`'s, both put on one footing run by run (`timing._pooled_medians`)
    and kept there: the ops the two graphs share get one time, and each graph's own ops
    are measured against them in the same minute, not minutes apart.
    """
    device = torch.device(device or graph.device)
    dtype = getattr(torch, graph.dtype)
    profile_batch = _profile_batch(graph, profile_batch, device)
    if not 1 <= profile_batch <= graph.batch:
        raise UserError(f"profile batch must be between 1 and {graph.batch}, got {profile_batch}")
    if any(p.is_meta for p in model.parameters()):
        raise UserError("the profiler needs a model with real parameters, not one on 'meta'")

    path = cache_path(graph, profile_batch, device)
    if use_cache and (cached := _cached_to_use(path, progress)) is not None:
        return cached
    started = time.perf_counter()
    load_at_start = load_per_core()

    def graph_at(batch: int) -> Graph:
        """The graph at `batch`; its building (capture, rewrite) is a stage where done."""
        key = _capture_key(graph, batch, device)
        reused = not graph.variants and captures is not None and key in captures
        built = _graph_at(model, graph, batch, device, captures)
        if batch != graph.batch and not reused:  # seconds on a large model
            stages.done(f"graph at batch {batch}")
        return built

    beside_too = beside is not None and captures is not None and beside.fx is not None
    shared = _counterparts(graph, beside) if beside_too else {}

    def run_timed(g: Graph, warm_up: bool = True, spread: list | None = None, args=None):
        """`g`'s timed runs (`_median_times`): each op's median, each run's times, and
        the seconds of one run."""
        runs: list[list[float]] = []
        started_runs = time.perf_counter()
        times = _median_times(
            _OpRunner(g, device),
            args or _real_args(model, g, device, dtype),
            repeats,
            lambda _n: stages.tick(),
            spread,
            warm_up,
            runs,
        )
        return times, runs, (time.perf_counter() - started_runs) / (repeats + int(warm_up))

    def time_beside(batch: int, run_s: float, own_runs: list, own: list[float]) -> list[float]:
        """`beside`'s timed runs at `batch`, right after `graph`'s (`own_runs`, their
        medians `own`): both put on one footing (`_pooled_medians`), `beside`'s kept in
        `captures`, `graph`'s returned (`own` where there is no `beside`)."""
        if not beside_too:
            return own
        stages.expect(f"{BESIDE} timed runs at batch {batch}", repeats * run_s)
        found: list[float] = []
        # No warm-up: `graph`'s runs just set up the kernels the two share (oneDNN's
        # convolutions); `beside`'s own ops are PyTorch's, with nothing to set up.
        theirs, beside_runs, beside_run_s = run_timed(
            _graph_at(model, beside, batch, device, captures), False, found
        )
        if own_runs and beside_runs:
            own, theirs = _pooled_medians(own_runs, beside_runs, shared)
        captures[_timed_key(beside, batch, device)] = {
            "times": theirs,
            "spread": found,
            "run_s": beside_run_s,
        }
        stages.done(f"{BESIDE} timed runs at batch {batch}")
        return own

    def timed_at(g: Graph, batch: int, warm_up: bool, spread=None, args=None):
        """`graph`'s times at `batch` (`g`) and the seconds of one run: as taken beside
        another graph's profile where they were (in this process: already warm), else
        timed now, with `beside`'s runs after them."""
        taken = _timed_beside(captures, graph, batch, device)
        if taken is not None:
            if spread is not None:
                spread.extend(taken["spread"])
            return taken["times"], taken["run_s"]
        times, runs, run_s = run_timed(g, warm_up, spread, args)
        stages.done(f"timed runs at batch {batch}")
        return time_beside(batch, run_s, runs, times), run_s

    from monet_like.variants import algorithm_sites

    scaled = profile_batch != graph.batch
    every_op = {op.index for op in graph.ops}
    at_batch: set[int] = set() if scaled else every_op  # ops whose workspace is measured there
    alone_s: dict[int, float] = {}  # seconds of the ops measured alone at the solved batch
    alone_check = None  # their pass checked at its end (`workspace._check_alone`)
    other_batch = profile_batch * 2 if profile_batch * 2 <= graph.batch else 1
    fits = scaled and graph.fx is not None and _fits_in_memory(graph, device)
    alone_runs = scaled and graph.fx is not None and device.type == "cpu"
    time_method = f"timed runs at batch {profile_batch}"
    conv_sites = graph.fx is not None and bool(algorithm_sites(graph))
    stages = Stages(
        graph.model,
        progress,
        f"profiling {graph.model} at batch {profile_batch} on {device_name(device)}",
    )
    small = graph_at(profile_batch)
    args_fn = _real_args(model, small, device, dtype)

    try:
        try:
            spread: list[float] = []
            # Timed runs first: the workspace run comes after a warm-up, so that the
            # libraries' first-call allocations are not counted as an op's workspace.
            times, run_s = timed_at(small, profile_batch, True, spread, args_fn)
            linear = [t * graph.batch / profile_batch for t in times]  # a first estimate
            _expect_stages(stages, graph, profile_batch, fits, run_s)
            alone_done = alone_runs_of(captures)
            expect_alone = alone_done if alone_runs else None
            _expect_later(stages, graph, device, profile_batch, linear, expect_alone, conv_sites)
            workspace, method = _workspace_at(model, small, device, dtype)
            stages.done(f"workspace at batch {profile_batch}")
            times_at_batch = False  # set where the ops alone or a fit give them there
            if scaled:
                other_graph = None
                small_workspace = workspace  # at the profile's batch
                if fits:
                    # Workspace is not linear in the batch (a library picks its blocking by
                    # shape): ResNet-50 at 224 px, batch 16, fitted from batches 4 and 8,
                    # came out 0.34 MiB under the measured peak. Measure it where it is used.
                    workspace, method = _workspace_at(model, graph, device, dtype)
                    method += f", at batch {graph.batch}"
                    at_batch = every_op
                    stages.done(f"workspace at batch {graph.batch}")
                if alone_runs:
                    # Times fitted from small batches understate a CPU step at a large one
                    # (ResNet-50 at 184: the fit 0.40 of a real step, the ops alone 0.81):
                    # each distinct op is timed alone where it is used. Where the step does
                    # not fit, its workspace too; the memory each needs is estimated from
                    # the profile's batch scaled linearly (above a fixed scratch's).
                    if not fits:
                        workspace = [w * graph.batch // profile_batch for w in workspace]
                    alone, too_large = _remeasure_alone(
                        graph,
                        device,
                        workspace,
                        stages.tick,
                        alone_s,
                        not fits,
                        alone_done,
                        small,
                        small_workspace,
                    )
                    reduced, reduced_at = _reduced_ops(graph, device, alone, alone_done)
                    if not fits:
                        at_batch = set(alone)
                        method += _alone_line(graph, alone, reduced, reduced_at, profile_batch)
                        if too_large:
                            names = ", ".join(too_large)
                            method += f"; left as fitted, too large for the memory free: {names}"
                    stages.done(f"ops alone at batch {graph.batch}")
                    alone_check = alone_done.check
                    views = {op.index for op in graph.ops if op.role == "view"}
                    from_alone = _times_from_alone(
                        times, profile_batch, graph.batch, alone_s, views
                    )
                    if from_alone is not None:
                        times, time_method = from_alone
                        if reduced:
                            time_method += (
                                f"; {reduced} of the ops alone at batch {reduced_at}, scaled"
                            )
                        time_method += _check_line(alone_check)
                if not fits:
                    workspace, fitted = _fit_the_rest(
                        small_workspace, workspace, at_batch, _batch_free(small, graph)
                    )
                    fitted = fitted if other_batch != profile_batch else []
                    if fitted:  # a weight reorder does not grow with the batch: a + b * batch
                        stages.expect(
                            f"workspace at batch {other_batch}",
                            WORKSPACE_RUN * run_s * other_batch / profile_batch,
                        )
                        other_graph = graph_at(other_batch)
                        other, _ = _workspace_at(model, other_graph, device, dtype)
                        stages.done(f"workspace at batch {other_batch}")
                        line = _extrapolate(
                            small_workspace, profile_batch, other, other_batch, graph.batch
                        )
                        for i in fitted:
                            workspace[i] = line[i]
                        method += (
                            f"; {len(fitted)} {'other ' if at_batch else ''}ops fitted"
                            f" a + b*batch from batches {profile_batch} and {other_batch}"
                        )
                    elif at_batch:
                        method += (
                            f"; the others as at batch {profile_batch} (none there, or blind"
                            " to the batch)"
                        )
                times_at_batch = alone_runs and from_alone is not None
                if not times_at_batch and other_batch != profile_batch:
                    # Times: a small batch is dominated by per-op overhead, which a
                    # linear scaling would multiply along with the real work.
                    other_graph = other_graph or graph_at(other_batch)
                    if _timed_beside(captures, graph, other_batch, device) is None:
                        stages.expect(
                            f"timed runs at batch {other_batch}",
                            (repeats + 1) * run_s * other_batch / profile_batch,
                        )
                    other_times = timed_at(other_graph, other_batch, True)[0]
                    times = _extrapolate_float(
                        times, profile_batch, other_times, other_batch, graph.batch
                    )
                    times_at_batch = True
                    time_method = (
                        f"fitted a + b*batch from timed runs at batches {profile_batch}"
                        f" and {other_batch}"
                    )
        except (RuntimeError, NotImplementedError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"{graph.model} cannot run in {graph.dtype} on {device_name(device)}: {first}"
            ) from None

        scale = 1.0 if times_at_batch or not scaled else graph.batch / profile_batch
        if scale != 1.0:
            time_method += f", scaled linearly to batch {graph.batch}"
        algorithms: dict = {}
        if conv_sites:
            at_solved = [t * scale for t in times]
            _expect_later(stages, graph, device, profile_batch, at_solved, None, True)
            algorithms = _algorithm_options(
                graph, device, profile_batch, repeats, progress, stages.tick, at_batch
            )
            stages.done("convolution algorithms")
            _one_workspace_figure(graph, algorithms, workspace, at_batch)
    finally:
        stages.close()

    op_times = [t * scale for t in times]
    nodes = _node_profiles(graph, workspace)  # times: from op_times, by _with_op_times
    result = Profile(
        format=PROFILE_FORMAT,
        model=graph.model,
        fingerprint=graph.fingerprint,
        batch=graph.batch,
        profile_batch=profile_batch,
        scaled=scaled,
        input_shape=graph.input_shape,
        dtype=graph.dtype,
        device=device_name(device),
        torch_version=torch.__version__,
        repeats=repeats,
        workspace_method=method,
        time_method=time_method,
        nodes=nodes,
        op_workspace=[(i, w) for i, w in enumerate(workspace) if w > 0],
        alone_seconds=sorted(alone_s.items()),
        profile_seconds=time.perf_counter() - started,
        algorithms=algorithms,
        time_spread=spread[0] if spread and repeats > 1 else None,
        alone_drift=None if alone_check is None else alone_check.drift,
        alone_drift_after=None if alone_check is None else alone_check.after,
        alone_retimed=0 if alone_check is None else alone_check.retimed,
        alone_contended=0 if alone_check is None else alone_check.contended,
        alone_busy=alone_check is not None and alone_check.busy,
        stage_seconds=stages.seconds,
        load_per_core=_larger(load_at_start, load_per_core()),
    )
    result = _with_op_times(result, graph, op_times)
    if use_cache:  # a unique temporary file renamed over it: never half a profile
        atomic_write(path, result.to_json())
    return result


def _expect_stages(
    stages: Stages, graph: Graph, profile_batch: int, fits: bool, run_s: float
) -> None:
    """The workspace runs after the timed runs at the profile's batch, estimated from one
    of those runs (`run_s`; a run's time scales with the batch). (The ops run alone and
    the convolution algorithms: `_expect_later`; a second batch is expected where it
    turns out to be needed: where the ops alone leave workspace or times to fit.)"""
    stages.expect(f"workspace at batch {profile_batch}", WORKSPACE_RUN * run_s)
    if fits and profile_batch != graph.batch:
        stages.expect(
            f"workspace at batch {graph.batch}", WORKSPACE_RUN * run_s * graph.batch / profile_batch
        )


def _alone_line(graph: Graph, alone: list[int], count: int, at: str, profile_batch: int) -> str:
    """What the workspace method says of the ops measured alone (`alone`), the `count` of
    them run at the smaller batch(es) `at` (`_reduced_ops`) apart."""
    if not count:
        return f"; {len(alone)} ops measured alone at batch {graph.batch}"
    return (
        f"; {len(alone)} ops measured alone, {len(alone) - count} at batch {graph.batch}"
        f" and {count} (no convolution) at batch {at}, their times scaled and their"
        f" workspace fitted a + b*batch from batches {profile_batch} and {at}"
    )


def _check_line(check) -> str:
    """'; 6 of them timed again at the end took 0.98 of their first time; 12 ran beside
    other work: ...', for the time method (`workspace._check_alone`)."""
    if check is None:
        return ""
    line = ""
    if check.ops and check.first_s > 0:
        ratio = check.again_s / check.first_s
        line = f"; {check.ops} of them timed again at the end took {ratio:.2f} of their first time"
    if check.contended:
        line += f"; {check.contended} ran beside other work"
    if check.retimed:
        line += f"; {check.retimed} timed again, each keeping its lesser time"
        line += " (stopped: the machine still busy)" if check.busy else ""
    if check.after is not None:
        third = 1 / (1 + check.after)
        line += f"; its first ops timed a third time took {third:.2f} of their kept time"
    return line


def _reduced_ops(
    graph: Graph, device: torch.device, alone: list[int], runs: AloneRuns
) -> tuple[int, str]:
    """How many of the ops measured alone (`alone`) ran at a smaller batch, and which."""
    measured = set(alone)
    batches = [
        runs.reduced[signature]
        for op, _node, signature in _alone_ops(graph, device)
        if op.index in measured and signature in runs.reduced
    ]
    return len(batches), ", ".join(str(b) for b in sorted(set(batches)))


def _fit_the_rest(
    small: list[int], workspace: list[int], at_batch: set[int], batch_free: set[int]
) -> tuple[list[int], list[int]]:
    """Where the step at the solved batch does not fit: each op's workspace, as measured
    there (`at_batch`: run alone) or else as at the profile's batch (`small`), and the
    ops of the latter to fit from a second batch: those with workspace at the profile's
    batch that see the batch (not in `batch_free`). The ops that cannot run alone read
    integers (indices, counters, labels); one of them with no scratch at the profile's
    batch is taken to have none (ResNet-50's max-pool backward), which spares the second
    batch's graph and run (about 8 s of ResNet-50's cold profile at 184, both graphs)."""
    out = [workspace[i] if i in at_batch else w for i, w in enumerate(small)]
    fitted = [i for i, w in enumerate(small) if w > 0 and i not in at_batch | batch_free]
    return out, fitted


def _batch_free(small: Graph, graph: Graph) -> set[int]:
    """The ops whose every input and output is the same size in `small` (the graph at a
    smaller batch) as in `graph`: blind to the batch (BatchNorm's step counters, 8 bytes
    of scratch each), so their workspace is the same at both batches."""

    def sizes(g: Graph, op) -> list[int]:
        return sorted(g.storages[s].nbytes for s in {*op.reads, *op.outputs})

    return {
        op.index
        for op, big in zip(small.ops, graph.ops, strict=True)
        if op.role != "view" and sizes(small, op) == sizes(graph, big)
    }


# The stage name of the other graph's timed runs taken beside a profile's (`beside`).
BESIDE = "the captured graph's"


def _timed_key(graph: Graph, batch: int, device: torch.device) -> tuple:
    """Where `captures` keeps `graph`'s timed runs at `batch` taken beside another's."""
    return ("timed runs", graph.fingerprint, *_capture_key(graph, batch, device))


def _timed_beside(captures: dict | None, graph: Graph, batch: int, device) -> dict | None:
    """`graph`'s timed runs at `batch` taken beside another graph's profile (`beside`):
    {"times", "spread", "run_s"}, or None."""
    return None if captures is None else captures.get(_timed_key(graph, batch, device))


def _expect_later(
    stages: Stages,
    graph: Graph,
    device: torch.device,
    profile_batch: int,
    times: list[float],
    alone: AloneRuns | None,
    conv_sites: bool,
) -> None:
    """The ops to run alone at the solved batch (where `alone`, those measured so far) and
    the convolution algorithms (where `conv_sites`), estimated from each op's time at the
    solved batch (`times`): first from the profile's batch scaled up, then as measured."""
    if alone is not None:
        seconds = alone_seconds(graph, times, device, alone.workspace, profile_batch)
        stages.expect(f"ops alone at batch {graph.batch}", seconds)
    if conv_sites:
        stages.expect("convolution algorithms", algorithm_seconds(graph, times, profile_batch))


def _times_from_alone(
    times: list[float], profile_batch: int, batch: int, alone: dict[int, float], views: set[int]
) -> tuple[list[float], str] | None:
    """Each op's time at `batch`: as run alone there (`alone`, by op index); a view's
    (`views`: metadata only) as at the profile's batch (`times`); any other op not run
    alone (integer inputs, too large) its time there scaled linearly. Those are the same
    for an op two graphs share, whose times at the profile's batch are pooled
    (`_pooled_medians`). None where the ops run alone take less than ALONE_COVERAGE of
    the other ops' step so scaled: then the times are fitted from two batches. Returns
    the times and how they were taken."""
    linear = [t if i in views else t * batch / profile_batch for i, t in enumerate(times)]
    covered = sum(linear[i] for i in alone)
    working = sum(t for i, t in enumerate(linear) if i not in views)
    if not alone or covered <= 0 or covered < ALONE_COVERAGE * working:
        return None
    out = [alone.get(i, t) for i, t in enumerate(linear)]
    return out, (
        f"{len(alone)} of {len(times)} ops timed alone at batch {batch}; the others timed at"
        f" batch {profile_batch}, scaled linearly but for the {len(views)} views"
    )


# The share of a step's ops other than views (their times at the profile's batch, scaled
# linearly) the ops run alone at the solved batch must cover for their times to be the
# profile's. ResNet-50 (184) leaves out only its max-pool backward, whose indices are not
# random, and BatchNorm's integer step counters; a small model's views at a small batch
# (ViT at 32 px, batch 8: 160 of its 288 ops) would take more than the rest.
ALONE_COVERAGE = 0.9


def _workspace_at(model: nn.Module, g: Graph, device: torch.device, dtype) -> tuple[list[int], str]:
    """Each op's workspace in one run of `g` on real tensors, and how it was measured."""
    runner = _OpRunner(g, device)
    args = _real_args(model, g, device, dtype)()
    if device.type == "cuda":
        return _workspace_cuda(runner, args)
    return _workspace_cpu(runner, args)


def _one_workspace_figure(graph: Graph, algorithms: dict, workspace: list[int], at_batch) -> None:
    """One figure per convolution op, so that the store-all prediction and the solver's
    options agree: the step's where it was measured at the solved batch (the options' own
    may be fitted from small batches), else the options'. `workspace` is set in place."""
    _aten_options_take(graph, algorithms, workspace, at_batch)
    for i, w in algorithm_workspace(graph, algorithms, {}).items():
        workspace[i] = w


def _profile_batch(graph: Graph, profile_batch: int | None, device: torch.device) -> int:
    """`profile`'s batch: the one given, else the graph's on CUDA and at most 4 on CPU."""
    if profile_batch is not None:
        return profile_batch
    return graph.batch if device.type == "cuda" else min(graph.batch, 4)


def cached_profile(
    graph: Graph,
    profile_batch: int | None = None,
    device: str | torch.device | None = None,
    progress: bool | None = None,
) -> Profile | None:
    """The profile `profile(model, graph, profile_batch, device)` would read from the
    cache (or the zoo's), or None where it would profile."""
    device = torch.device(device or graph.device)
    path = cache_path(graph, _profile_batch(graph, profile_batch, device), device)
    return _cached_to_use(path, progress)


def _cached_to_use(path: Path, progress: bool | None) -> Profile | None:
    """The cached profile at `path` (or the zoo's of that name), unless it is to be taken
    again (`_take_again`, said unless `progress` is False)."""
    cached = _cached(path)
    if cached is None or not _take_again(cached, path):
        return cached
    if progress is not False:
        print(
            f"  the cached profile is unsure ({cached.noisy}) and the machine is quiet now:"
            " profiling again",
            flush=True,
        )
    return None


# The load per core (`load_per_core`) under which the machine counts as quiet: below our
# own step alone. The 1-minute average takes 40 s or more to fall from BUSY_LOAD_PER_CORE
# to it, so a profile taken busy is not taken again by a solve that follows at once.
QUIET_LOAD_PER_CORE = 0.75


def _take_again(cached: Profile, path: Path) -> bool:
    """Whether a cached profile is to be taken again now: one of this machine's cache (not
    the zoo's shipped ones) taken with the machine busy, while it is quiet. (A spread of
    the timed runs alone may be the model's own: that profile is kept, and said.)"""
    busy = cached.load_per_core is not None and cached.load_per_core > BUSY_LOAD_PER_CORE
    if not busy or not path.exists():
        return False
    load = load_per_core()
    return load is not None and load <= QUIET_LOAD_PER_CORE


def _larger(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _cached(path: Path) -> Profile | None:
    """The cached profile at `path`, else the zoo's shipped one of that name, if either
    reads; an unreadable or older-format cache file is removed (profiled again)."""
    for source in (path, SHIPPED_PROFILES / path.name):
        if not source.exists():
            continue
        try:
            cached = Profile.from_json(source.read_text())
            cached.cached = True
            return cached
        except (ValueError, KeyError, TypeError):
            if source == path:
                path.unlink(missing_ok=True)
    return None


def _capture_key(graph: Graph, batch: int, device: torch.device) -> tuple:
    """`capture`'s arguments after the model for `graph`'s step at `batch` on `device`."""
    return (
        graph.input_shape,
        batch,
        getattr(torch, graph.dtype),
        device,
        graph.model,
        graph.input_grad,
        graph.outputs_held,
        None if graph.autocast is None else getattr(torch, graph.autocast),
    )


def _graph_at(
    model: nn.Module, graph: Graph, batch: int, device: torch.device, captures: dict | None = None
) -> Graph:
    """`graph` captured again at `batch` on `device` (with its variants), to be run; the
    capture before the variants is taken from `captures` or kept there."""
    if batch == graph.batch:
        if graph.fx is None:
            raise UserError("this graph carries no traced module to run: capture it again")
        return graph
    from monet_like.variants import apply as apply_variants

    how = _capture_key(graph, batch, device)
    captures = {} if captures is None else captures
    if how not in captures:  # the rewrites copy the graph they are given: it stays as captured
        captures[how] = capture(model, *how)
    other = apply_variants(captures[how], graph.variants, graph.plain_batch_norms)
    if [o.target for o in other.ops] != [o.target for o in graph.ops]:
        raise UserError(
            f"the graph at batch {batch} differs from the one at batch {graph.batch} "
            f"(batch-dependent control flow?): profile with --profile_batch {graph.batch}"
        )
    return other
