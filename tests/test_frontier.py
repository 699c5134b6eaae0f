"""python -m monet_like frontier: monet_like's schedules beside PyTorch's own tools."""

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from torch import nn

from monet_like.frontier import frontier, table, write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sequential_net() -> nn.Sequential:
    torch.manual_seed(0)
    layers, width = [], 3
    for out in (8, 16, 16, 32):
        layers.append(
            nn.Sequential(nn.Conv2d(width, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU())
        )
        width = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def test_the_frontier_measures_every_tool_in_one_run(tmp_path):
    model = sequential_net()
    lines = []
    points = frontier(model, (3, 16, 16), 8, fractions=(1.0, 0.0), repeats=1,
                      time_limit=60, progress=lines.append)  # fmt: skip
    tools = [p.tool for p in points]
    assert tools[0] == "eager" and points[0].overhead == 0
    assert points[0].memory_fraction == points[0].activation_fraction == 1.0
    ours = [p for p in points if p.tool == "monet_like normal"]
    assert len(ours) == 2
    for p in ours:  # replayed: the measured peak within the prediction
        assert p.measured_peak_bytes <= p.predicted_peak_bytes
    # the smallest budget is below store-all and measured so
    assert ours[1].measured_peak_bytes < ours[0].measured_peak_bytes
    segments = {p.setting for p in points if p.tool == "checkpoint_sequential"}
    assert segments == {"2 segments", "4 segments"}  # 8 is not fewer than the 7 children
    assert sum(p.tool == "block checkpointing" for p in points) == 2
    partitioned = [p for p in points if p.tool == "compile partitioner"]
    assert len(partitioned) == 4 and all("running statistics" in p.note for p in partitioned)
    assert all(p.measured_peak_bytes > 0 for p in points)
    csv, png = write(points, tmp_path, "test")
    df = pd.read_csv(csv)
    assert list(df.columns)[0] == "tool" and len(df) == len(points)
    assert png.stat().st_size > 0
    assert "compile partitioner" in table(points)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fractions", "1.5"], "within [0, 1]"),
        (["--budgets", "x"], "comma-separated numbers"),
        (["--budgets", "0.1", "--activation", "0.5"], "not both"),
        (["--modes", "bogus"], "mode"),
        (["--solver", "nope"], "unknown solver"),
    ],
)
def test_frontier_bad_input_is_one_line(args, message):
    r = subprocess.run(
        [sys.executable, "-m", "monet_like", "frontier", "torchvision.models.resnet18()", "4",
         *args],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_batch_too_large_to_run_is_predicted_beside_the_measured_one(tmp_path, monkeypatch):
    """With predict_batch, monet_like's schedules at that batch are compiled but not run:
    their points say so, hold the prediction itself as fractions of the predicted
    store-all step, and the table, CSV and plot keep them apart from measured points.
    The schedule files the frontier replays from leave nothing in the temporary folder."""
    import tempfile

    from monet_like.pipeline import compile_schedule

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    model = sequential_net()
    points = frontier(model, (3, 16, 16), 4, fractions=(1.0, 0.0), peers=False, repeats=1,
                      predict_batch=16, time_limit=60)  # fmt: skip
    assert not list(temporary.glob("monet_like_frontier_*"))
    measured = [p for p in points if p.basis == "measured"]
    predicted = [p for p in points if p.basis != "measured"]
    assert [p.tool for p in measured] == ["eager", "monet_like normal", "monet_like normal"]
    assert len(predicted) == 2 and all(p.basis == "predicted at batch 16" for p in predicted)
    top, smallest = predicted
    assert top.memory_fraction == 1.0 and top.activation_fraction == pytest.approx(1.0)
    assert top.overhead == top.predicted_overhead == pytest.approx(0.0, abs=1e-9)
    assert smallest.measured_peak_bytes == smallest.predicted_peak_bytes
    assert smallest.activation_fraction < 1.0 and smallest.overhead > 0
    # the same figure a solve at batch 16 gives for that budget
    again = compile_schedule(model, (3, 16, 16), 16, budget_fraction=0.0, time_limit=60)
    assert again.solution.predicted_peak_bytes == smallest.predicted_peak_bytes
    assert "predicted at batch 16" in table(points)
    csv, _png = write(points, tmp_path, "test")
    assert (pd.read_csv(csv)["basis"] == "predicted at batch 16").sum() == 2


def test_every_tool_is_measured_on_the_loop_the_schedules_are_solved_for():
    """Outputs held to the step's end, or dropped before backward: eager's step (and
    each peer's) runs the same loop as monet_like's schedules. A model whose output
    dwarfs its activations (1 MiB of logits): store-all replays at eager's peak in either
    loop, and holding the outputs costs eager exactly their bytes. (The peers once ran
    the dropping loop beside schedules solved holding them: the benchmarks' GPT's 8 MiB
    of logits went to the peers' favour.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4096))
    eager = {}
    for held in (True, False):
        points = frontier(model, (16,), 64, fractions=(1.0,), peers=False, repeats=1,
                          time_limit=30, outputs_held=held)  # fmt: skip
        eager[held], store_all = points
        assert store_all.tool == "monet_like normal"
        assert store_all.measured_peak_bytes == eager[held].measured_peak_bytes, held
    output_bytes = 64 * 4096 * 4
    assert eager[True].measured_peak_bytes - eager[False].measured_peak_bytes == output_bytes


def test_budgets_that_round_alike_stay_two_points():
    """Two budgets within 0.0001 GB (the setting's rounding) are two points, each with
    its own setting; the same budget twice is measured once, and said so."""
    from monet_like.pipeline import compile_schedule

    model = sequential_net()
    top = compile_schedule(model, (3, 16, 16), 8, budget_fraction=1.0).solution.budget_bytes
    lines = []
    points = frontier(model, (3, 16, 16), 8, budgets_bytes=(top, top + 1024, top + 1024),
                      peers=False, repeats=1, progress=lines.append)  # fmt: skip
    ours = [p for p in points if p.tool == "monet_like normal"]
    assert len(ours) == 2 and len({p.setting for p in ours}) == 2, [p.setting for p in ours]
    assert sum("measured once" in line for line in lines) == 1, lines


def test_monets_published_points_join_the_frontier_at_its_configurations(tmp_path):
    """At one of MONeT's five configurations the frontier carries its paper's points
    (their basis says so; peaks as fractions of its PyTorch peak); at any other, none."""
    import torchvision

    from monet_like.frontier import published

    model = torchvision.models.resnet50()
    points = published(model, "torchvision.models.resnet50()", 184, (3, 224, 224))
    assert [p.setting for p in points] == [f"peak {gb} GB" for gb in (10, 9, 8, 7, 6, 5)]
    assert points[0].overhead == pytest.approx(0.0322) and points[-1].overhead == pytest.approx(
        0.1195
    )
    assert points[0].memory_fraction == pytest.approx(10 / 15.06, abs=1e-6)
    assert all(p.basis.startswith("published") for p in points)
    fractions = [p.activation_fraction for p in points]
    assert fractions == sorted(fractions, reverse=True) and 0 < fractions[-1] < fractions[0] < 1
    vgg = published(torchvision.models.vgg16(), "torchvision.models.vgg16()", 176, (3, 224, 224))
    assert vgg[0].setting == "peak 9.71 GB"  # MONeT's own peak where the paper gives it
    assert published(model, "torchvision.models.resnet50()", 16, (3, 224, 224)) == []
    csv, _png = write(points, tmp_path, "published")
    assert (pd.read_csv(csv)["tool"] == "MONeT").all()
    assert "published: P100 GPU" in table(points)
