import json

import pandas as pd
import pytest
import torch
from torch import nn

from monet_like import pipeline
from monet_like.errors import UserError
from monet_like.graph import Graph, capture
from monet_like.profile import Profile, profile


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_profile_measures_every_node_and_is_cached(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    graph = capture(model, (3, 16, 16), 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = profile(model, graph, profile_batch=8, repeats=2, progress=False)
    assert not first.cached and not first.scaled
    assert [n.node for n in first.nodes] == [n.id for n in graph.nodes]
    conv = next(n for n in first.nodes if n.kind == "convolution")
    assert conv.forward_s > 0 and conv.backward_s > 0 and conv.recompute_s == conv.forward_s
    assert first.step_time_s >= sum(n.forward_s + n.backward_s for n in first.nodes) * 0.999
    # Per-op times are kept (for align_times) and every figure is their sum.
    assert len(first.op_times_s) == len(graph.ops)
    assert first.step_time_s == pytest.approx(sum(first.op_times_s), rel=1e-12)
    assert conv.forward_s == pytest.approx(
        sum(first.op_times_s[i] for i in graph.nodes[conv.node].ops), rel=1e-12
    )
    # Profiling must not touch the model: BatchNorm's running stats stay as they were.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    second = profile(model, graph, profile_batch=8, repeats=2, progress=False)
    assert second.cached  # read back, not measured again (a wall-clock bound would flake)
    assert second.nodes == first.nodes and second.op_times_s == first.op_times_s

    df = first.to_dataframe()
    assert isinstance(df, pd.DataFrame) and len(df) == len(graph.nodes)
    assert {"forward_s", "backward_s", "recompute_s", "workspace_bytes"} <= set(df.columns)
    first.to_csv(tmp_path / "p.csv")
    assert len(pd.read_csv(tmp_path / "p.csv")) == len(graph.nodes)
    assert Profile.from_json(first.to_json()).nodes == first.nodes


def test_profile_keeps_the_noise_it_was_measured_with(monkeypatch):
    """The spread of the timed runs' step totals is kept (cached with the profile),
    absent from one timed run and from an older profile, and said by a solve whose
    profile is noisier than NOISY_SPREAD."""
    from monet_like.profile.timing import _median_times

    class Runner:  # three timed runs of two ops: totals 3, 4 and 6 seconds
        graph = type("G", (), {"ops": [0, 1]})()
        device = torch.device("cpu")
        runs = iter([(1, 1), (1, 2), (2, 2), (3, 3)])  # the first is the warm-up

        def run(self, _args, on_op):
            for idx, seconds in enumerate(next(self.runs)):
                on_op(idx, lambda s=seconds: clock.append(clock[-1] + s))

    clock = [0.0]  # a clock each op moves on by its seconds
    monkeypatch.setattr("monet_like.profile.timing.time.perf_counter", lambda: clock[-1])
    spread = []
    times = _median_times(Runner(), lambda: None, 3, lambda _n: None, spread)
    assert times == [2, 2] and spread == [pytest.approx((6 - 3) / 4)]
    monkeypatch.undo()

    torch.manual_seed(0)
    model = Tiny()
    graph = capture(model, (3, 16, 16), 8)
    measured = profile(model, graph, repeats=3, progress=False, use_cache=False)
    assert measured.time_spread is not None and measured.time_spread >= 0
    assert Profile.from_json(measured.to_json()).time_spread == measured.time_spread
    older = json.loads(measured.to_json())
    del older["time_spread"]
    assert Profile.from_json(json.dumps(older)).time_spread is None
    assert profile(model, graph, repeats=1, progress=False, use_cache=False).time_spread is None

    monkeypatch.setattr("monet_like.profile.types.NOISY_SPREAD", -1.0)  # every one is noisy
    lines = []
    compiled = pipeline.compile_schedule(
        model, (3, 16, 16), 8, budget_fraction=1.0, progress=lines.append
    )
    assert compiled.solution.extra["profile_time_spread"] == compiled.profile.time_spread
    assert any("timed runs of the whole step differ" in line for line in lines)


def test_an_unsure_cached_profile_is_taken_again_when_the_machine_is_quiet(
    monkeypatch, tmp_path, capsys
):
    """A profile taken with the machine busy is cached (a busy machine stays usable) and
    says why it is unsure; a later profile call finds it and, the machine quiet now, takes
    it again; while the machine is busy, the cached one is used."""
    from monet_like import profile as profile_module
    from monet_like.profile import types
    from monet_like.profile import workspace as workspace_module

    monkeypatch.setenv("MONET_LIKE_CACHE", str(tmp_path))
    load = [3.0]  # runnable threads per core
    monkeypatch.setattr(profile_module, "load_per_core", lambda: load[0])
    # the load is the only noise here: the timed runs' spread and the ops-alone checks
    # read the real machine, which a loaded suite makes noisy (each has its own tests)
    monkeypatch.setattr(types, "NOISY_SPREAD", float("inf"))
    monkeypatch.setattr(workspace_module, "ALONE_CHECK_OPS", 10**9)
    monkeypatch.setattr(workspace_module, "_others_cpu_s", lambda: None)
    torch.manual_seed(0)
    model = Tiny()
    graph = capture(model, (3, 16, 16), 8)
    busy = profile(model, graph, repeats=1, progress=False)
    assert busy.load_per_core == 3.0 and "busy" in busy.noisy
    again = profile(model, graph, repeats=1, progress=False)
    assert again.cached  # still busy: the cached profile stands
    load[0] = 0.5
    quiet = profile(model, graph, repeats=1)
    assert not quiet.cached and quiet.load_per_core == 0.5 and not quiet.noisy
    assert "profiling again" in capsys.readouterr().out
    assert profile(model, graph, repeats=1, progress=False).cached  # and it replaced it
    assert types.BUSY_LOAD_PER_CORE > profile_module.QUIET_LOAD_PER_CORE


def test_profile_records_where_its_time_went():
    """Each profiling stage's seconds are kept in the profile (in the order they ran,
    within the whole), survive the cache, and a solve says them in one line."""
    torch.manual_seed(0)
    model = Tiny()
    graph = capture(model, (3, 16, 16), 8)
    measured = profile(model, graph, profile_batch=2, repeats=1, progress=False, use_cache=False)
    stages = list(measured.stage_seconds)
    assert stages[:3] == ["graph at batch 2", "timed runs at batch 2", "workspace at batch 2"]
    # the step at 8 fits in memory: its workspace measured there, then the ops alone
    assert stages[3:5] == ["workspace at batch 8", "ops alone at batch 8"]
    assert all(s >= 0 for s in measured.stage_seconds.values())
    assert sum(measured.stage_seconds.values()) <= measured.profile_seconds
    assert Profile.from_json(measured.to_json()).stage_seconds == measured.stage_seconds
    older = json.loads(measured.to_json())
    del older["stage_seconds"]
    assert Profile.from_json(json.dumps(older)).stage_seconds == {}
    line = pipeline.profile_line(measured)
    assert line.startswith("  profiled the graph in ") and "timed runs at batch 2" in line
    measured.cached = True
    assert pipeline.profile_line(measured, "as captured").endswith("as captured: from the cache")


def test_profile_at_smaller_batch_scales_and_says_so():
    model = Tiny()
    graph = capture(model, (3, 16, 16), 8)
    p = profile(model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False)
    assert p.scaled and p.profile_batch == 2 and p.batch == 8
    # Bytes come from the full-batch graph, exactly.
    assert [n.output_bytes for n in p.nodes] == [n.output_bytes for n in graph.nodes]


@pytest.mark.parametrize("fits", [True, False])
def test_scaled_profile_measures_workspace_at_the_solved_batch_when_it_fits(monkeypatch, fits):
    """Workspace is not linear in the batch: measured at the solved batch when that run
    fits in memory (then equal to a profile taken there), else op by op alone there."""
    from monet_like import profile as profile_module

    monkeypatch.setattr(profile_module, "_fits_in_memory", lambda graph, device: fits)
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 1))
    graph = capture(model, (16, 32, 32), 8)
    scaled = profile(model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False)
    if fits:
        assert scaled.workspace_method.endswith("at batch 8")
        direct = profile(model, graph, profile_batch=8, repeats=1, use_cache=False, progress=False)
        assert not direct.scaled and scaled.op_workspace == direct.op_workspace
    else:  # every op with workspace runs alone there: no second batch to fit from
        assert "ops measured alone at batch 8" in scaled.workspace_method
        assert "workspace at batch 4" not in scaled.stage_seconds
    assert scaled.nodes[0].workspace_bytes > 0


