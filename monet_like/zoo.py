"""The solution zoo: ready schedules, listed in an index, checked and downloadable.

    solutions/index.json      one entry per schedule (name, model, batch, input shape,
                              dtype, mode, budget, predicted peak and overhead, solver,
                              status, gap, device and torch version, fingerprint,
                              sha256, size)
    solutions/NAME.json       the schedules, MONeT's names:
                              solution_resnet50_184_inplace_conv_multiway_newnode_10.json
    solutions/profiles/       the profiles they were solved from (another budget of a
                              zoo model is then solved without profiling)

`python -m monet_like zoo list|verify|download` is the command line;
`ScheduleWrapper(model, "zoo:NAME", input_shape)` resolves a name (the local copy, else
one downloaded into the cache, checked against the index's sha256).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from monet_like.errors import UserError
from monet_like.files import atomic_write

ZOO_DIR = Path(__file__).resolve().parent.parent / "solutions"
INDEX = "index.json"
URL_VARIABLE = "MONET_LIKE_ZOO_URL"
PREFIX = "zoo:"
INDEX_VERSION = 1


def _folder(folder: Path | None) -> Path:
    """`folder`, or the zoo's own (read when called, so that it can be pointed elsewhere)."""
    return Path(ZOO_DIR if folder is None else folder)


class ZooError(UserError):
    """A zoo entry that cannot be used: unknown, missing, altered, or not downloadable."""


@dataclass(frozen=True)
class ZooEntry:
    name: str  # the file's name without ".json"
    model: str  # model expression
    batch: int
    input_shape: tuple[int, ...]
    dtype: str
    mode: str
    budget_gb: float
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_overhead: float  # predicted step time over the store-all step's, minus one
    store_all_peak_bytes: int
    solver: str
    status: str
    gap: float | None
    formulation: str
    device: str  # the device its profile was taken on
    torch_version: str  # the torch it was captured with
    fingerprint: str
    sha256: str
    size: int
    profiles: tuple[str, ...] = ()  # files under profiles/ it was solved from
    step_gap: float | None = None  # the gap as a share of the predicted step

    @property
    def file(self) -> str:
        return f"{self.name}.json"


