"""The solution zoo: the shipped index checked, a zoo built, listed, verified, served
over loopback HTTP and downloaded (tampered, cut and missing files refused), used by
name in ScheduleWrapper and by solve.py."""

from __future__ import annotations

import http.server
import json
import shutil
import threading
from functools import partial

import pytest
import torch

from monet_like import zoo
from monet_like.cli import main as monet_main
from monet_like.cli import solve_main
from monet_like.models import parse_model
from monet_like.pipeline import compile_schedule
from monet_like.schedule import build, check_budget
from monet_like.solution import load
from monet_like.wrapper import ScheduleWrapper, solution_graph

TINY = "monet_like.models.unet:UNet(base=2, depth=1)"
SHAPE = (3, 16, 16)


# -- the shipped zoo --------------------------------------------------------------------


MONETS = {  # MONeT's five configurations: model expression -> (batch, input shape)
    "torchvision.models.resnet50()": (184, (3, 224, 224)),
    "torchvision.models.googlenet()": (320, (3, 224, 224)),
    "unet": (11, (3, 416, 608)),
    "torchvision.models.mobilenet_v2()": (272, (3, 224, 224)),
    "torchvision.models.vgg16()": (176, (3, 224, 224)),
}


def test_the_shipped_zoo_is_monets_configurations_and_verifies():
    """Every entry is one of MONeT's configurations, within its budget, and its file
    verifies; the headline model (ResNet-50 at 184) is there in both modes at every
    budget from 10 to 5 GB."""
    entries = zoo.load_index()
    for e in entries:
        assert MONETS.get(e.model) == (e.batch, tuple(e.input_shape)), e.name
        assert e.predicted_peak_bytes <= e.budget_bytes
        assert e.status in ("optimal", "feasible", "store-all")
    assert zoo.verify() == []
    headline = {
        (e.mode, e.budget_gb) for e in entries if e.model == "torchvision.models.resnet50()"
    }
    for mode in ("normal", "inplace_conv_multiway_newnode"):
        assert {b for m, b in headline if m == mode} == {10.0, 9.0, 8.0, 7.0, 6.0, 5.0}, mode


def test_a_schedule_not_proved_shows_its_gap_of_the_step():
    """The index keeps each entry's gap of the step (its file's), which the tables show
    where the solve stopped short of its tolerance; an index written before it had the
    field shows the recomputation's, named so."""
    from dataclasses import replace

    entries = zoo.load_index()
    for e in entries:
        sol = load(zoo.ZOO_DIR / e.file)
        assert e.step_gap == sol.step_gap and e.gap == sol.gap, e.name
    e = next(e for e in entries if e.status == "feasible" and e.step_gap is not None)
    cell = f"({e.predicted_peak_bytes / 2**30:.2f}), gap {e.step_gap:.2%} |"
    assert cell in zoo.tables([e])
    old = replace(e, step_gap=None)
    assert f"gap {e.gap:.1%} of the recomputation |" in zoo.tables([old])
    assert "gap" not in zoo.tables([replace(e, status="optimal")])


def test_the_readmes_zoo_table_is_the_index():
    from pathlib import Path

    readme = (Path(zoo.__file__).resolve().parents[1] / "README.md").read_text()
    assert zoo.with_readme_table(readme, zoo.readme_table()) == readme
    assert "solution" not in zoo.readme_table() and "| normal |" in readme


@pytest.mark.parametrize("which", [0, -1])
def test_a_shipped_entry_simulates_within_its_budget(which):
    """Re-simulated on fake tensors at its full batch (nothing allocated)."""
    entries = sorted(zoo.load_index(), key=lambda e: (e.model, e.mode, e.budget_gb))
    entry = entries[which]
    sol = load(zoo.ZOO_DIR / entry.file)
    graph = solution_graph(parse_model(entry.model).build("meta"), sol, "cpu")
    assert graph.fingerprint == entry.fingerprint
    peak = check_budget(graph, build(graph, sol), sol)
    assert peak == entry.predicted_peak_bytes <= entry.budget_bytes


# -- a zoo of our own ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory):
    """Two schedules of a tiny UNet, indexed as the builder indexes them."""
    folder = tmp_path_factory.mktemp("zoo")
    torch.manual_seed(0)
    model = parse_model(TINY).build()
    entries = []
    for fraction in (1.0, 0.3):
        compiled = compile_schedule(
            model, SHAPE, 2, budget_fraction=fraction, repeats=1, model_name=TINY,
            output=folder / "tmp.json",
        )  # fmt: skip
        budget_gb = compiled.solution.budget_bytes / 2**30
        name = zoo.entry_name("unet_tiny", 2, "normal", budget_gb)
        shutil.move(folder / "tmp.json", folder / f"{name}.json")
        entries.append(zoo.entry_for(folder / f"{name}.json", name, budget_gb))
    zoo.write_index(entries, folder)
    return folder, entries, model


