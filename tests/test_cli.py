"""The command line as a user meets it: one-line errors with exit 2, JSON last line."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "monet_like", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["memory", "torchvision.models.no_such_net()", "4"], "no model named"),
        (["memory", "torchvision.models.resnet18(", "4"], "malformed"),
        (["memory", "torchvision.models.resnet18()", "0"], "at least 1"),
        (["memory", "torchvision.models.resnet18()", "2", "--input_shape", "3,32"], "input shape"),
        (["memory", "torchvision.models.resnet18()", "2", "--dtype", "int8"], "dtype"),
        (["memory", "gpt", "2", "--input_shape", "4,4,4"], "input shape"),
        (["memory", "monet_like.models.unet:UNet", "2"], "--input_shape"),
        (["profile", "torchvision.models.resnet18()", "two"], "positive integer"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert message in lines[0]


def test_profile_json_last_line():
    r = run(
        "profile",
        "torchvision.models.resnet18()",
        "2",
        "--input_shape",
        "3,32,32",
        "--repeats",
        "1",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("nodes", "fixed_bytes", "store_all_peak_bytes", "profile_batch", "device"):
        assert key in report
    assert report["nodes"] > 50 and report["store_all_peak_bytes"] > report["fixed_bytes"] > 0
    assert report["device"] == "cpu" and report["profile_batch"] == 2
    assert report["time_method"] == "timed runs at batch 2"  # the batch itself: unscaled
    assert "  times: timed runs at batch 2" in r.stdout


def test_memory_command_simulates_without_allocating():
    r = run("memory", "torchvision.models.resnet50()", "184", "--simulate", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["simulated_peak_bytes"] == pytest.approx(report["store_all_peak_bytes"], rel=0.01)