def entry_name(model_name: str, batch: int, mode: str, budget_gb: float) -> str:
    """MONeT's name of a schedule: solution_<model>_<batch>_<mode>_<budget>."""
    return f"solution_{model_name}_{batch}_{mode}_{budget_gb:g}"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_index(folder: Path | None = None) -> list[ZooEntry]:
    """The entries of `folder`'s index (none where it has no index)."""
    folder = _folder(folder)
    path = Path(folder) / INDEX
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        return [
            ZooEntry(
                **{
                    **e,
                    "input_shape": tuple(e["input_shape"]),
                    "profiles": tuple(e.get("profiles", ())),
                }
            )
            for e in data["entries"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise ZooError(f"{path}: not a zoo index ({exc})") from None


def load_infeasible(folder: Path | None = None) -> list[dict]:
    """The configurations the builder found infeasible: name, model, batch, mode,
    budget_gb, min_feasible_budget_bytes, torch_version."""
    folder = _folder(folder)
    path = Path(folder) / INDEX
    if not path.exists():
        return []
    return list(json.loads(path.read_text()).get("infeasible", []))


def write_index(
    entries: list[ZooEntry], folder: Path | None = None, infeasible: list[dict] | None = None
) -> Path:
    folder = _folder(folder)
    entries = sorted(entries, key=lambda e: (e.model, e.batch, e.mode, -e.budget_gb))
    data = {
        "version": INDEX_VERSION,
        "entries": [asdict(e) for e in entries],
        "infeasible": sorted(infeasible or [], key=lambda r: r["name"]),
    }
    return atomic_write(Path(folder) / INDEX, json.dumps(data, indent=1) + "\n")


def find(name: str, folder: Path | None = None) -> ZooEntry:
    folder = _folder(folder)
    name = name.removeprefix(PREFIX).removesuffix(".json")
    for e in load_index(folder):
        if e.name == name:
            return e
    raise ZooError(f"no zoo entry named {name!r}: `python -m monet_like zoo list` lists them")


def lookup(
    model: str,
    batch: int,
    input_shape: tuple[int, ...],
    dtype: str,
    mode: str,
    budget_bytes: int,
    folder: Path | None = None,
) -> ZooEntry | None:
    """The entry solved for exactly this configuration, if the zoo has one."""
    folder = _folder(folder)
    for e in load_index(folder):
        if (
            e.model == model
            and e.batch == batch
            and tuple(e.input_shape) == tuple(input_shape)
            and e.dtype == dtype
            and e.mode == mode
            and e.budget_bytes == budget_bytes
        ):
            return e
    return None


def entry_for(
    solution_path: Path, name: str, budget_gb: float, profiles: tuple[str, ...] = ()
) -> ZooEntry:
    """The index entry of the schedule at `solution_path` (a file named `name`.json)."""
    import torch

    from monet_like.solution import load

    sol = load(solution_path)
    return ZooEntry(
        name=name,
        model=sol.model,
        batch=sol.batch,
        input_shape=tuple(sol.input_shape),
        dtype=sol.dtype,
        mode=sol.mode,
        budget_gb=budget_gb,
        budget_bytes=sol.budget_bytes,
        predicted_peak_bytes=sol.predicted_peak_bytes,
        predicted_overhead=sol.overhead,
        store_all_peak_bytes=sol.store_all_peak_bytes,
        solver=sol.solver,
        status=sol.status,
        gap=sol.gap,
        step_gap=sol.step_gap,
        formulation=sol.formulation,
        device=sol.device,
        torch_version=torch.__version__,
        fingerprint=sol.fingerprint,
        sha256=sha256_of(solution_path),
        size=Path(solution_path).stat().st_size,
        profiles=tuple(profiles),
    )


def verify(folder: Path | None = None) -> list[str]:
    """Every entry's file present, of the index's size and sha256, and loadable as a
    schedule of the index's configuration: one line per problem found (none: all good)."""
    folder = _folder(folder)
    from monet_like.solution import SolutionFileError, load

    problems = []
    for e in load_index(folder):
        path = folder / e.file
        if not path.exists():
            problems.append(f"{e.name}: missing")
            continue
        if path.stat().st_size != e.size or sha256_of(path) != e.sha256:
            problems.append(f"{e.name}: its sha256 differs from the index's (altered?)")
            continue
        try:
            sol = load(path)
        except SolutionFileError as exc:
            problems.append(f"{e.name}: {exc}")
            continue
        if (sol.model, sol.batch, sol.mode, sol.fingerprint) != (
            e.model,
            e.batch,
            e.mode,
            e.fingerprint,
        ):
            problems.append(f"{e.name}: its schedule is not the index's configuration")
        for profile in e.profiles:
            if not (folder / "profiles" / profile).exists():
                problems.append(f"{e.name}: its profile {profile} is missing")
    return problems


def cache_folder() -> Path:
    """Where downloaded schedules go: the profile cache's folder, `zoo/` under it."""
    from monet_like.files import cache_dir

    return cache_dir() / "zoo"


def base_url(url: str | None = None) -> str:
    url = url or os.environ.get(URL_VARIABLE)
    if not url:
        raise ZooError(
            f"no mirror to download from: give --url or set {URL_VARIABLE} to the address of"
            " a copy of the solutions/ folder"
        )
    return url.rstrip("/")


def download(
    entry: ZooEntry,
    url: str | None = None,
    dest: Path | None = None,
    retries: int = 3,
    timeout: float = 30.0,
    progress: bool | None = None,
) -> Path:
    """Fetch `entry`'s schedule from the mirror at `url` into `dest`: streamed to a
    temporary file in `dest`, its size and sha256 checked against the index, then renamed
    into place. A failure (404, altered file, cut connection, no network) leaves nothing
    behind and raises ZooError with one line; connection faults are retried."""
    from tqdm import tqdm

    dest = Path(dest) if dest is not None else cache_folder()
    dest.mkdir(parents=True, exist_ok=True)
    address = f"{base_url(url)}/{entry.file}"
    target = dest / entry.file
    last = ""
    for attempt in range(retries):
        fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{entry.file}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(address, timeout=timeout) as r:
                h = hashlib.sha256()
                got = 0
                bar = tqdm(
                    total=entry.size, unit="B", unit_scale=True, desc=entry.name,
                    disable=None if progress is None else not progress,  # None: a terminal's
                )  # fmt: skip
                with bar:
                    while block := r.read(1 << 16):
                        out.write(block)
                        h.update(block)
                        got += len(block)
                        bar.update(len(block))
                out.flush()
                os.fsync(out.fileno())
            if got < entry.size:
                raise ConnectionError(f"the connection ended after {got} of {entry.size} bytes")
            if got > entry.size or h.hexdigest() != entry.sha256:
                raise ZooError(
                    f"{address}: its size or sha256 is not the index's: the mirror's copy was"
                    " altered; nothing was kept"
                )
            os.replace(tmp, target)
            return target
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise ZooError(f"{address}: not on the mirror (404)") from None
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError, ConnectionError) as exc:
            last = str(getattr(exc, "reason", exc))
        finally:  # whatever happened, no partial file stays (after the rename: none is left)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if attempt + 1 < retries:
            time.sleep(min(2.0**attempt, 5.0))
    raise ZooError(f"{address}: download failed after {retries} tries ({last}); nothing kept")


def resolve(name: str, url: str | None = None, folder: Path | None = None) -> Path:
    """The local file of zoo entry `name` ("zoo:NAME" or "NAME"): the copy in `folder` if
    it matches the index, else one in the cache, else downloaded into the cache."""
    folder = _folder(folder)
    entry = find(name, folder)
    for candidate in (folder / entry.file, cache_folder() / entry.file):
        if candidate.exists() and candidate.stat().st_size == entry.size:
            if sha256_of(candidate) == entry.sha256:
                return candidate
    return download(entry, url)


# -- tables -----------------------------------------------------------------------------


def _gap(e: ZooEntry) -> str:
    """A table cell's note on a schedule not proved: its gap, of the step where known."""
    if e.status in ("optimal", "store-all"):
        return ""
    if e.gap is None:
        return ", no bound"
    if e.step_gap is None:
        return f", gap {e.gap:.1%} of the recomputation"
    return f", gap {e.step_gap:.2%}"


def tables(
    entries: list[ZooEntry], infeasible: list[dict] = (), published: dict | None = None
) -> str:
    """MONeT's results tables from the index: per model, one row per mode, one column
    per budget, each cell the predicted overhead over the store-all step and the
    predicted peak (GB); markdown. `published`: model expression -> (label, {budget GB:
    cell}), a row of reference figures under the model's rows."""
    from monet_like.units import GIB

    out = []
    too_low = {(r["model"], r["batch"], r["mode"], r["budget_gb"]) for r in infeasible}
    by_model: dict[tuple, list[ZooEntry]] = {}
    for e in entries:
        by_model.setdefault((e.model, e.batch, tuple(e.input_shape)), []).append(e)
    for (model, batch, shape), group in sorted(by_model.items()):
        budgets = {e.budget_gb for e in group}
        budgets |= {b for (m, n, _, b) in too_low if (m, n) == (model, batch)}
        budgets = sorted(budgets, reverse=True)
        out.append(
            f"**{model}**, batch {batch}, input {'x'.join(map(str, shape))}, {group[0].dtype},"
            f" profiled on {group[0].device}\n"
        )
        out.append("| mode | store-all | " + " | ".join(f"{b:g} GB" for b in budgets) + " |")
        out.append("|---|---|" + "---|" * len(budgets))
        for mode in sorted({e.mode for e in group}, key=lambda m: (m != "normal", m)):
            mine = [x for x in group if x.mode == mode]
            cells = [f"{max(x.store_all_peak_bytes for x in mine) / GIB:.2f} GB"]
            for b in budgets:
                e = next((x for x in mine if x.budget_gb == b), None)
                if e is None:
                    cells.append("infeasible" if (model, batch, mode, b) in too_low else "-")
                    continue
                cells.append(
                    f"{e.predicted_overhead:+.2%} ({e.predicted_peak_bytes / GIB:.2f}){_gap(e)}"
                )
            out.append(f"| {mode} | " + " | ".join(cells) + " |")
        if published and model in published:
            label, cells = published[model]
            row = [cells.get("store-all", "")] + [cells.get(b, "") for b in budgets]
            out.append(f"| {label} | " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


README_TABLE = ("<!-- zoo table: made by scripts/build_zoo.py -->", "<!-- /zoo table -->")


def with_readme_table(readme: str, table: str) -> str:
    """`readme` with the text between README_TABLE's markers replaced by `table`."""
    start, end = README_TABLE
    if start not in readme or end not in readme:
        raise ValueError(f"the README has no {start} ... {end} block")
    head, rest = readme.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{table.rstrip()}\n{end}{tail}"


# MONeT's published results (P100, measured step time over PyTorch's; the paper's
# table), under each model's rows for reference: ours are predicted on this machine.
MONET = "MONeT, P100 (paper)"
# store-all, then 10 to 5 GB (VGG-16's peaks are MONeT's own, in brackets)
PUBLISHED = {
    "torchvision.models.resnet50()": "15.06 GB|+3.22%|+4.68%|+5.56%|+7.28%|+9.31%|+11.95%",
    "torchvision.models.googlenet()": "14.93 GB|+7.13%|+7.87%|+8.44%|+9.71%|+12.14%|+15.77%",
    "unet": "14.32 GB|-4.10%|-2.07%|-0.09%|+1.39%|+4.95%|+11.51%",
    "torchvision.models.mobilenet_v2()": "14.46 GB|+2.40%|+3.10%|+4.77%|+5.53%|+7.55%|+8.72%",
    "torchvision.models.vgg16()": "14.12 GB|-5.30% (9.71)|-4.64% (8.66)|-2.18% (7.88)"
    "|+1.99% (6.82)|+5.44% (5.90)|+9.11% (5.51)",
}


# MONeT's five configurations: name -> (model expression, batch, one sample's input shape)
MONET_CONFIGS = {
    "resnet50": ("torchvision.models.resnet50()", 184, (3, 224, 224)),
    "googlenet": ("torchvision.models.googlenet()", 320, (3, 224, 224)),
    "unet": ("unet", 11, (3, 416, 608)),
    "mobilenet_v2": ("torchvision.models.mobilenet_v2()", 272, (3, 224, 224)),
    "vgg16": ("torchvision.models.vgg16()", 176, (3, 224, 224)),
}


def published_points(model: str, batch: int, input_shape: tuple[int, ...]) -> list[tuple]:
    """MONeT's published (peak GB, overhead) at 10 to 5 GB and its PyTorch peak, where
    `model` at `batch` and `input_shape` is one of its five configurations; else [].

    Returns:
        [(peak_gb, overhead, pytorch_peak_gb)] in budget order.
    """
    config = next(
        (c for c in MONET_CONFIGS.values() if c == (model, batch, tuple(input_shape))), None
    )
    if config is None:
        return []
    store_all, *cells = PUBLISHED[model].split("|")
    pytorch = float(store_all.split()[0])
    found = []
    for budget, cell in zip((10.0, 9.0, 8.0, 7.0, 6.0, 5.0), cells, strict=True):
        overhead, _, peak = cell.partition(" (")
        gb = float(peak.rstrip(")")) if peak else budget
        found.append((gb, float(overhead.rstrip("%")) / 100, pytorch))
    return found


def published_rows() -> dict:
    rows = {}
    for model, text in PUBLISHED.items():
        store_all, *cells = text.split("|")
        budgets = (10.0, 9.0, 8.0, 7.0, 6.0, 5.0)
        rows[model] = (MONET, {"store-all": store_all, **dict(zip(budgets, cells, strict=True))})
    return rows


def readme_table(folder: Path | None = None) -> str:
    """The README's zoo table: the index's tables with MONeT's published rows."""
    return tables(load_index(folder), load_infeasible(folder), published_rows())