@pytest.fixture
def served(tiny_zoo, tmp_path):
    """A copy of the zoo served over loopback HTTP; yields (url, served folder)."""
    folder, _, _ = tiny_zoo
    mirror = tmp_path / "mirror"
    shutil.copytree(folder, mirror)
    handler = partial(_QuietHandler, directory=str(mirror))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", mirror
    server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    cut_after: int | None = None  # bytes sent before the connection is dropped

    def log_message(self, *args):
        pass

    def copyfile(self, source, outputfile):
        if self.cut_after is None:
            return super().copyfile(source, outputfile)
        outputfile.write(source.read(self.cut_after))
        self.close_connection = True


def test_list_and_verify(tiny_zoo, monkeypatch, capsys):
    folder, entries, _ = tiny_zoo
    monkeypatch.setattr(zoo, "ZOO_DIR", folder)
    assert monet_main(["zoo", "list"]) == 0
    out = capsys.readouterr().out
    assert TINY in out and "| normal |" in out
    assert monet_main(["zoo", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["entries"]
    assert {e["name"] for e in listed} == {e.name for e in entries}
    assert monet_main(["zoo", "verify"]) == 0


def test_verify_finds_a_tampered_file(tiny_zoo, tmp_path, monkeypatch, capsys):
    folder, entries, _ = tiny_zoo
    copy = tmp_path / "zoo"
    shutil.copytree(folder, copy)
    tampered = entries[1]  # the schedule that recomputes
    data = json.loads((copy / tampered.file).read_text())
    stage = next(s for s in data["stages"] if s["recompute"])
    stage["recompute"] = []  # an edit that keeps the file loadable
    (copy / tampered.file).write_text(json.dumps(data))
    assert zoo.verify(copy) == [f"{tampered.name}: its sha256 differs from the index's (altered?)"]
    monkeypatch.setattr(zoo, "ZOO_DIR", copy)
    assert monet_main(["zoo", "verify"]) == 1


def test_download_checks_the_sha256_before_keeping_anything(served, tiny_zoo, tmp_path):
    url, mirror = served
    _, entries, _ = tiny_zoo
    dest = tmp_path / "got"
    path = zoo.download(entries[1], url, dest, progress=False)
    assert zoo.sha256_of(path) == entries[1].sha256
    (mirror / entries[0].file).write_text((mirror / entries[0].file).read_text() + " ")
    with pytest.raises(zoo.ZooError, match="altered") as info:
        zoo.download(entries[0], url, dest, retries=1, progress=False)
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in dest.iterdir()) == [entries[1].file]  # nothing else left


def test_a_missing_file_a_cut_connection_and_no_network(served, tiny_zoo, tmp_path, monkeypatch):
    url, mirror = served
    _, entries, _ = tiny_zoo
    dest = tmp_path / "got"
    (mirror / entries[0].file).unlink()
    with pytest.raises(zoo.ZooError, match="404"):
        zoo.download(entries[0], url, dest, progress=False)
    monkeypatch.setattr(_QuietHandler, "cut_after", entries[1].size // 2)
    with pytest.raises(zoo.ZooError, match="after 2 tries"):
        zoo.download(entries[1], url, dest, retries=2, timeout=5, progress=False)
    with pytest.raises(zoo.ZooError, match="download failed"):
        zoo.download(entries[1], "http://127.0.0.1:9", dest, retries=1, progress=False)
    assert not dest.exists() or not list(dest.iterdir())


def test_a_wrapper_takes_a_zoo_name_local_or_downloaded(served, tiny_zoo, tmp_path, monkeypatch):
    from monet_like.verify import compare_with_eager

    url, _ = served
    folder, entries, model = tiny_zoo
    monkeypatch.setattr(zoo, "ZOO_DIR", folder)
    wrapped = ScheduleWrapper(model, f"zoo:{entries[1].name}", SHAPE)
    assert wrapped.solution.fingerprint == entries[1].fingerprint
    # not in the local folder: fetched from the mirror into the cache, then used
    empty = tmp_path / "empty"
    empty.mkdir()
    zoo.write_index(entries, empty)
    monkeypatch.setattr(zoo, "ZOO_DIR", empty)
    monkeypatch.setenv(zoo.URL_VARIABLE, url)
    monkeypatch.setenv("MONET_LIKE_CACHE", str(tmp_path / "cache"))
    path = zoo.resolve(entries[1].name)
    assert path.parent == tmp_path / "cache" / "zoo"
    x = torch.randn(2, *SHAPE)
    assert compare_with_eager(model, path, SHAPE, x).bitwise


def test_solve_takes_the_zoos_schedule_and_no_zoo_solves(tiny_zoo, tmp_path, monkeypatch, capsys):
    folder, entries, _ = tiny_zoo
    monkeypatch.setattr(zoo, "ZOO_DIR", folder)
    entry = entries[1]
    argv = [TINY, "2", f"{entry.budget_gb!r}", "normal", "CBC", "--input_shape", "3,16,16"]
    out = tmp_path / "mine.json"
    assert solve_main([*argv, "--output", str(out), "--json"]) == 0
    text = capsys.readouterr().out
    assert "from the zoo" in text and json.loads(text.splitlines()[-1])["from_zoo"] == entry.name
    assert zoo.sha256_of(out) == entry.sha256
    assert solve_main([*argv, "--output", str(tmp_path / "solved.json"), "--no_zoo"]) == 0
    assert "from the zoo" not in capsys.readouterr().out
    assert load(tmp_path / "solved.json").solver == "CBC"