def _inflated(monkeypatch, profile_module):
    """Make every fitted workspace figure 3x + 1 MiB what the fit gives: what a fit that
    misses a library's change of method at the solved batch looks like."""
    fit = profile_module.workspace._extrapolate
    for module in (profile_module, profile_module.algorithms):  # the step's, the options'
        monkeypatch.setattr(module, "_extrapolate", lambda *a: [3 * w + 2**20 for w in fit(*a)])


@pytest.mark.parametrize("backward_alone", [True, False])
def test_workspace_where_the_step_does_not_fit_is_measured_alone_at_the_solved_batch(
    monkeypatch, backward_alone
):
    """Where the step does not fit in memory at the solved batch, each op runs alone
    there on random inputs and its workspace is measured: every op must come out as a
    profile taken at batch 8 measures it. An op that cannot run alone and has workspace
    at the profile's batch (here the convolutions' backward, made so) is fitted from a
    second batch; where there is none, no second batch is run. The fit is made wrong on
    purpose, so that an op given it shows."""
    from monet_like import profile as profile_module

    monkeypatch.setattr(profile_module, "_fits_in_memory", lambda graph, device: False)
    _inflated(monkeypatch, profile_module)
    backward = "aten.convolution_backward.default"
    if not backward_alone:
        every = profile_module.workspace._alone_ops
        monkeypatch.setattr(
            profile_module.workspace,
            "_alone_ops",
            lambda graph, device: [a for a in every(graph, device) if a[0].target != backward],
        )
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 1))
    graph = capture(model, (16, 32, 32), 8)
    direct = profile(model, graph, profile_batch=8, repeats=1, use_cache=False, progress=False)
    fitted = profile(model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False)
    real, got = dict(direct.op_workspace), dict(fitted.op_workspace)
    computing = [op for op in graph.ops if op.role != "view"]  # a view allocates nothing
    alone = [op for op in computing if backward_alone or op.target != backward]
    left = [op for op in computing if op not in alone]
    assert all(got.get(op.index, 0) == real.get(op.index, 0) for op in alone)
    assert f"{len(alone)} ops measured alone at batch 8" in fitted.workspace_method
    assert "left as fitted" not in fitted.workspace_method
    if backward_alone:
        assert "the others as at batch 2 (none there" in fitted.workspace_method
        assert "workspace at batch 4" not in fitted.stage_seconds
    else:
        assert left and all(got[op.index] > real.get(op.index, 0) for op in left)
        assert (
            f"{len(left)} other ops fitted a + b*batch from batches 2 and 4"
            in fitted.workspace_method
        )
        assert "workspace at batch 4" in fitted.stage_seconds
    by_op = {op.index: op for op in graph.ops}
    assert any(
        by_op[i].target == "aten.convolution_backward.default" for i, _ in direct.op_workspace
    )


def test_an_op_measured_alone_may_take_most_of_the_free_memory_and_one_that_cannot_is_named(
    monkeypatch,
):
    """The guard on an op measured alone: its inputs, outputs and fitted workspace against
    the memory free just before it. An op taking 60% of what is free is measured (the rule
    was half, which left VGG-16's largest backward at 176 fitted at twice its scratch in
    some runs on a 24 GB machine); with less memory free, the op keeps its fitted figure
    and the profile names it."""
    from monet_like import profile as profile_module

    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 1))
    graph = capture(model, (16, 32, 32), 8)
    direct = profile(model, graph, profile_batch=8, repeats=1, use_cache=False, progress=False)
    conv = next(op for op in graph.ops if op.target == "aten.convolution.default")
    real = dict(direct.op_workspace).get(conv.index, 0)
    workspace = [0] * len(graph.ops)
    workspace[conv.index] = 3 * real + 2**20  # a fit that missed: above the threshold
    touched = sum(graph.storages[i].nbytes for i in {*conv.reads, *conv.outputs})
    need = touched + workspace[conv.index]

    def alone_with_free(free):
        monkeypatch.setattr(profile_module.workspace, "_available_memory_bytes", lambda: free)
        trial = list(workspace)
        measured, too_large = profile_module._remeasure_alone(graph, torch.device("cpu"), trial)
        return trial, measured, too_large

    trial, measured, too_large = alone_with_free(int(need / 0.6))
    assert conv.index in measured and conv.name not in too_large
    assert trial[conv.index] == real  # measured
    trial, measured, too_large = alone_with_free(int(need / 0.9))
    assert conv.index not in measured and conv.name in too_large
    assert trial[conv.index] == workspace[conv.index]  # fitted, as it was


def test_ops_alike_are_measured_alone_once(monkeypatch):
    """Ops with the same target, argument layouts and other arguments (a repeated block's,
    or the ones two graphs profiled in one process share) are run alone once; an op that
    differs in its shapes is run itself."""
    from monet_like.profile import workspace as workspace_module

    model = nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 4, 1)
    )
    graph = capture(model, (8, 16, 16), 4)
    runs = _ops_run_alone(monkeypatch, lambda node, _at: node.name)
    forwards = [op for op in graph.ops if op.target == "aten.convolution.default"]
    shared = workspace_module.AloneRuns()
    measured, _ = workspace_module._remeasure_alone(
        graph, torch.device("cpu"), [0] * len(graph.ops), runs=shared
    )
    assert {op.index for op in forwards} <= set(measured)
    forward_runs = [name for name in runs if name in {op.name for op in forwards}]
    assert forward_runs == [forwards[0].name, forwards[2].name]  # the second is the first's
    runs.clear()
    cpu, no_workspace = torch.device("cpu"), [0] * len(graph.ops)
    again, _ = workspace_module._remeasure_alone(graph, cpu, no_workspace, runs=shared)
    assert again == measured and runs == []  # a second graph profiled with the same captures
    afresh, _ = workspace_module._remeasure_alone(graph, cpu, no_workspace)
    assert afresh == measured and forwards[0].name in runs  # a profile taken afresh


def test_both_graphs_profiles_capture_the_model_once_per_smaller_batch(monkeypatch):
    """A mode's two profiles (its variants' graph, the captured graph) are taken at the
    same smaller batches: each batch's capture is taken once and shared, and the captured
    graph's profile equals one taken on its own capture in its ops and bytes."""
    import monet_like.profile as profile_module

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    captured, graph = pipeline.capture_graphs(model, (3, 16, 16), 8, "inplace_normal")
    batches = []
    real_capture = profile_module.capture

    def counted(model, shape, batch, *rest):
        batches.append(batch)
        return real_capture(model, shape, batch, *rest)

    monkeypatch.setattr(profile_module, "capture", counted)
    # times fitted from batches 2 and 4 (not taken from the ops alone at 8)
    monkeypatch.setattr(profile_module, "_fits_in_memory", lambda graph, device: False)
    monkeypatch.setattr(profile_module, "ALONE_COVERAGE", 1.01)
    prof, (_, reference) = pipeline.profile_graphs(
        model, captured, graph, profile_batch=2, repeats=1, lines=False
    )
    assert sorted(batches) == [2, 4]  # not [2, 2, 4, 4]
    assert not prof.cached and not reference.cached
    assert "graph at batch 2" in prof.stage_seconds  # the captured graph's was taken, not built
    assert not any(stage.startswith("graph at") for stage in reference.stage_seconds)
    alone = profile(model, captured, profile_batch=2, repeats=1, use_cache=False, progress=False)
    assert sorted(batches) == [2, 2, 4, 4]
    assert [n.node for n in reference.nodes] == [n.node for n in alone.nodes]
    assert len(reference.op_times_s) == len(alone.op_times_s) == len(captured.ops)


def test_two_graphs_timed_runs_are_put_on_one_footing_run_by_run():
    """Runs of two graphs taken one after the other: each run is scaled so that the
    shared ops take the same total, which takes out a busy spell during one graph's
    runs; a shared op gets one time for both graphs, and each graph's own ops keep their
    ratio to the shared ones."""
    from monet_like.profile.timing import _pooled_medians

    # a: shared ops 1 s and 2 s, its own op 0.5 s, all its runs during a spell at half
    # speed; b: its own op 0.3 s, then the shared ops, at full speed
    a_runs = [[2.0, 4.0, 1.0]] * 3
    b_runs = [[0.3, 1.0, 2.0], [0.3, 1.0, 2.0], [0.6, 2.0, 4.0]]  # its last run slowed too
    times_a, times_b = _pooled_medians(a_runs, b_runs, {0: 1, 1: 2})
    assert times_a[:2] == times_b[1:]  # one time per shared op
    assert times_a[2] / times_a[0] == pytest.approx(0.5)
    assert times_b[0] / times_b[1] == pytest.approx(0.3)


