"""Bad input and faults: one line and exit 2 before any work, nothing lost or
overwritten, no process left behind, no budget exceeded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monet_like.cli import solve_main
from monet_like.files import atomic_write
from monet_like.solution import SolutionFileError, load

ROOT = Path(__file__).resolve().parent.parent
TINY = "monet_like.models.unet:UNet(base=2, depth=1)"


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if capture (the first stage) starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    # Modules that bind `capture` when imported are imported first: one imported while the
    # patch is on would keep `refuse` for every later test in this process.
    import monet_like.profile  # noqa: F401
    import monet_like.wrapper  # noqa: F401

    monkeypatch.setattr("monet_like.graph.capture", refuse)


def one_line_error(capsys, argv, main=solve_main, code=2) -> str:
    try:
        returned = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        returned = exc.code
    assert returned == code
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["torchvision.models.resnet18()", "4", "nan", "normal", "HIGHS"], "positive number"),
        (["torchvision.models.resnet18()", "4", "inf", "normal", "HIGHS"], "positive number"),
        (["torchvision.models.resnet18()", "4", "1e300", "normal", "HIGHS"], "beyond any"),
        (["torchvision.models.resnet18()", "4", "-1", "normal", "HIGHS"], "positive number"),
        (["torchvision.models.resnet18()", "0", "1", "normal", "HIGHS"], "at least 1"),
        (["torchvision.models.resnet18()", "4", "1", "normal", "HIGHS", "--device", "foo"],
         "unknown device"),
        (["torchvision.models.resnet18()", "4", "1", "normal", "HIGHS", "--time_limit", "0"],
         "--time_limit"),
        (["torchvision.models.resnet18()", "4", "1", "normal", "HIGHS", "--time_limit", "-5"],
         "--time_limit"),
        (["torchvision.models.resnet18()", "4", "1", "normal", "HIGHS", "--time_limit", "nan"],
         "--time_limit"),
        (["torchvision.models.resnet18()", "4", "1", "fast", "HIGHS"], "unknown mode"),
        (["torchvision.models.resnet18()", "4", "1", "normal", "CPLEX"], "unknown solver"),
        (["torchvision.models.resnet18()", "4", "1", "normal", "HIGHS", "--dtype", "int8"],
         "dtype"),
        (["torchvision.models.resnet18()", "4", "1", "normal", "HIGHS", "--input_shape", "3,a"],
         "input shape"),
        (["torchvision.models.resnet18()", "4", "1", "normal", "HIGHS", "--output",
          "/proc/monet_like/s.json"], "cannot write"),
        (["torchvision.models.resnet18(weights='IMAGENET1K_V1')", "4", "1", "normal", "HIGHS"],
         "download"),
        (["timm.resnet18(pretrained=True)", "4", "1", "normal", "HIGHS"], "download"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_in_one_line_before_any_work(argv, message, capsys, no_work):
    assert message in one_line_error(capsys, argv)


def test_an_output_under_a_file_is_refused(tmp_path, capsys, no_work):
    (tmp_path / "file").write_text("x")
    argv = [TINY, "2", "1", "normal", "HIGHS", "--input_shape", "3,16,16"]
    err = one_line_error(capsys, [*argv, "--output", str(tmp_path / "file" / "s.json")])
    assert "is a file" in err


def test_another_file_at_the_output_is_kept_without_force(tmp_path, capsys, no_work):
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    argv = [TINY, "2", "1", "normal", "HIGHS", "--input_shape", "3,16,16", "--output", str(other)]
    assert "--force" in one_line_error(capsys, argv)
    assert other.read_text() == '{"mine": 1}'


def test_default_names_tell_configurations_apart():
    from monet_like.cli import default_solution_name
    from monet_like.models import parse_model

    spec = parse_model("torchvision.models.resnet50()")
    monets = "solution_resnet50_184_normal_10.json"  # MONeT's name for the defaults
    assert default_solution_name(spec, 184, "normal", 10.0, input_shape=(3, 224, 224)) == monets
    names = {
        default_solution_name(spec, 184, "normal", 10.0, input_shape=(3, 64, 64)),
        default_solution_name(spec, 184, "normal", 10.0, input_shape=(3, 32, 32)),
        default_solution_name(spec, 184, "normal", 10.0, dtype="bfloat16"),
        default_solution_name(spec, 184, "normal", 10.0, full=True),
        default_solution_name(parse_model("torchvision.models.resnet50(num_classes=10)"),
                              184, "normal", 10.0),
        default_solution_name(spec, 184, "normal", 10.0, autocast="bfloat16"),
    }  # fmt: skip
    assert len(names) == 6


# -- solution files ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def schedule_file(tmp_path_factory):
    """A real schedule of a tiny UNet (solved once for the module)."""
    from monet_like.models import parse_model
    from monet_like.pipeline import compile_schedule

    torch.manual_seed(0)
    model = parse_model(TINY).build()
    path = tmp_path_factory.mktemp("faults") / "s.json"
    compile_schedule(
        model, (3, 16, 16), 2, budget_fraction=0.3, repeats=1, model_name=TINY, output=path
    )
    return model, path


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00binary", "binary"),
        (b"", "truncated"),
        (b'{"format_version": "4"}', "not an integer"),
        (b'{"format_version": null}', "not an integer"),
        (b"[" * 100000 + b"]" * 100000, "nested"),
        (b'{"format_version": 99}', "newer"),
        (b'{"format_version": 3}', "predates"),
        (b'{"hello": 1}', "not a monet_like solution file"),
    ],
)
def test_unreadable_files_are_refused_in_one_line(content, message, tmp_path):
    path = tmp_path / "s.json"
    path.write_bytes(content)
    with pytest.raises(SolutionFileError, match=message) as info:
        load(path)
    assert "\n" not in str(info.value)


def test_a_folder_is_not_a_solution_file(tmp_path):
    with pytest.raises(SolutionFileError, match="folder"):
        load(tmp_path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(dtype="float8"), "dtype"),
        (lambda d: d.update(batch=-2), "batch"),
        (lambda d: d.update(keep=d["keep"][:-1]), "keep decisions"),
        (lambda d: d["stages"][-1]["recompute"].append(-1), "recompute"),
        (lambda d: d["stages"][-1]["recompute"].append(10**6), "names unit"),
        (lambda d: d["stages"][0].update(ops="all"), "ops"),
        (lambda d: d.pop("units"), "missing"),
        (lambda d: d.update(budget_bytes=float("nan")), "budget_bytes"),
    ],
)
def test_malformed_decisions_are_refused_in_one_line(schedule_file, edit, message, tmp_path):
    _, path = schedule_file
    data = json.loads(path.read_text())
    edit(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(SolutionFileError, match=message) as info:
        load(bad)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("edit", ["drop_stage_op", "rotate_stage_ops", "no_recomputation"])
def test_edited_stages_are_refused_at_load(schedule_file, edit, tmp_path):
    """Dropped or rotated backward ops, or the recomputations removed (the schedule then
    holds what it dropped, above its budget): refused when the wrapper is built."""
    from monet_like.errors import UserError
    from monet_like.wrapper import ScheduleWrapper

    model, path = schedule_file
    data = json.loads(path.read_text())
    stages = data["stages"]
    if edit == "drop_stage_op":
        stages[len(stages) // 2]["ops"].pop()
    elif edit == "rotate_stage_ops":
        ops = [i for s in stages for i in s["ops"]]
        ops = ops[1:] + ops[:1]
        for s in stages:
            s["ops"], ops = ops[: len(s["ops"])], ops[len(s["ops"]) :]
    else:
        assert any(s["recompute"] for s in stages)
        for s in stages:
            s["recompute"] = []
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError) as info:
        ScheduleWrapper(model, bad, (3, 16, 16))
    assert "\n" not in str(info.value)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_corruptions_of_a_file_are_refused_or_replay_within_budget(
    schedule_file, data, tmp_path_factory
):
    """Random bytes changed, cut or inserted anywhere in a valid file: either one line of
    refusal, or a schedule that replays exactly within its budget."""
    from monet_like.errors import UserError
    from monet_like.verify import compare_with_eager, measured_peak
    from monet_like.wrapper import ScheduleWrapper

    model, path = schedule_file
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.integers(0, len(raw) - 1))
        how = data.draw(st.sampled_from(["set", "cut", "digit"]))
        if how == "set":
            raw[where] = data.draw(st.integers(0, 255))
        elif how == "cut":
            del raw[where : where + data.draw(st.integers(1, 50))]
        else:  # a digit changed keeps the JSON valid more often
            digits = [i for i, b in enumerate(raw) if chr(b).isdigit()]
            i = digits[where % len(digits)]
            raw[i] = ord(str(data.draw(st.integers(0, 9))))
    bad = tmp_path_factory.mktemp("corrupt") / "s.json"
    bad.write_bytes(bytes(raw))
    try:
        wrapped = ScheduleWrapper(model, bad, (3, 16, 16))
    except UserError as exc:
        assert "\n" not in str(exc)
        return
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    assert compare_with_eager(model, bad, (3, 16, 16), x).bitwise
    assert measured_peak(wrapped, x) <= wrapped.solution.budget_bytes


# -- writes --------------------------------------------------------------------------------


def test_writes_never_follow_a_planted_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "s.json"
    (tmp_path / "s.json.tmp").symlink_to(victim)  # the old fixed temporary name
    atomic_write(target, "{}")
    assert victim.read_text() == "precious" and target.read_text() == "{}"
    link = tmp_path / "link.json"
    link.symlink_to(victim)
    atomic_write(link, "{}")  # the link itself is replaced, not what it points to
    assert victim.read_text() == "precious" and not link.is_symlink()


def test_concurrent_writers_never_tear_a_file(tmp_path):
    target = tmp_path / "s.json"
    payloads = [json.dumps({"writer": k, "pad": "x" * 50000}) for k in range(4)]
    atomic_write(target, payloads[0])
    torn = []
    stop = threading.Event()

    def read():
        while not stop.is_set():
            text = target.read_text()
            if text not in payloads:
                torn.append(len(text))

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    writers = [
        threading.Thread(target=lambda p=p: [atomic_write(target, p) for _ in range(150)])
        for p in payloads
    ]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not torn
    assert not [p for p in tmp_path.iterdir() if p.name != "s.json"]  # no temporary left


# -- signals -------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _state(pid: int) -> str:
    """A process's state letter and name (/proc), or 'gone'."""
    try:
        name, rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
    except OSError:
        return "gone"
    return f"{rest.split()[0]} {name.split('(', 1)[1]}"


