"""solve.py as a user meets it: MONeT's argument order, JSON last line, exit 2 on bad input."""

import json
import os
import subprocess
import sys

import pytest

from monet_like.solution import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["torchvision.models.resnet18()", "16"]
SMALL = ["--input_shape", "3,64,64", "--json"]


def run(*args):
    return subprocess.run(
        [sys.executable, "solve.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )


def last_json(r):
    return json.loads(r.stdout.strip().splitlines()[-1])


def budget_between(expression, batch, shape, fraction, input_grad=False) -> str:
    """A budget in GB (as typed) `fraction` of the way from the smallest feasible budget
    to the store-all peak. Workspace, and so both ends, depends on the CPU (oneDNN on
    AVX2 needs 72 MiB beside one of ResNet-18's convolutions, on AVX-512 far less): a
    fixed number of GB is feasible on one machine and not on another. The profile is
    cached, so solve.py then reads the same one."""
    from monet_like.graph import capture
    from monet_like.models import parse_model
    from monet_like.profile import profile
    from monet_like.solver import DEFAULT_DEPTH, min_feasible_budget
    from monet_like.solver.problem import build_problem

    model = parse_model(expression).build()
    graph = capture(model, shape, batch, model_name=expression, input_grad=input_grad)
    problem = build_problem(graph, profile(model, graph, progress=False))
    low = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS")
    budget = low + fraction * (problem.store_all_peak_bytes - low)
    return f"{budget / 2**30:.6f}"


@pytest.mark.parametrize("frees", [[], ["--frees"]])
def test_solve_writes_a_solution_within_budget(tmp_path, frees):
    out = tmp_path / "s.json"
    budget = budget_between(MODEL[0], 16, (3, 64, 64), 0.3)
    r = run(*MODEL, budget, "normal", "CBC", *SMALL, "--output", str(out), *frees)
    assert r.returncode == 0, r.stderr
    report = last_json(r)
    for key in (
        "status",
        "predicted_peak_bytes",
        "predicted_time_s",
        "store_all_peak_bytes",
        "store_all_time_s",
        "gap",
        "step_gap",
        "solve_time_s",
        "solution_file",
    ):
        assert key in report
    assert report["status"] in ("optimal", "feasible")
    assert report["predicted_peak_bytes"] <= float(budget) * 2**30
    sol = load(out)
    assert sol.model == MODEL[0] and sol.batch == 16 and sol.input_shape == (3, 64, 64)
    assert sol.mode == "normal" and sol.solver == "CBC"
    # without --frees, the frees only where the default's second solve found a cheaper schedule
    improved = bool((sol.stats.get("frees_tried") or {}).get("improved"))
    assert sol.stats["frees"] == (bool(frees) or improved)
    # the search before the frees is recorded on its own: where they improved nothing, it
    # is the solution's
    first = sol.stats["first_search"]
    if not improved:
        assert first["status"] == sol.status
        assert first["recompute_s"] == pytest.approx(sol.objective_s, rel=1e-6, abs=1e-9)
    assert first["seconds"] <= sol.solve_time_s


def test_default_output_name(tmp_path):
    r = run(*MODEL, "100", "normal", "HIGHS", *SMALL, "--output_dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    report = last_json(r)
    assert report["status"] == "store-all"
    # MONeT's name, with the input shape appended where it is not the model's default.
    name = os.path.basename(report["solution_file"])
    assert name == "solution_resnet18_16_normal_100_3x64x64.json"
    # Without the frees a schedule can differ from the default one, which tries them.
    r = run(*MODEL, "100", "normal", "HIGHS", *SMALL, "--output_dir", str(tmp_path), "--no_frees")
    assert r.returncode == 0, r.stderr
    name = os.path.basename(last_json(r)["solution_file"])
    assert name == "solution_resnet18_16_normal_100_3x64x64_nofrees.json"


def test_infeasible_budget_exits_2_with_smallest_feasible_budget():
    r = run(*MODEL, "0.05", "normal", "HIGHS", *SMALL)
    assert r.returncode == 2
    assert "smallest feasible budget" in r.stderr and "Traceback" not in r.stderr
    assert "--formulation full" in r.stderr  # the compact formulation's smallest, said so
    # The search for it (up to minutes) shows that it runs and what it has found.
    assert "searching for its smallest budget" in r.stdout
    assert "smallest budget so far" in r.stdout
    report = last_json(r)
    assert report["status"] == "infeasible"
    assert report["min_feasible_budget_bytes"] > report["fixed_bytes"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        ([*MODEL, "5", "normal", "NOSUCH"], "unknown solver"),
        ([*MODEL, "-1", "normal", "CBC"], "positive"),
        ([*MODEL, "5", "turbo", "CBC"], "unknown mode"),
        ([*MODEL, "5", "normal", "HIGHS", "--frees", "--no_frees"], "not allowed with"),
    ],
)
def test_bad_input_is_one_line(args, message):
    r = run(*args)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_input_grad_schedule_checks_against_eager(tmp_path):
    out = tmp_path / "s.json"
    model = ["torchvision.models.resnet18()", "4"]
    shape = ["--input_shape", "3,32,32", "--json"]
    budget = budget_between(model[0], 4, (3, 32, 32), 0.3, input_grad=True)
    r = run(*model, budget, "normal", "HIGHS", *shape, "--input_grad", "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert load(out).input_grad
    check = subprocess.run(
        [sys.executable, "schedule.py", *model, budget, "normal", "HIGHS", "--solution_file",
         str(out), *shape, "--check_diff"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr
    report = last_json(check)
    assert report["max_abs_input_grad_diff"] == 0.0 and report["max_abs_grad_diff"] == 0.0


def test_a_gap_of_the_frees_says_how_the_search_before_them_ended():
    """The frees' formulation has a far weaker LP bound: its gap alone would make a
    schedule that improves on a proved one read as a poor one."""
    from types import SimpleNamespace

    from monet_like.cli.solve import _before_frees

    first = {"status": "optimal", "gap": 0.0008, "recompute_s": 6.967, "seconds": 8.1}
    improved = SimpleNamespace(stats={"frees_tried": {"improved": True}, "first_search": first})
    line = _before_frees(improved)
    assert "6.967 s recomputed, proved optimal after 8.1 s" in line and "--no_frees" in line
    first.update(status="feasible", gap=0.031)
    assert "left at a 3.10% gap of its recomputation" in _before_frees(improved)
    first.update(gap=None)
    assert "left unproved" in _before_frees(improved)
    # where the frees improved nothing (or were not tried), the gap is the search's own
    for tried in ({"improved": False}, None):
        plain = SimpleNamespace(stats={"frees_tried": tried, "first_search": first})
        assert _before_frees(plain) == ""
