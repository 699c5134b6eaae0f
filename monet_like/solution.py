"""The solution file: a schedule as versioned plain data (JSON), loaded without running code.

It carries everything needed to refuse a wrong replay: the fingerprint of the graph
it was solved for, the model expression, batch, input shape, dtype, the device of
its profile, the mode, the budget and the library version.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from monet_like import __version__

FORMAT_VERSION = 3  # 2: variants_off; 3: algorithms


class SolutionFileError(ValueError):
    """A solution file that cannot be used: corrupt, truncated, or from a newer format."""


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
    status: str  # "optimal", "feasible" (time limit, gap > target), "store-all"
    objective_s: float  # recomputation time added to one step
    bound_s: float | None
    gap: float | None  # None: the solver did not report a bound
    solve_time_s: float
    predicted_peak_bytes: int
    predicted_peak_at: str
    predicted_time_s: float
    store_all_peak_bytes: int
    store_all_time_s: float
    fixed_bytes: int
    ablation: bool
    stats: dict
    keep: list[bool]  # per unit: kept after the forward pass
    units: list[list[int]]  # per unit: its graph nodes
    stages: list[dict]  # per backward stage: {"unit", "ops", "recompute": [unit ids]}
    input_grad: bool = False  # the schedule also computes the input's gradient
    # The mode's variant flags rewritten into the graph it runs on (none when the
    # captured graph's own schedule was faster), and the sites of those the solver
    # turned off (their replaced aten op runs instead).
    variants: list[str] | None = None
    variants_off: list[str] = field(default_factory=list)
    # conv mode: convolution site -> [forward, backward-data, backward-weight] algorithms,
    # for those not left to PyTorch (-1)
    algorithms: dict[str, list[int]] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    library_version: str = __version__
    extra: dict = field(default_factory=dict)

    @property
    def overhead(self) -> float:
        """Predicted step time relative to the store-all step, minus one."""
        return self.predicted_time_s / self.store_all_time_s - 1 if self.store_all_time_s else 0.0

    def summary(self) -> dict:
        d = asdict(self)
        for key in ("keep", "units", "stages", "variants_off", "algorithms"):
            d.pop(key)
        return d

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)  # atomic: an interrupted write never leaves half a file
        return path


def load(path: str | os.PathLike) -> Solution:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SolutionFileError(f"{path}: no such solution file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SolutionFileError(
            f"{path}: corrupt or truncated solution file ({exc.msg} at character {exc.pos}); "
            "solve again"
        ) from None
    if not isinstance(data, dict) or "format_version" not in data:
        raise SolutionFileError(f"{path}: not a monet_like solution file")
    if data["format_version"] > FORMAT_VERSION:
        raise SolutionFileError(
            f"{path}: format version {data['format_version']} is newer than this monet_like "
            f"reads ({FORMAT_VERSION}, library {__version__}): upgrade monet_like"
        )
    try:
        data["input_shape"] = tuple(data["input_shape"])
        return Solution(**data)
    except TypeError as exc:
        raise SolutionFileError(f"{path}: malformed solution file ({exc})") from None
