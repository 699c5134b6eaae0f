"""The solution file: a schedule as versioned plain data (JSON), loaded without running code.

It carries everything needed to refuse a wrong replay: the fingerprint of the graph
it was solved for, the model expression, batch, input shape, dtype, the device of
its profile, the mode, the budget and the library version.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from monet_like._version import __version__
from monet_like.errors import UserError
from monet_like.files import atomic_write

FORMAT_VERSION = 4  # 2: variants_off; 3: algorithms; 4: outputs_held, workspace


def _torch_version() -> str:
    import torch  # the solver's process has it loaded; plain readers of files need not

    return torch.__version__


class SolutionFileError(UserError):
    """A solution file that cannot be used: corrupt, truncated, edited, or of another
    format. Its message is one line that says what is wrong and what to do."""


@dataclass
class Solution:
    model: str
    fingerprint: str
    batch: int
    input_shape: tuple[int, ...]
    dtype: str
    device: str
    mode: str
    budget_bytes: int
    formulation: str  # "compact" or "full" (or "store-all" when no solve was needed)
    depth: int | None
    solver: str
    # "optimal" (proved within the tolerance: 0.1% of the step by default), "feasible"
    # (stopped by the time limit short of it), "store-all"
    status: str
    objective_s: float  # recomputation time added to one step
    bound_s: float | None
    gap: float | None  # of the recomputation (`step_gap`: of the step); None: no bound
    solve_time_s: float
    predicted_peak_bytes: int
    predicted_peak_at: str
    predicted_time_s: float
    # eager's step (the captured graph, nothing recomputed), also where the schedule runs
    # on a graph with variants: what `overhead` is relative to
    store_all_peak_bytes: int
    store_all_time_s: float
    fixed_bytes: int
    ablation: bool
    stats: dict
    keep: list[bool]  # per unit: kept after the forward pass
    units: list[list[int]]  # per unit: its graph nodes
    stages: list[dict]  # per backward stage: {"unit", "ops", "recompute": [unit ids]}
    input_grad: bool = False  # the schedule also computes the input's gradient
    # the budget counts the model's outputs until the backward pass ends (the usual
    # loop); False: the loop drops them before backward
    outputs_held: bool = True
    autocast: str | None = None  # the forward pass runs under torch.autocast in this dtype
    # The mode's variant flags rewritten into the graph it runs on (none when the
    # captured graph's own schedule was faster), and the sites of those the solver
    # turned off (their replaced aten op runs instead).
    variants: list[str] | None = None
    variants_off: list[str] = field(default_factory=list)
    # BatchNorms (fx names) output-activated BatchNorm is not rewritten into: their gamma
    # was zero when solved (see Graph.plain_batch_norms)
    plain_batch_norms: list[str] = field(default_factory=list)
    # conv mode: convolution site -> [forward, backward-data, backward-weight] algorithms,
    # for those not left to PyTorch (-1)
    algorithms: dict[str, list[int]] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    library_version: str = __version__
    # the torch the step was captured under ("" in files that predate the field): graphs,
    # hence fingerprints, can differ between torch versions (a view op renamed)
    torch_version: str = field(default_factory=_torch_version)
    # bytes of scratch each op takes while it runs (op name -> bytes), from the profile:
    # what the budget is re-checked with when the file is loaded
    workspace: dict[str, int] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def overhead(self) -> float:
        """Predicted step time relative to eager's store-all step, minus one."""
        return self.predicted_time_s / self.store_all_time_s - 1 if self.store_all_time_s else 0.0

    @property
    def step_gap(self) -> float | None:
        """The gap as a share of the predicted step (what the solvers' tolerance is on):
        how much faster than this schedule's step an optimal one may be."""
        if self.gap is None or not self.predicted_time_s:
            return None
        return self.gap * self.objective_s / self.predicted_time_s

    def summary(self) -> dict:
        d = asdict(self)
        for key in ("keep", "units", "stages", "variants_off", "plain_batch_norms", "algorithms"):
            d.pop(key)
        return d

    def save(self, path: str | os.PathLike) -> Path:
        """Write the file atomically (see `files.atomic_write`)."""
        return atomic_write(path, json.dumps(asdict(self)))