def test_the_captured_graphs_timed_runs_are_taken_beside_the_variants_graphs(monkeypatch):
    """A mode's two profiles: the captured graph's timed runs are taken at each batch
    right after the variants' graph's, and the ops both run get one time, so that the
    alignment between them finds no speed apart; with the captured graph's profile
    cached, only the variants' graph is timed."""
    import monet_like.profile as profile_module
    from monet_like.profile import align_times
    from monet_like.profile.align import _counterparts

    monkeypatch.setattr(profile_module, "ALONE_COVERAGE", 0.0)  # times from the ops alone
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    captured, graph = pipeline.capture_graphs(model, (3, 16, 16), 16, "inplace_normal")
    prof, (_, reference) = pipeline.profile_graphs(
        model, captured, graph, profile_batch=2, repeats=3, lines=False
    )
    beside = [s for s in prof.stage_seconds if s.startswith("the captured graph's timed runs")]
    assert beside == ["the captured graph's timed runs at batch 2"]  # at 16: the ops alone
    assert not any("timed runs" in stage for stage in reference.stage_seconds)
    assert reference.time_spread is not None
    shared = _counterparts(graph, captured)
    assert shared and len(shared) < len(graph.ops)  # the ReLU is rewritten
    assert all(prof.op_times_s[i] == reference.op_times_s[j] for i, j in shared.items())
    assert "scaled by 1.000" in align_times(prof, graph, reference, captured).aligned

    other, (_, again) = pipeline.profile_graphs(
        model,
        *pipeline.capture_graphs(model, (3, 16, 16), 16, "multiway"),
        profile_batch=2,
        repeats=3,
        lines=False,
    )
    assert again.cached and not other.cached
    assert not any(s.startswith("the captured graph's") for s in other.stage_seconds)


def test_a_convolution_at_pytorchs_algorithm_is_measured_alone_once_for_both_graphs(
    monkeypatch,
):
    """The conv mode's rewritten convolution, left at PyTorch's algorithm, runs the aten
    convolution the captured graph runs: measured alone for one graph, it is not run
    again for the other."""
    from monet_like.profile import workspace as workspace_module
    from monet_like.variants import apply

    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.ReLU(), nn.Conv2d(8, 4, 1))
    captured = capture(model, (4, 16, 16), 4)
    graph = apply(captured, "conv")
    shared = workspace_module.AloneRuns()
    first, _ = workspace_module._remeasure_alone(
        captured, torch.device("cpu"), [0] * len(captured.ops), runs=shared
    )
    runs = _ops_run_alone(monkeypatch, lambda node, _at: str(node.target))
    second, _ = workspace_module._remeasure_alone(
        graph, torch.device("cpu"), [0] * len(graph.ops), runs=shared
    )
    rewritten = {op.index for op in graph.ops if op.target.startswith("monet_like.conv2d")}
    assert len(rewritten) == 4 and rewritten <= set(second)
    # Not run again: both forwards, and the bias-free layer's backward; the second layer's
    # backward computes its bias gradient apart once rewritten, so it is measured itself.
    assert runs == ["monet_like.conv2d_backward_algo.default"]
    captured_convs = [op.index for op in captured.ops if "convolution" in op.target]
    assert set(captured_convs) <= set(first)


def test_an_op_with_a_broadcast_input_is_measured_alone(monkeypatch):
    """A gradient that reaches a convolution from a sum is broadcast (stride 0): the op is
    run alone on an input laid out so, not refused by the random fill and left as fitted."""
    from monet_like.profile import workspace as workspace_module

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)

        def forward(self, x):
            return self.conv(x).sum(dim=(2, 3))

    graph = capture(Pooled(), (3, 16, 16), 4)
    backward = next(op for op in graph.ops if op.target == "aten.convolution_backward.default")
    node = next(n for n in graph.fx.graph.nodes if n.name == backward.name)
    assert 0 in node.args[0].meta["val"].stride()
    measured, _ = workspace_module._remeasure_alone(
        graph, torch.device("cpu"), [0] * len(graph.ops)
    )
    assert backward.index in measured


def _profiled_at_2_for_16(monkeypatch, coverage: float):
    """A small network's graph at batch 16 and its profile at batch 2, the step taken as
    not fitting in memory, the ops alone fresh, with ALONE_COVERAGE `coverage`."""
    from monet_like import profile as profile_module

    monkeypatch.setattr(profile_module, "_fits_in_memory", lambda graph, device: False)
    monkeypatch.setattr(profile_module, "ALONE_COVERAGE", coverage)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    graph = capture(model, (3, 16, 16), 16)
    prof = profile(model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False)
    return model, graph, prof


def _ops_run_alone(monkeypatch, name) -> list:
    """The ops run alone from here on (`name(node, at)` each, `at` the smaller batch's
    `BatchRows` where it ran at one), in order."""
    from monet_like.profile import workspace as workspace_module

    runs = []
    real_alone = workspace_module._workspace_alone
    # the check's second calls (tested on their own) left out: of a pass's first ops, and
    # of the ops run beside other work (a loaded suite's other worker)
    monkeypatch.setattr(workspace_module, "ALONE_CHECK_OPS", 10**9)
    monkeypatch.setattr(workspace_module, "_others_cpu_s", lambda: None)

    def counted(node, device, gen, arena=None, at=None):
        runs.append(name(node, at))
        return real_alone(node, device, gen, arena, at)

    monkeypatch.setattr(workspace_module, "_workspace_alone", counted)
    return runs


def test_a_fresh_profile_runs_its_ops_alone_afresh_and_shared_captures_share_them(monkeypatch):
    """Two profiles taken afresh in one process are independent: each runs its ops alone
    (the solver's benchmark compares solves over such profiles); the graphs profiled with
    one `captures` (a mode's two graphs) run an op they share once."""

    calls = _ops_run_alone(monkeypatch, lambda node, _at: node.name)
    model, graph, first = _profiled_at_2_for_16(monkeypatch, coverage=0.9)
    once = list(calls)
    assert once and dict(first.alone_seconds)
    calls.clear()
    again = profile(model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False)
    assert calls == once and dict(again.alone_seconds).keys() == dict(first.alone_seconds).keys()
    captures: dict = {}
    for k in range(2):
        calls.clear()
        profile(
            model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False,
            captures=captures,
        )  # fmt: skip
        assert calls == (once if k == 0 else [])


def test_at_a_large_batch_ops_but_convolutions_run_alone_at_a_quarter_of_it(monkeypatch):
    """Where the step does not fit and the batch is large, the ops whose scratch no
    library sizes by shape run alone at a quarter of the batch (their time scaled, their
    workspace the line through the profile's batch and that one); the convolutions at
    the batch itself. Every op's workspace comes out as a profile taken at the batch
    itself measures it, and the profile says which ran where."""
    from monet_like import profile as profile_module

    monkeypatch.setattr(profile_module, "_fits_in_memory", lambda graph, device: False)
    # times from the ops alone whatever their share of a tiny, noisy step
    monkeypatch.setattr(profile_module, "ALONE_COVERAGE", 0.0)
    ran = _ops_run_alone(
        monkeypatch, lambda node, at: (str(node.target), 64 if at is None else at.batch)
    )
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip
    graph = capture(model, (8, 16, 16), 64)
    quarter = profile(model, graph, profile_batch=4, repeats=1, use_cache=False, progress=False)
    monkeypatch.undo()
    direct = profile(model, graph, profile_batch=64, repeats=1, use_cache=False, progress=False)
    at_16 = [target for target, batch in ran if batch == 16]
    assert len(at_16) >= 4 and not any("conv" in target for target in at_16)
    assert all(batch == 64 for target, batch in ran if "convolution" in target)
    real, got = dict(direct.op_workspace), dict(quarter.op_workspace)
    computing = [op.index for op in graph.ops if op.role != "view"]
    assert {i: got.get(i, 0) for i in computing} == {i: real.get(i, 0) for i in computing}
    assert "(no convolution) at batch 16, their times scaled" in quarter.workspace_method
    assert "of the ops alone at batch 16, scaled" in quarter.time_method


def test_times_at_the_solved_batch_come_from_the_ops_run_alone_there(monkeypatch):
    """A profile taken at a smaller batch times each op alone at the solved batch and
    takes those times; the views (metadata only) keep their time at the profile's
    batch."""
    _, graph, prof = _profiled_at_2_for_16(monkeypatch, coverage=0.9)
    alone = dict(prof.alone_seconds)
    computing = {op.index for op in graph.ops if op.role != "view"}
    assert set(alone) == computing and all(s > 0 for s in alone.values())
    assert all(prof.op_times_s[i] == s for i, s in alone.items())
    assert f"{len(alone)} of {len(graph.ops)} ops timed alone at batch 16" in prof.time_method
    assert prof.alone_over_fitted == pytest.approx(1.0)
    assert Profile.from_json(prof.to_json()).time_method == prof.time_method
    views = [op.index for op in graph.ops if op.role == "view"]
    assert views and all(prof.op_times_s[i] > 0 for i in views)
    assert f"scaled linearly but for the {len(views)} views" in prof.time_method


