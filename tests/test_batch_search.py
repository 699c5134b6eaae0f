"""solve.py MODEL auto ...: the largest batch whose schedule fits a budget."""

import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from monet_like.batch_search import REFERENCE_BATCH, _search, largest_batch
from monet_like.graph import capture
from monet_like.pipeline import compile_schedule
from monet_like.profile import profile
from monet_like.profile.align import at_batch
from monet_like.solution import load
from monet_like.solver import InfeasibleBudget
from monet_like.solver.problem import build_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (3, 16, 16)


def small_net() -> nn.Module:
    torch.manual_seed(0)
    layers, width = [], 3
    for out in (8, 16, 16, 32):
        layers += [nn.Conv2d(width, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
        width = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


@pytest.mark.parametrize("largest", [1, 3, 7, 8, 9, 100, 1000])
def test_the_search_finds_the_largest_batch_trying_batch_1_last(largest):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= largest

    assert _search(fits, 0, None, REFERENCE_BATCH) == largest
    assert tried[0] == REFERENCE_BATCH
    assert (1 in tried) == (largest < 2)
    assert len(tried) <= 2 * math.log2(max(largest, 2)) + 4
    # Resumed from what is known (batch 8 fits, 20 does not): only batches between.
    tried.clear()
    if 8 <= largest < 20:
        assert _search(fits, 8, 20, REFERENCE_BATCH) == largest
        assert all(8 < b < 20 for b in tried)


def test_a_profile_is_carried_over_to_another_batch():
    """From profiles at two batches: bytes exact at the new batch, workspace never below
    either measurement, times on the line through both (at a measured batch, the
    measured time where the op does not get faster with the batch)."""
    model = small_net()
    graphs = {b: capture(model, SHAPE, b) for b in (4, 8, 32)}
    profs = {b: profile(model, graphs[b], progress=False) for b in (4, 8)}
    sources = [(graphs[4], profs[4]), (graphs[8], profs[8])]
    carried = at_batch(sources, graphs[32])
    assert carried.batch == 32 and carried.fingerprint == graphs[32].fingerprint
    assert [n.output_bytes for n in carried.nodes] == [n.output_bytes for n in graphs[32].nodes]
    ws = {b: dict(profs[b].op_workspace) for b in (4, 8)}
    for i, w in carried.op_workspace:
        assert w >= max(ws[4].get(i, 0), ws[8].get(i, 0))
    assert {i for i, _ in carried.op_workspace} >= set(ws[4]) | set(ws[8])
    back = at_batch(sources, graphs[8])
    for t4, t8, t in zip(profs[4].op_times_s, profs[8].op_times_s, back.op_times_s, strict=True):
        assert t == pytest.approx(t8 if t8 >= t4 else t4)
    # Batch-dependent control flow is refused, not carried over.
    other = capture(nn.Sequential(nn.Flatten(), nn.Linear(768, 10)), SHAPE, 32)
    with pytest.raises(ValueError, match="differ"):
        at_batch(sources, other)


def _budget_at(model, batch: int) -> int:
    """The store-all peak at `batch` on this machine's profile (workspace depends on the
    CPU): a budget that the schedule at `batch` meets without recomputation."""
    graph = capture(model, SHAPE, batch)
    return build_problem(graph, profile(model, graph, progress=False)).store_all_peak_bytes


def test_auto_finds_a_batch_that_fits_while_a_tenth_larger_does_not():
    model = small_net()
    budget = _budget_at(model, 48)
    lines = []
    found = largest_batch(model, SHAPE, budget, "normal", "HIGHS", progress=lines.append,
                          time_limit=60)  # fmt: skip
    sol = found.compiled.solution
    assert sol.batch == found.batch >= 48  # store-all at 48 fits; recomputation goes further
    assert sol.predicted_peak_bytes <= budget
    assert found.probes[-1].batch == found.batch + 1 and not found.probes[-1].fits
    larger = math.ceil(1.1 * found.batch)
    with pytest.raises(InfeasibleBudget):  # checked on its own profile, not estimated
        compile_schedule(model, SHAPE, larger, budget, "normal", "HIGHS", time_limit=60)
    assert any("compiling its schedule" in line for line in lines)


def test_auto_holds_to_a_largest_overhead():
    model = small_net()
    budget = _budget_at(model, 48)
    found = largest_batch(model, SHAPE, budget, "normal", "HIGHS", max_overhead=0.0,
                          time_limit=60)  # fmt: skip
    assert found.compiled.solution.overhead <= 1e-9
    assert found.compiled.solution.predicted_peak_bytes <= budget
    assert not found.probes[-1].fits


def test_auto_from_the_command_line(tmp_path):
    model = "torchvision.models.resnet18(num_classes=10)"
    r = subprocess.run(
        [sys.executable, "solve.py", model, "auto", "0.13", "normal", "HIGHS", "--input_shape",
         "3,16,16", "--max_overhead", "20", "--output_dir", str(tmp_path), "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert r.returncode in (0, 2), r.stderr
    if r.returncode == 2:  # this CPU's workspace puts even small batches above 0.13 GB
        assert r.stderr.count("\n") == 1 and "no batch fits" in r.stderr
        return
    import json

    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["overhead"] <= 0.20 + 1e-9
    assert report["predicted_peak_bytes"] <= int(0.13 * 2**30)
    saved = load(report["solution_file"])
    assert saved.batch == report["batch"] and f"_{saved.batch}_normal_0.13" in str(
        report["solution_file"]
    )
    assert any(t["batch"] == report["batch"] + 1 and not t["fits"] for t in report["batches_tried"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["16", "0.5", "normal", "HIGHS", "--max_overhead", "10"], "goes with batch auto"),
        (["auto", "0.5", "normal", "HIGHS", "--max_overhead", "-1"], "percentage >= 0"),
        (["autox", "0.5", "normal", "HIGHS"], "positive integer"),
    ],
)
def test_auto_bad_input_is_one_line(args, message):
    r = subprocess.run(
        [sys.executable, "solve.py", "torchvision.models.resnet18()", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
