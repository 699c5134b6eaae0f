"""examples/imagenet.py trains like eager PyTorch, in one process and under torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision

from monet_like.pipeline import compile_schedule

ROOT = Path(__file__).resolve().parents[1]
BATCH, SIZE = 8, 32


@pytest.fixture(scope="module")
def schedule(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("imagenet") / "resnet18.json"
    torch.manual_seed(0)
    compiled = compile_schedule(
        torchvision.models.resnet18(), (3, SIZE, SIZE), BATCH, budget_fraction=0.3,
        solver="HIGHS", repeats=1, time_limit=20, output=path,
    )  # fmt: skip
    assert any(s["recompute"] for s in compiled.solution.stages)
    return path


def losses(*command: str) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    found = re.findall(r"step \d+ loss (\S+)", r.stdout)
    assert len(found) == 3, r.stdout
    return found


def imagenet(*extra: str) -> list[str]:
    return [
        "examples/imagenet.py", "--arch", "resnet18", "--batch-size", str(BATCH),
        "--image-size", str(SIZE), "--steps", "3", "--workers", "0", "--lr", "0.01", *extra,
    ]  # fmt: skip


def test_imagenet_example_trains_like_eager(schedule):
    scheduled = losses(sys.executable, *imagenet("--solution_file", str(schedule)))
    eager = losses(sys.executable, *imagenet())
    assert scheduled == eager  # the replay is bitwise: the same losses, step after step


def test_imagenet_example_under_torchrun_trains_like_eager(schedule):
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    scheduled = losses(*torchrun, *imagenet("--solution_file", str(schedule)))
    eager = losses(*torchrun, *imagenet())
    assert scheduled == eager


def test_imagenet_example_refuses_another_image_size(schedule):
    command = [sys.executable, "examples/imagenet.py", "--arch", "resnet18", "--batch-size",
               str(BATCH), "--image-size", "64", "--solution_file", str(schedule)]  # fmt: skip
    r = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