def test_an_op_reading_a_mask_runs_alone_and_one_shaped_by_its_values_does_not(monkeypatch):
    """A boolean input takes random values (any mask is a valid mask), so an op reading
    one is measured alone; an op whose result is shaped by its input's values returns
    other shapes on random inputs than in the graph, and is refused (left as fitted)."""
    from torch import fx

    from monet_like.profile import workspace as workspace_module

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.register_buffer("mask", torch.rand(4, 8, 8) > 0.5)

        def forward(self, x):
            return self.conv(x).masked_fill(self.mask, 0.0)

    graph = capture(Masked(), (3, 8, 8), 4)
    masked = [op for op in graph.ops if "masked_fill" in op.target]
    assert masked
    measured, _ = workspace_module._remeasure_alone(
        graph, torch.device("cpu"), [0] * len(graph.ops)
    )
    assert {op.index for op in masked} <= set(measured)

    selecting = fx.Graph()
    mask = selecting.placeholder("mask")
    mask.meta["val"] = torch.empty(16, 16, dtype=torch.bool, device="meta")
    nonzero = selecting.call_function(torch.ops.aten.nonzero.default, (mask,))
    nonzero.meta["val"] = torch.empty(5, 2, dtype=torch.int64, device="meta")  # as traced
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError, match="other shapes"):
        workspace_module._workspace_alone(nonzero, torch.device("cpu"), gen)


def test_where_too_few_ops_run_alone_the_times_are_fitted_and_checked(monkeypatch):
    """Where the ops run alone cover too little of the step (ALONE_COVERAGE), times are
    fitted from timed runs at two smaller batches; the ops run alone are then a check on
    the fit, kept with the profile, and a solve says so where they took more than
    FIT_UNDERSTATES times their fitted times."""
    from monet_like.profile import types as types_module

    model, graph, prof = _profiled_at_2_for_16(monkeypatch, coverage=1.01)  # never enough
    assert prof.time_method == "fitted a + b*batch from timed runs at batches 2 and 4"
    assert "timed runs at batch 4" in prof.stage_seconds
    alone = dict(prof.alone_seconds)
    convs = {op.index for op in graph.ops if "convolution" in op.target}
    assert convs <= set(alone) and all(s > 0 for s in alone.values())
    fitted = sum(prof.op_times_s[i] for i in alone)
    assert prof.alone_over_fitted == pytest.approx(sum(alone.values()) / fitted)
    assert Profile.from_json(prof.to_json()).alone_seconds == prof.alone_seconds
    older = json.loads(prof.to_json())
    del older["alone_seconds"], older["time_method"]
    assert Profile.from_json(json.dumps(older)).alone_over_fitted is None
    unscaled = profile(model, graph, profile_batch=16, repeats=1, use_cache=False, progress=False)
    assert unscaled.alone_over_fitted is None  # measured at the batch: nothing fitted
    assert unscaled.time_method == "timed runs at batch 16"

    for threshold, said in ((0.0, True), (1e9, False)):
        monkeypatch.setattr(types_module, "FIT_UNDERSTATES", threshold)
        monkeypatch.setattr(pipeline, "profile_graphs", lambda *a, **k: (prof, None))
        lines = []
        compiled = pipeline.compile_schedule(
            model, (3, 16, 16), 16, budget_fraction=1.0, progress=lines.append
        )
        assert compiled.solution.extra["profile_alone_over_fitted"] == prof.alone_over_fitted
        assert any("their fitted times" in line for line in lines) == said


def test_a_profile_without_a_terminal_says_each_stage_as_it_ends(capsys):
    """Bars are hidden where no terminal shows them: a log gets a line per stage."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    graph = capture(model, (3, 8, 8), 8)
    prof = profile(model, graph, repeats=1, use_cache=False, progress=None)
    lines = [line for line in capsys.readouterr().out.splitlines() if "profiling" in line]
    assert len(lines) == len(prof.stage_seconds) >= 2
    for line, name in zip(lines, prof.stage_seconds, strict=True):
        assert f": {name}, " in line
    quiet = profile(model, graph, repeats=1, use_cache=False, progress=False)
    assert quiet.stage_seconds and "profiling" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "mode, profile_batch, fits, beside, fitted",
    [
        ("normal", 2, False, False, False),
        ("conv", 2, False, False, False),
        ("conv", 2, True, False, False),
        ("conv", 8, False, False, False),
        ("conv", 2, False, True, False),
        ("conv", 2, True, True, False),
        ("conv", 2, False, True, True),
        ("conv", 2, True, False, True),
    ],
)
def test_a_profile_shows_one_bar_that_says_how_long_is_left(
    monkeypatch, capsys, mode, profile_batch, fits, beside, fitted
):
    """One bar for the whole profile, its length the seconds spent plus those estimated
    for the stages left, and no bar of its own for any stage: every stage estimated is
    one that ran (whichever way the profile goes: the captured graph's timed runs taken
    beside it or not, times from the ops alone or `fitted` from two batches), and the
    bar ends full."""
    from monet_like import profile as profile_module
    from monet_like.profile import progress as progress_module
    from monet_like.variants import apply

    monkeypatch.setattr(profile_module, "_fits_in_memory", lambda graph, device: fits)
    monkeypatch.setattr(profile_module, "ALONE_COVERAGE", 1.01 if fitted else 0.0)
    left_over, expected = [], set()
    real_expect, real_close = progress_module.Stages.expect, progress_module.Stages.close

    def expect(self, name, seconds):
        expected.add(name)
        assert seconds >= 0
        real_expect(self, name, seconds)

    def close(self):
        left_over.append(dict(self.expected))
        real_close(self)

    monkeypatch.setattr(progress_module.Stages, "expect", expect)
    monkeypatch.setattr(progress_module.Stages, "close", close)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    captured = capture(model, (3, 16, 16), 8)
    graph = apply(captured, mode)
    measured = profile(
        model,
        graph,
        profile_batch=profile_batch,
        repeats=1,
        use_cache=False,
        progress=True,
        captures={},
        beside=captured if beside else None,
    )
    assert left_over == [{}]
    assert expected and expected <= set(measured.stage_seconds)
    taken_beside = {s for s in measured.stage_seconds if s.startswith("the captured graph's")}
    at_two = {"the captured graph's timed runs at batch 2"}
    if fitted:
        at_two.add("the captured graph's timed runs at batch 4")
    assert taken_beside == (at_two if beside else set())
    assert ("timed runs at batch 4" in measured.stage_seconds) == fitted
    assert ("convolution algorithms" in expected) == (mode == "conv")
    assert ("ops alone at batch 8" in expected) == (profile_batch < 8)
    bar = capsys.readouterr().err
    assert f"profiling {graph.model} at batch {profile_batch}" in bar and " left" in bar
    last = bar.strip().split("\r")[-1]
    assert "100%" in last and "done" in last
    assert "measuring large ops" not in bar and "timing convolution algorithms" not in bar


def test_conv_workspace_is_measured_on_cpu():
    """mkldnn convolution allocates scratch on CPU: the profiler must see it."""
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1))
    graph = capture(model, (16, 32, 32), 4)
    p = profile(model, graph, repeats=1, use_cache=False, progress=False)
    assert p.workspace_method != "unavailable"
    assert p.nodes[0].workspace_bytes > 0


def test_profile_refuses_meta_model():
    model = Tiny().to("meta")
    graph = capture(model, (3, 16, 16), 2)
    with pytest.raises(UserError, match="meta"):
        profile(model, graph, progress=False)


def test_convolutions_alike_are_timed_once(monkeypatch):
    """A repeated block's convolutions (same input, weight, gradient layouts, geometry
    and gradients) share one measurement; one that differs in any of these is measured."""
    from monet_like import profile as profile_module
    from monet_like.variants import algorithm_sites, apply

    measured = []
    real = profile_module.algorithms._site_calls

    def counted(site, *args, **kwargs):
        measured.append(site["id"])
        return real(site, *args, **kwargs)

    monkeypatch.setattr(profile_module.algorithms, "_site_calls", counted)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),  # no input gradient: its own signature
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),  # as the one before
        nn.Conv2d(8, 8, 3, padding=2, dilation=2),  # another geometry
    )  # fmt: skip
    graph = apply(capture(model, (8, 8, 8), 4), "conv")
    p = profile(model, graph, repeats=1, use_cache=False, progress=False)
    sites = [s["id"] for s in algorithm_sites(graph)]  # in the graph's order
    assert len(sites) == 4 and len(set(measured)) == 3
    options = [p.algorithms[s] for s in sites]
    assert options[1] == options[2] and options[1] is not options[2]
    assert options[0].keys() != options[1].keys()  # no backward-data where no input gradient


@pytest.mark.parametrize("warm", [False, True])
def test_convolution_algorithms_workspace_is_recorded_on_a_call_of_its_own(warm):
    """A convolution option's workspace is recorded on one call before its timed rounds,
    not timed itself. A call not `warm` is first run once unrecorded: a library's set-up
    on a first call (here 4 MiB of scratch) is not the call's workspace (1 MiB). A warm
    one (every option on CPU) is recorded on its first call: a set-up there would be
    counted, never missed."""
    from monet_like.profile.algorithms import _timed_and_measured

    runs = []

    def call(name: str, setup_bytes: int, scratch_bytes: int):
        def run():
            first = name not in runs
            runs.append(name)
            scratch = torch.empty(setup_bytes if first else scratch_bytes, dtype=torch.uint8)
            del scratch

        return run

    calls = [call("a", 4 << 20, 1 << 20), call("b", 8 << 20, 2 << 20)]
    seconds, workspace = _timed_and_measured(calls, torch.device("cpu"), 2, [warm, warm])
    assert workspace == ([4 << 20, 8 << 20] if warm else [1 << 20, 2 << 20])
    assert len(seconds) == 2 and all(t > 0 for t in seconds)
    # the set-up call where not warm, the recorded one and two timed rounds, nothing more
    assert len(runs) == 2 * (3 + (not warm))


@pytest.mark.parametrize("timing_flops, workspace_flops", [(1e9, 1e10), (1, 1e10), (1, 1)])
def test_convolution_algorithms_workspace_at_the_solved_batch(
    monkeypatch, timing_flops, workspace_flops
):
    """conv mode: each algorithm's workspace is reported at the solved batch, whether its
    layer was timed there (small layers), or timed at the profile batch with workspace
    measured at the solved one, or both fitted from smaller batches (the FLOP limits
    forced down). im2col's workspace is known exactly: the whole batch's columns,
    C*kh*kw x Ho*Wo floats per sample; the last layer's backward also copies the
    gradient of the sum it receives (expanded, one float for all) into a whole one."""
    from monet_like import profile as profile_module
    from monet_like.variants import apply

    monkeypatch.setattr(profile_module.algorithms, "ALGORITHM_TIMING_FLOPS", timing_flops)
    monkeypatch.setattr(profile_module.algorithms, "ALGORITHM_WORKSPACE_FLOPS", workspace_flops)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    graph = apply(capture(model, (3, 16, 16), 8), "conv")
    p = profile(model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False)
    first, second = (p.algorithms[site] for site in sorted(p.algorithms))
    gradient_copy = 8 * 16 * 16 * 8 * 4  # the second layer's output, whole
    for options, channels, copied in ((first, 3, 0), (second, 8, gradient_copy)):
        columns = channels * 3 * 3 * 16 * 16 * 8 * 4
        assert dict((a, ws) for a, _, ws in options["forward"])[0] == columns
        assert dict((a, ws) for a, _, ws in options["weight"])[0] == columns + copied
        assert all(t > 0 for rows in options.values() for _, t, _ in rows)
    assert "data" not in first and "data" in second  # the input needs no gradient


class PatchEmbedding(nn.Module):
    """A ViT's stem: patches by a strided convolution, the token sequence behind a class
    token; the gradient reaching the convolution is a transposed slice of the sequence's."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, 8, 4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, 8))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        tokens = self.proj(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(len(tokens), -1, -1), tokens], 1)
        return self.head(tokens.tanh()).mean(1)