def _sigint_as_in_a_terminal() -> None:
    """SIGINT's default disposition, as a foreground job in a terminal has it. A shell
    starts a background job (`.ci/run &`) with SIGINT ignored, every process below
    inherits that, and solve.py, like any program, keeps it: the test then saw exit 0."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_signal_while_a_racer_forks_is_delivered_once_the_fork_is_over():
    """A stopping signal that comes while a racer is forked is held back and delivered
    after: inside the fork's handlers Python raised it where it is ignored (a SIGINT
    lost, and solve.py exited 0). Its own process, so that no test's handler moves."""
    code = (
        "import os, signal, time\n"
        "from monet_like.solver.race import signals_held\n"
        "order = []\n"
        "signal.signal(signal.SIGTERM, lambda *_: order.append('delivered'))\n"
        "with signals_held():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.2)\n"
        "    order.append('fork over')\n"
        "time.sleep(0.05)\n"
        "print(order)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['fork over', 'delivered']", r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_cbc_race_stops_every_process(sig, tmp_path):
    """CBC's searches race in forked processes: a signal to solve.py stops them all and
    writes nothing."""
    from monet_like.graph import capture
    from monet_like.models import parse_model
    from monet_like.profile import profile
    from monet_like.solver import DEFAULT_DEPTH, min_feasible_budget
    from monet_like.solver.problem import build_problem

    model = "torchvision.models.resnet50()"  # over 4,000 binaries: CBC races two searches
    # A budget just above the smallest feasible one (a hard search), both with
    # the profiled workspace (solve.py reads the profile cached here): below 64 px the
    # weight reorders' 70 MiB outweigh the activations, and a budget from the
    # activations alone was infeasible, so solve.py could exit before the race.
    torch.manual_seed(0)
    net = parse_model(model).build()
    graph = capture(net, (3, 64, 64), 8)
    problem = build_problem(graph, profile(net, graph, progress=False))
    low = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS")
    budget_gb = (low + 0.05 * (problem.store_all_peak_bytes - low)) / 2**30
    out = tmp_path / "s.json"
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    command = [
        sys.executable, str(ROOT / "solve.py"), model, "8", f"{budget_gb:.6f}", "normal",
        "CBC", "--input_shape", "3,64,64", "--output", str(out), "--time_limit", "300",
    ]  # fmt: skip
    # The signal goes while the racers run; a solve that finished first is run again.
    for _attempt in range(2):
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            preexec_fn=_sigint_as_in_a_terminal,
        )  # fmt: skip
        kids = []
        deadline = time.time() + 900
        while time.time() < deadline and proc.poll() is None and len(kids) < 2:
            time.sleep(0.1)
            kids = _children(proc.pid)  # two: the racing searches
        assert len(kids) >= 2 or proc.poll() is not None, "no race started in 900 s"
        if proc.poll() is None and all(Path(f"/proc/{k}").exists() for k in kids):
            proc.send_signal(sig)
            break
        proc.communicate()
        out.unlink(missing_ok=True)
    else:
        pytest.fail("twice solve.py finished before a signal could reach its race")
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # say where it hangs: solve.py dumps its stack on USR1
        states = {k: _state(k) for k in _children(proc.pid)}
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"solve.py still running 120 s after the signal; children {states}\n{err}")
    assert proc.returncode in (130, 143), (
        f"{sig.name} sent while racing, exit {proc.returncode}: {err}"
    )
    assert "nothing written" in err and not out.exists()
    time.sleep(1)
    assert not [k for k in kids if Path(f"/proc/{k}").exists()], "a racer was left running"