DTYPES = ("float32", "float16", "bfloat16", "float64")
_MAX_BYTES = 256 * 2**20  # larger than any schedule: a file this big is not one


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and v == v  # not NaN


def _int_list(v, low: int = 0) -> bool:
    return isinstance(v, list) and all(_is_int(i) and i >= low for i in v)


# field -> (what it must be, check)
_CHECKS = {
    "model": ("a string", lambda v: isinstance(v, str)),
    "fingerprint": ("a string", lambda v: isinstance(v, str)),
    "batch": ("a positive integer", lambda v: _is_int(v) and v >= 1),
    "input_shape": ("a list of positive integers", lambda v: _int_list(v, 1) and len(v) > 0),
    "dtype": (f"one of {', '.join(DTYPES)}", lambda v: v in DTYPES),
    "device": ("a device name", lambda v: isinstance(v, str)),
    "mode": ("a string", lambda v: isinstance(v, str)),
    "budget_bytes": ("a positive integer", lambda v: _is_int(v) and v >= 1),
    "formulation": ("a string", lambda v: isinstance(v, str)),
    "depth": ("an integer or null", lambda v: v is None or _is_int(v)),
    "solver": ("a string", lambda v: isinstance(v, str)),
    "status": ("a string", lambda v: isinstance(v, str)),
    "objective_s": ("a number", _is_number),
    "bound_s": ("a number or null", lambda v: v is None or _is_number(v)),
    "gap": ("a number or null", lambda v: v is None or _is_number(v)),
    "solve_time_s": ("a number", _is_number),
    "predicted_peak_bytes": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "predicted_peak_at": ("a string", lambda v: isinstance(v, str)),
    "predicted_time_s": ("a number", _is_number),
    "store_all_peak_bytes": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "store_all_time_s": ("a number", _is_number),
    "fixed_bytes": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "ablation": ("true or false", lambda v: isinstance(v, bool)),
    "stats": ("an object", lambda v: isinstance(v, dict)),
    "keep": (
        "a list of true/false",
        lambda v: isinstance(v, list) and all(isinstance(b, bool) for b in v),
    ),
    "units": (
        "a list of lists of node ids",
        lambda v: isinstance(v, list) and all(_int_list(u) for u in v),
    ),
    "stages": ("a list of stages", lambda v: isinstance(v, list)),
    "input_grad": ("true or false", lambda v: isinstance(v, bool)),
    "outputs_held": ("true or false", lambda v: isinstance(v, bool)),
    "autocast": ("null, bfloat16 or float16", lambda v: v in (None, "bfloat16", "float16")),
    "variants": (
        "a list of variant flags or null",
        lambda v: v is None or (isinstance(v, list) and all(isinstance(f, str) for f in v)),
    ),
    "variants_off": (
        "a list of site names",
        lambda v: isinstance(v, list) and all(isinstance(f, str) for f in v),
    ),
    "plain_batch_norms": (
        "a list of node names",
        lambda v: isinstance(v, list) and all(isinstance(f, str) for f in v),
    ),
    "algorithms": (
        "an object of site -> three algorithm ids",
        lambda v: (
            isinstance(v, dict)
            and all(
                isinstance(a, list) and len(a) == 3 and all(_is_int(i) for i in a)
                for a in v.values()
            )
        ),
    ),
    "format_version": ("an integer", _is_int),
    "library_version": ("a string", lambda v: isinstance(v, str)),
    "torch_version": ("a string", lambda v: isinstance(v, str)),
    "workspace": (
        "an object of op -> bytes",
        lambda v: isinstance(v, dict) and all(_is_int(b) and b >= 0 for b in v.values()),
    ),
    "extra": ("an object", lambda v: isinstance(v, dict)),
}