def test_convolution_algorithms_measured_on_the_graphs_layouts():
    """conv mode: the gradient a patch embedding receives is a strided view (gaps between
    samples, channels innermost), which the im2col backward copies whole before it runs;
    measured on a contiguous gradient, that copy was missing from the prediction (48 KiB
    on a tiny timm ViT). The weight part's workspace is the columns plus the copy."""
    from monet_like.variants import apply

    model, batch = PatchEmbedding(), 8
    graph = apply(capture(model, (3, 16, 16), batch), "conv")
    (backward,) = [n for n in graph.fx.graph.nodes if "conv2d_backward_algo" in str(n.target)]
    grad = backward.args[0].meta["val"]
    assert not grad.is_contiguous() and grad.stride()[0] == 17 * 8  # a slice of the sequence
    p = profile(model, graph, repeats=1, use_cache=False, progress=False)
    (options,) = p.algorithms.values()
    columns = 3 * 4 * 4 * 4 * 4 * batch * 4  # C*kh*kw x Ho*Wo floats per sample
    gradient_copy = 8 * 4 * 4 * batch * 4
    assert dict((a, ws) for a, _, ws in options["forward"])[0] == columns
    assert dict((a, ws) for a, _, ws in options["weight"])[0] == columns + gradient_copy


@pytest.mark.parametrize(
    "batch, timed_at, two, eight",
    [(64, 16, (32, -2), (16, -2)), (64, 4, (8, -2), (8, -2)), (48, 24, (48, -2), (48, -8)),
     (24, 24, (24, -2), (24, -8))],
)  # fmt: skip
def test_batch_chunk_options_timed_in_chunks_of_their_size_at_the_batch(
    monkeypatch, batch, timed_at, two, eight
):
    """conv mode: a batch-chunk option is timed in 2 chunks each as large as one of its
    chunks at the solved batch (at most the timing batch), not over the timing batch,
    where its chunks are a few samples; as itself at the solved batch where that is at
    most twice the timing batch. Each option's time is scaled from the batch it ran at.
    Where the layer is timed at the solved batch, every option runs there."""
    from monet_like.profile import algorithms
    from monet_like.variants import algorithm_sites, apply

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    graph = apply(capture(model, (3, 8, 8), batch), "conv")
    nodes = {n.name: n for n in graph.fx.graph.nodes}
    site = algorithm_sites(graph)[1]
    gen = torch.Generator().manual_seed(0)
    timed = algorithms._timing_calls(site, nodes, timed_at, batch, torch.device("cpu"), gen)
    expected = {-2: two, -8: eight}  # option -> (batch, algorithm) it is timed as
    assert {d for d, *_ in timed} == {"forward", "data", "weight", "both"}
    for direction, algo, rows, call in timed:
        want_rows, want_algo = expected.get(algo, (timed_at, algo))
        assert rows == want_rows and call.args[0].shape[0] == rows  # input or its gradient
        ran = call.args[-2] if direction == "data" else call.args[-1]  # the part's algorithm
        assert ran == want_algo
    # each time is scaled from its own batch: every call taking one second here
    monkeypatch.setattr(algorithms, "_timing_batch", lambda w, y, b, least: timed_at)
    monkeypatch.setattr(
        algorithms, "_fastest_interleaved", lambda calls, *a, **k: [1.0] * len(calls)
    )
    options = algorithms._algorithm_options(graph, torch.device("cpu"), 2, 1, progress=False)
    for rows in options[site["id"]].values():
        for algo, seconds, _ in rows:
            assert seconds == pytest.approx(batch / expected.get(algo, (timed_at,))[0])


def test_batch_chunk_options_workspace_fitted_from_batches_smaller_than_the_chunks(monkeypatch):
    """conv mode: 8 batch chunks (-8) fitted from batches 2 and 4 ran one sample per
    chunk there; at the solved batch a chunk holds 4. The batch chunks' fitted workspace
    (2 and 8 chunks: not run at the second batch) follows PyTorch's algorithm at the
    chunk's batch plus one chunk's result, and agrees with the figure measured at the
    solved batch (8 chunks' own line had given the one-sample figure: a quarter)."""
    from monet_like import profile as profile_module
    from monet_like.variants import apply

    model = nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)
    )
    graph = apply(capture(model, (8, 24, 24), 32), "conv")

    def options(timing_flops, workspace_flops):
        monkeypatch.setattr(profile_module.algorithms, "ALGORITHM_TIMING_FLOPS", timing_flops)
        monkeypatch.setattr(profile_module.algorithms, "ALGORITHM_WORKSPACE_FLOPS", workspace_flops)
        p = profile(model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False)
        return p.algorithms

    fitted, measured = options(1, 1), options(1, 1e15)
    for site, directions in measured.items():
        for direction in ("forward", "data"):
            if direction not in directions:
                continue
            at_batch = dict((a, ws) for a, _, ws in directions[direction])
            got = dict((a, ws) for a, _, ws in fitted[site][direction])
            for chunks in (-2, -8):
                assert at_batch[chunks] > 0
                assert got[chunks] == pytest.approx(at_batch[chunks], rel=0.1), (site, direction)


def test_pytorchs_convolution_algorithm_takes_the_steps_workspace_at_the_solved_batch(
    monkeypatch,
):
    """conv mode: where the step ran at the solved batch, PyTorch's own algorithm (-1)
    takes the step's measured workspace, forward and backward, even when the options'
    own figures are fitted from small batches (here made wrong on purpose); the other
    algorithms keep theirs (im2col's, in proportion to the batch, as measured there). The
    store-all prediction and the options agree."""
    from monet_like import profile as profile_module
    from monet_like.profile import algorithm_workspace, backward_option, option
    from monet_like.variants import algorithm_sites, apply

    monkeypatch.setattr(profile_module.algorithms, "ALGORITHM_TIMING_FLOPS", 1)
    monkeypatch.setattr(profile_module.algorithms, "ALGORITHM_WORKSPACE_FLOPS", 1)
    monkeypatch.setattr(profile_module, "_fits_in_memory", lambda graph, device: True)
    _inflated(monkeypatch, profile_module)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    graph = apply(capture(model, (3, 16, 16), 8), "conv")
    p = profile(model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False)
    monkeypatch.undo()
    direct = profile(model, graph, profile_batch=8, repeats=1, use_cache=False, progress=False)
    step = dict(direct.op_workspace)
    op_index = {op.name: op.index for op in graph.ops}
    for site in algorithm_sites(graph):
        options = p.algorithms[site["id"]]
        forward, backward = op_index[site["forward"][0]], op_index[site["backward"]]
        assert option(options["forward"], -1)[1] == step.get(forward, 0)
        assert backward_option(options, -1, -1)[1] == step.get(backward, 0)
        # im2col keeps its own figure, in proportion to the batch: as measured there
        for direction in ("forward", "data", "weight") & options.keys():
            measured_there = option(direct.algorithms[site["id"]][direction], 0)[1]
            assert option(options[direction], 0)[1] == measured_there
    assert dict(p.op_workspace) == {
        **{i: w for i, w in step.items() if w > 0},
        **{i: w for i, w in algorithm_workspace(graph, p.algorithms, {}).items() if w > 0},
    }


def test_a_convolution_backwards_predicted_workspace_is_the_calls():
    """conv mode: a backward that runs its data and weight parts in turn (any pair but
    PyTorch's own for both) takes, above its outputs, what the call takes: the data
    part's scratch is gone before the weight gradient is allocated. Taking the larger
    part's whole (oneDNN's data part here, about the weight gradient's size) overstated
    ResNet-50's full-mode peaks at 128 px by 2.1 MB. The layer is timed at the solved
    batch, so every option's figure is measured there, the batch chunks' too (a fit from
    a smaller batch had put 8 chunks of one sample 4 kB under the call)."""
    from monet_like.profile import algorithm_workspace, backward_option, weight_grad_bytes
    from monet_like.profile.workspace import _random_laid_out, _workspace_of
    from monet_like.variants import algorithm_sites, apply

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(128, 128, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(128, 128, 3, stride=2, padding=1),
    )  # fmt: skip
    graph = apply(capture(model, (128, 8, 8), 8), "conv")  # profiled at batch 4
    p = profile(model, graph, repeats=1, use_cache=False, progress=False)
    nodes = {n.name: n for n in graph.fx.graph.nodes}
    op_index = {op.name: op.index for op in graph.ops}
    (site,) = [s for s in algorithm_sites(graph) if "data" in p.algorithms[s["id"]]]
    forward, backward = nodes[site["forward"][0]], nodes[site["backward"]]
    gen = torch.Generator().manual_seed(0)
    grad, x, w = (
        _random_laid_out(v.meta["val"], None, gen, torch.device("cpu"))
        for v in (backward.args[0], forward.args[0], forward.args[1])
    )
    grad_bytes = weight_grad_bytes(graph, op_index[forward.name])
    assert grad_bytes == w.numel() * w.element_size()
    options = p.algorithms[site["id"]]
    overstated = False
    pairs = [(d, w) for d, _, _ in options["data"] for w, _, _ in options["weight"]]
    assert len(pairs) == 16  # PyTorch's, im2col, 2 and 8 batch chunks, for each part
    for data, weight in pairs[1:]:  # (-1, -1) runs as one call: measured as such

        def call(data=data, weight=weight):
            return torch.ops.monet_like.conv2d_backward_algo(
                grad, x, w, *forward.args[3:7], [True, True, False], data, weight
            )

        call()  # the library's set-up, as the profile's warm-up round
        predicted = algorithm_workspace(graph, p.algorithms, {site["id"]: [-1, data, weight]})
        assert predicted[op_index[backward.name]] == _workspace_of(call, torch.device("cpu"))
        overstated |= backward_option(options, data, weight)[1] > predicted[op_index[backward.name]]
    assert overstated  # the larger part taken whole would have been above it


def test_a_conv_graphs_convolutions_take_the_captured_profiles_times():
    """conv mode changes no op's work in the profiled step (each convolution runs PyTorch's
    own algorithm there): aligned to the captured graph's profile, every op takes that
    profile's time and the two store-all steps are equal, however differently the
    machine ran during the two profiles."""
    from monet_like.profile import align_times
    from monet_like.variants import apply

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    captured = capture(model, (3, 16, 16), 8)
    graph = apply(captured, "conv")
    reference = profile(model, captured, repeats=1, use_cache=False, progress=False)
    prof = profile(model, graph, repeats=1, use_cache=False, progress=False)
    convs = [o for o in graph.ops if str(o.target).startswith("monet_like.conv2d")]
    assert len(convs) == 4 and not any(o.name in {c.name for c in captured.ops} for o in convs)
    aligned = align_times(prof, graph, reference, captured)
    n = len(graph.ops)
    assert aligned.aligned.startswith(f"{n} of {n} ops timed as in the captured graph's")
    assert aligned.step_time_s == pytest.approx(reference.step_time_s, rel=1e-12)
    convolutions = [o for o in captured.ops if "convolution" in str(o.target)]
    assert sorted(aligned.op_times_s[o.index] for o in convs) == sorted(
        reference.op_times_s[o.index] for o in convolutions
    )


def _conv_block() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1),
    )  # fmt: skip


def test_a_conv_graphs_profile_is_derived_from_the_captured_and_the_full_modes():
    """The full mode's solve also weighs the convolution algorithms alone, on a profile
    built from the two it has: every op as the captured graph's profile has it, every
    site's algorithm options as the full mode's profile measured them. It must be what
    profiling that graph gives, once aligned: the same times, the same workspace, the
    same options (their times aside, which are the machine's)."""
    from monet_like.profile import align_times, derived_profile
    from monet_like.solver.problem import build_problem
    from monet_like.variants import apply

    torch.manual_seed(0)
    model = _conv_block()
    captured = capture(model, (3, 16, 16), 8)
    full = apply(captured, "inplace_conv_multiway_newnode")
    conv = apply(captured, "conv")
    reference, full_prof, conv_prof = (
        profile(model, g, repeats=1, use_cache=False, progress=False)
        for g in (captured, full, conv)
    )
    derived = derived_profile(conv, captured, reference, full_prof, full)
    measured = align_times(conv_prof, conv, reference, captured)
    assert derived.fingerprint == conv.fingerprint == measured.fingerprint
    assert derived.op_times_s == measured.op_times_s
    assert derived.step_time_s == pytest.approx(reference.step_time_s, rel=1e-12)
    assert derived.op_workspace == measured.op_workspace
    assert len(derived.algorithms) == 3
    assert sorted(derived.algorithms) == sorted(measured.algorithms)
    for site, options in derived.algorithms.items():
        for direction, rows in options.items():
            theirs = measured.algorithms[site][direction]
            assert [(a, w) for a, _, w in rows] == [(a, w) for a, _, w in theirs]
    # the full mode's measurements, as taken there
    assert sorted(map(repr, derived.algorithms.values())) == sorted(
        map(repr, full_prof.algorithms.values())
    )
    ours = build_problem(conv, derived, reference=reference)
    theirs = build_problem(conv, measured, reference=reference)
    assert ours.store_all_peak_bytes == theirs.store_all_peak_bytes
    assert ours.store_all_time_s == pytest.approx(theirs.store_all_time_s, rel=1e-12)
    # A site measured there without its backward (the mode's rewrites can leave one so)
    # is left to PyTorch's algorithm here, priced as the step ran it: options without a
    # backward would have priced this graph's backward at nothing.
    site = next(iter(full_prof.algorithms))
    full_prof.algorithms[site] = {"forward": full_prof.algorithms[site]["forward"]}
    partial = derived_profile(conv, captured, reference, full_prof, full)
    assert len(partial.algorithms) == 2 and partial.op_times_s == derived.op_times_s
    left = build_problem(conv, partial, reference=reference)
    assert len(left.algorithms) == 2 and left.store_all_peak_bytes == ours.store_all_peak_bytes
    # a rewrite without convolution sites gives the algorithms nothing to take from
    newnode = apply(captured, "newnode")
    prof = profile(model, newnode, repeats=1, use_cache=False, progress=False)
    assert derived_profile(conv, captured, reference, prof, newnode) is None