def _check_stages(stages: list, n_units: int) -> str | None:
    """Why the stages are malformed (one line), or None."""
    for t, stage in enumerate(stages):
        if not isinstance(stage, dict):
            return f"stage {t} is not an object"
        for key in ("ops", "recompute"):
            if not _int_list(stage.get(key)):
                return f"stage {t}: {key!r} must be a list of non-negative integers"
        if "candidates" in stage and not _int_list(stage["candidates"]):
            return f"stage {t}: 'candidates' must be a list of non-negative integers"
        unit = stage.get("unit")
        if unit is not None and not (_is_int(unit) and 0 <= unit < n_units):
            return f"stage {t}: unit {unit!r} is not one of the {n_units} units"
        for key in ("recompute", "candidates"):
            bad = [u for u in stage.get(key, ()) if u >= n_units]
            if bad:
                return f"stage {t} names unit {bad[0]} in {key!r}; there are {n_units} units"
        if len(set(stage["recompute"])) != len(stage["recompute"]):
            return f"stage {t} recomputes a unit twice"
    return None


def from_dict(data, where: str = "solution") -> Solution:
    """A Solution from plain data, every field checked; SolutionFileError otherwise."""
    if not isinstance(data, dict) or "format_version" not in data:
        raise SolutionFileError(f"{where}: not a monet_like solution file")
    version = data["format_version"]
    if not _is_int(version):
        raise SolutionFileError(f"{where}: format_version {version!r} is not an integer")
    if version > FORMAT_VERSION:
        raise SolutionFileError(
            f"{where}: format version {version} is newer than this monet_like "
            f"reads ({FORMAT_VERSION}, library {__version__}): upgrade monet_like"
        )
    if version < FORMAT_VERSION:
        raise SolutionFileError(
            f"{where}: format version {version} predates the budget that counts the "
            "model's outputs through the backward pass: solve again"
        )
    names = {f.name for f in fields(Solution)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SolutionFileError(f"{where}: unknown field {unknown[0]!r}: not a schedule file")
    required = {f.name for f in fields(Solution) if f.default is f.default_factory is MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise SolutionFileError(f"{where}: field {missing[0]!r} is missing: solve again")
    for name, value in data.items():
        what, ok = _CHECKS[name]
        if not ok(value):
            raise SolutionFileError(f"{where}: field {name!r} must be {what}, not {value!r:.60}")
    if len(data["keep"]) != len(data["units"]):
        raise SolutionFileError(
            f"{where}: {len(data['keep'])} keep decisions for {len(data['units'])} units"
        )
    problem = _check_stages(data["stages"], len(data["units"]))
    if problem:
        raise SolutionFileError(f"{where}: {problem}")
    data = dict(data, input_shape=tuple(data["input_shape"]))
    data.setdefault("torch_version", "")  # not the running torch's: unknown
    return Solution(**data)


def load(path: str | os.PathLike) -> Solution:
    """Read and check a solution file: every failure is a one-line SolutionFileError.
    The decisions are checked against the graph when a schedule is built from them."""
    path = Path(path)
    try:
        if path.is_dir():
            raise SolutionFileError(f"{path} is a folder, not a solution file")
        if path.stat().st_size > _MAX_BYTES:
            raise SolutionFileError(f"{path}: {path.stat().st_size} bytes is no solution file")
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise SolutionFileError(f"{path}: no such solution file") from None
    except UnicodeDecodeError:
        raise SolutionFileError(f"{path}: not a solution file (binary, not JSON text)") from None
    except OSError as exc:
        raise SolutionFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SolutionFileError(
            f"{path}: corrupt or truncated solution file ({exc.msg} at character {exc.pos}); "
            "solve again"
        ) from None
    except RecursionError:
        raise SolutionFileError(f"{path}: not a solution file (nested too deeply)") from None
    return from_dict(data, str(path))