def test_large_random_inputs_repeat_one_pool_of_normal_values():
    """Inputs of ops measured alone at the solved batch are random normal values; above
    RANDOM_POOL of them they repeat one drawn pool (drawing each value took 15 s of a
    cold ResNet-50 profile), laid out as the graph's value (here channels-last, and a
    slice with gaps, whose storage is filled whole)."""
    from monet_like.profile.workspace import RANDOM_POOL, _random_laid_out

    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    small = _random_laid_out(torch.empty(4, 5, dtype=torch.float64), None, gen, cpu)
    assert small.shape == (4, 5) and small.dtype == torch.float64 and small.std() > 0.5
    shape = [3, RANDOM_POOL // 2 + 7]
    large = _random_laid_out(torch.empty(shape, device="meta"), None, gen, cpu)
    flat = large.reshape(-1)
    assert list(large.shape) == shape and torch.isfinite(flat).all()
    assert torch.equal(flat[RANDOM_POOL:], flat[: flat.numel() - RANDOM_POOL])
    assert abs(flat[:RANDOM_POOL].mean().item()) < 0.01
    assert abs(flat[:RANDOM_POOL].std().item() - 1) < 0.01
    meta = torch.empty(2, 8, 256, 256).to(memory_format=torch.channels_last)
    laid_out = _random_laid_out(meta, None, gen, cpu)
    assert laid_out.shape == meta.shape and laid_out.stride() == meta.stride()
    assert laid_out.std().item() == pytest.approx(1, abs=0.01)
    gaps = torch.empty(RANDOM_POOL // 100, 300, device="meta")[:, :200]
    sliced = _random_laid_out(gaps, None, gen, cpu)
    assert sliced.shape == gaps.shape and sliced.stride() == (300, 1)
    storage = torch.empty(0).set_(sliced.untyped_storage())
    assert torch.isfinite(storage).all() and storage.std().item() == pytest.approx(1, abs=0.01)
    more = 2 * gaps.shape[0]  # more rows than the gaps were laid out for: dense
    rows = _random_laid_out(gaps, more, gen, cpu)
    assert rows.shape == (more, 200) and rows.is_contiguous() and torch.isfinite(rows).all()


def test_inputs_already_random_in_the_buffer_are_not_written_again():
    """An op's input laid out where an earlier op's random inputs of its dtype lie, not
    written since, is taken as it is; after an op that writes into its inputs, or where
    a mask was laid out, the values are written again."""
    from monet_like.profile.workspace import _InputArena, _random_laid_out

    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    arena = _InputArena(cpu)
    big, small = torch.empty(64, 64, device="meta"), torch.empty(16, 64, device="meta")
    arena.reset(arena.nbytes_for([big]))
    first = _random_laid_out(big, None, gen, cpu, arena)
    first[0, 0] = 123.0  # a mark: still there if the next input is not written
    arena.reset(arena.nbytes_for([small]))
    again = _random_laid_out(small, None, gen, cpu, arena)
    assert again[0, 0].item() == 123.0 and again.std().item() > 0.5
    arena.written()  # an op wrote into its inputs
    arena.reset(arena.nbytes_for([small]))
    assert _random_laid_out(small, None, gen, cpu, arena)[0, 0].item() != 123.0
    arena.reset(arena.nbytes_for([big]))
    _random_laid_out(big, None, gen, cpu, arena)[0, 0] = 123.0
    arena.reset(arena.nbytes_for([small, big]))
    mask = _random_laid_out(
        torch.empty(16, 64, dtype=torch.bool, device="meta"), None, gen, cpu, arena
    )
    assert mask.dtype == torch.bool and 0 < mask.sum().item() < mask.numel()
    arena.reset(arena.nbytes_for([big]))
    assert _random_laid_out(big, None, gen, cpu, arena)[0, 0].item() != 123.0

    from torch.fx.experimental.proxy_tensor import make_fx

    from monet_like.profile.workspace import _workspace_alone

    for op, writes in ((torch.ops.aten.relu.default, False), (torch.ops.aten.relu_.default, True)):
        traced = make_fx(op, tracing_mode="fake")(torch.randn(64, 64))
        node = next(n for n in traced.graph.nodes if n.op == "call_function")
        _workspace_alone(node, cpu, gen, arena)
        assert (arena.pool_end == 0) == writes, op  # its input no longer random after it


def test_ops_run_alone_take_their_inputs_from_one_reused_buffer_and_measure_the_same():
    """The inputs of ops run alone are laid out in one buffer, reused op after op (fresh
    memory is paged in at its first write): each input as the graph lays it out, apart
    from the others, random; and the workspace measured is that with inputs of their own."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from monet_like.profile.workspace import (
        _InputArena,
        _random_laid_out,
        _span,
        _workspace_alone,
    )

    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    arena = _InputArena(cpu)
    metas = [
        torch.empty(2, 8, 16, 16).to(memory_format=torch.channels_last),
        torch.empty(30, 300, dtype=torch.float64)[:, :200],
        torch.empty(3, 5),
    ]
    arena.reset(arena.nbytes_for(metas))
    values = [_random_laid_out(m, None, gen, cpu, arena) for m in metas]
    for meta, value in zip(metas, values, strict=True):
        assert value.shape == meta.shape and value.stride() == meta.stride()
        assert value.dtype == meta.dtype and value.std().item() > 0.5
        assert value.untyped_storage().data_ptr() == arena.buffer.data_ptr()
        assert value.data_ptr() % 64 == 0
    spans = [
        (v.data_ptr(), v.data_ptr() + v.element_size() * _span(v.shape, v.stride())) for v in values
    ]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), "no overlap"
    with pytest.raises(RuntimeError, match="too small"):
        arena.take((1000,), (1,), torch.float32)

    def step(x, w, g):
        return torch.ops.aten.convolution_backward(
            g, x, w, None, [1], [1], [1], False, [0], 1, [True, True, False]
        )

    x, w = torch.randn(8, 16, 32, 32), torch.randn(32, 16, 3, 3)
    graph = make_fx(step, tracing_mode="fake")(x, w, torch.randn(8, 32, 32, 32))
    node = next(n for n in graph.graph.nodes if n.op == "call_function")
    own, seconds = _workspace_alone(node, cpu, gen)
    assert own > 0 and seconds > 0
    assert _workspace_alone(node, cpu, gen, arena)[0] == own
    assert arena.buffer.numel() >= arena.nbytes_for([x, w, torch.empty(8, 32, 32, 32)])


def test_the_algorithm_ratio_benchmark_compares_the_timing_batch_with_the_batch(tmp_path):
    """scripts/bench_algorithm_ratios.py on ResNet-18 (32 px, batch 16): with the timing
    batch forced below the batch each option's two ratios are two measurements; where the
    layer is timed at the batch itself, one measurement, so no error."""
    import csv
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "bench_algorithm_ratios.py"

    def run(flops: str, out) -> list[dict]:
        done = subprocess.run(
            [sys.executable, str(script), "--model",
             "torchvision.models.resnet18()", "--batch", "16", "--input_shape", "3,32,32",
             "--sites", "2", "--rounds", "1", "--timing_flops", flops, "--csv", str(out)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert "one round of every option" in done.stdout
        return list(csv.DictReader(open(out)))

    below = run("1e6", tmp_path / "below.csv")
    assert {r["timing batch"] for r in below} == {"4"}  # the least: the profile batch
    assert {r["option"] for r in below} == {"im2col", "2 chunks", "8 chunks"}
    assert all(float(r["ratio at batch"]) > 0 for r in below)
    at_batch = run("1e12", tmp_path / "at.csv")
    assert {r["timing batch"] for r in at_batch} == {"16"}
    assert all(float(r["error"]) == 0 for r in at_batch)


def _check_net() -> tuple[nn.Module, Graph]:
    """Convolutions of distinct shapes: each forward and backward its own op alone."""
    model = nn.Sequential(*(nn.Conv2d(c, c + 1, 3, padding=1) for c in range(3, 7)))
    return model, capture(model, (3, 8, 8), 8)


def _alone_timed(monkeypatch, slow: str, beside: set[str] = frozenset()) -> list[str]:
    """Ops alone take fixed seconds by name (none run): `slow` 'first' doubles each op's
    first call (a slow spell over the pass), 'again' its later calls (the machine got
    busy at its end), 'wavering' its first and third calls (a machine slow on and off),
    '' neither. The first call of an op named in `beside` runs beside
    other work (twice as long, other processes' CPU time rising), and with `slow`
    'beside' every later call of any op too. Returns the names called, in order."""
    from monet_like.profile import workspace as workspace_module

    called: list[str] = []
    others = [0.0]  # other processes' CPU seconds

    def timed(node, device, gen, arena=None, at=None):
        called.append(node.name)
        first = called.count(node.name) == 1
        slowed = {"first": first, "again": not first, "wavering": called.count(node.name) % 2}
        factor = 2.0 if slowed.get(slow) else 1.0
        if (first and node.name in beside) or (slow == "beside" and not first):
            factor, others[0] = 2.0, others[0] + 1.0
        return 0, factor * 0.001 * len(node.name)

    monkeypatch.setattr(workspace_module, "_workspace_alone", timed)
    monkeypatch.setattr(workspace_module, "_others_cpu_s", lambda: others[0])
    monkeypatch.setattr(workspace_module, "CONTENTION_WINDOW_S", 0.0)  # a window per op
    monkeypatch.setattr(workspace_module, "ALONE_CHECK_OPS", 3)
    monkeypatch.setattr(workspace_module, "ALONE_CHECK_LEAST_S", 0.0)
    return called


@pytest.mark.parametrize("slow", ["", "first", "again", "wavering"])
def test_a_pass_of_ops_alone_is_checked_by_its_first_ops_timed_again(monkeypatch, slow):
    """Each op runs alone once: at the end of the pass its first ops are timed again. A
    pass that ran them slower than that (a slow spell) is timed again whole, each op keeping
    its lesser time, and its first ops a third time to tell whether the kept times hold; a
    quiet pass, or one whose check ran slower (the machine busy at its end), keeps its
    times. The check says by how much either way."""
    from monet_like.profile import workspace as workspace_module

    _model, graph = _check_net()
    called = _alone_timed(monkeypatch, slow)
    runs = workspace_module.AloneRuns()
    seconds: dict[int, float] = {}
    measured, _ = workspace_module._remeasure_alone(
        graph, torch.device("cpu"), [0] * len(graph.ops), seconds=seconds, runs=runs
    )
    names = {op.index: op.name for op in graph.ops}
    pass_names = [names[i] for i in measured]
    assert len(pass_names) >= 6 and called[: len(pass_names)] == pass_names
    check = runs.check
    assert check is not None and check.ops == 3
    assert called[len(pass_names) : len(pass_names) + 3] == pass_names[:3]  # the first three
    if slow in ("first", "wavering"):
        assert check.drift == pytest.approx(1.0) and check.retimed == len(pass_names)
        # every op timed again, once, then the first three a third time
        assert sorted(called) == sorted(pass_names * 2 + pass_names[:3])
        assert called[-3:] == pass_names[:3]
        # held (a slow spell at the start) or not (the third calls slow again)
        assert check.after == pytest.approx(0.0 if slow == "first" else -0.5)
        assert check.settled == (slow == "first")
    else:
        assert check.drift == pytest.approx(0.0 if slow == "" else -0.5)
        assert not check.retimed and len(called) == len(pass_names) + 3
        assert check.after is None and not check.settled
    # each op its plain time: the lesser of two where the pass ran slow, else the first
    assert seconds == pytest.approx({i: 0.001 * len(names[i]) for i in measured})


def test_a_profile_keeps_its_ops_alone_check_and_says_a_slow_spell(monkeypatch):
    """The check of the ops timed alone goes into the profile (its drift, whether they were
    timed again, how that held) and the line saying how the times were taken; a drift
    beyond ALONE_DRIFT makes the profile unsure, and says so, unless every op was timed
    again and that held when checked once more. Kept through the cache's JSON."""
    model, graph = _check_net()
    _alone_timed(monkeypatch, "wavering")
    slow = profile(model, graph, profile_batch=2, repeats=1, progress=False, use_cache=False)
    assert slow.alone_drift == pytest.approx(1.0) and slow.alone_retimed
    assert slow.alone_drift_after == pytest.approx(-0.5)
    assert "3 of them timed again at the end took 0.50 of their first time" in slow.time_method
    assert "its first ops timed a third time took 2.00 of their kept time" in slow.time_method
    assert (
        "ops timed alone ran 100% slower at first than at the end, each op then timed again"
        " and 50% off when checked once more" in slow.noisy
    )
    again = Profile.from_json(slow.to_json())
    assert again.alone_drift == slow.alone_drift and again.alone_retimed
    assert again.alone_drift_after == slow.alone_drift_after and again.noisy == slow.noisy
    _alone_timed(monkeypatch, "first")
    repaired = profile(model, graph, profile_batch=2, repeats=1, progress=False, use_cache=False)
    assert repaired.alone_drift == pytest.approx(1.0) and repaired.alone_retimed
    assert repaired.alone_drift_after == pytest.approx(0.0)
    assert "took 1.00 of their kept time" in repaired.time_method
    assert "alone" not in repaired.noisy
    _alone_timed(monkeypatch, "")
    quiet = profile(model, graph, profile_batch=2, repeats=1, progress=False, use_cache=False)
    assert quiet.alone_drift == pytest.approx(0.0) and not quiet.alone_retimed
    assert "took 1.00 of their first time" in quiet.time_method and "alone" not in quiet.noisy


def test_a_solve_keeps_and_says_its_profiles_ops_alone_check(monkeypatch, tmp_path):
    """The check's drift goes into the solution beside the timed runs' spread, the solve's
    overhead line says both, and a drift beyond ALONE_DRIFT is said as the profile unsure."""
    from monet_like.cli.solve import _noise

    monkeypatch.setenv("MONET_LIKE_CACHE", str(tmp_path))
    model, _graph = _check_net()
    _alone_timed(monkeypatch, "wavering")
    lines: list[str] = []
    compiled = pipeline.compile_schedule(
        model, (3, 8, 8), 8, budget_fraction=1.0, progress=lines.append
    )
    extra = compiled.solution.extra
    assert extra["profile_alone_drift"] == pytest.approx(1.0)
    assert extra["profile_alone_drift_after"] == pytest.approx(-0.5)
    assert any("ops timed alone ran 100% slower at first" in line for line in lines)
    noise = _noise(compiled.solution)
    assert noise.startswith(" (the profile's timed runs spread")
    assert "alone 100.0% off when checked, 50.0% once all were timed again" in noise


@pytest.mark.parametrize("busy_at_the_end", [False, True])
def test_ops_alone_run_beside_other_work_are_timed_again(monkeypatch, busy_at_the_end):
    """An op alone run while other processes took the machine (their CPU time rising) is
    timed again at the end of the pass and keeps its lesser time, wherever it ran in the
    pass; where the machine is still busy then, the timing again stops after a window
    and the profile says it is unsure."""
    from monet_like.profile import workspace as workspace_module

    model, graph = _check_net()
    names = {op.index: op.name for op in graph.ops}
    backward = [op.name for op in graph.ops if op.name.startswith("convolution_backward")]
    beside = set(backward[1:3])  # mid-pass, past the first ops the drift check takes
    slow = "beside" if busy_at_the_end else ""
    called = _alone_timed(monkeypatch, slow, beside)
    runs = workspace_module.AloneRuns()
    seconds: dict[int, float] = {}
    measured, _ = workspace_module._remeasure_alone(
        graph, torch.device("cpu"), [0] * len(graph.ops), seconds=seconds, runs=runs
    )
    check = runs.check
    assert check.contended == 2 and check.drift is not None
    again = called[len(measured) + check.ops :]  # after the pass and its first ops' check
    if busy_at_the_end:
        assert check.busy and check.retimed == 1 and len(again) == 1
    else:
        assert not check.busy and check.retimed == 2 and sorted(again) == sorted(beside)
        assert seconds == pytest.approx({i: 0.001 * len(names[i]) for i in measured})
    _alone_timed(monkeypatch, slow, beside)  # afresh: no op called yet
    import monet_like.profile as profile_module

    monkeypatch.setattr(profile_module, "load_per_core", lambda: 0.5)  # whatever else runs
    prof = profile(model, graph, profile_batch=2, repeats=1, progress=False, use_cache=False)
    if busy_at_the_end:
        assert prof.alone_busy and "2 of its ops timed alone ran beside other work" in prof.noisy
        assert "(stopped: the machine still busy)" in prof.time_method
    else:
        assert prof.alone_contended == 2 and prof.alone_retimed == 2 and not prof.noisy
        assert "2 ran beside other work; 2 timed again" in prof.time_method
        from types import SimpleNamespace

        from monet_like.cli.solve import _noise

        extra = {"profile_alone_drift": 0.0, "profile_alone_contended": 2}  # what it reads
        line = _noise(SimpleNamespace(extra=extra))
        assert "2 of them run beside other work, timed again" in line
