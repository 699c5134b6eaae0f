"""The profile's types: per node (NodeProfile) and per graph (Profile), as cached."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch

from monet_like.graph import Graph
from monet_like.profile.algorithms import algorithm_workspace
from monet_like.profile.workspace import ALONE_DRIFT, drift_repaired

# 15: convolution algorithms measured on inputs laid out as in the graph (gaps included)
PROFILE_FORMAT = 15

NOISY_SPREAD = 0.10  # a profile whose timed runs differ more than this is noisy
# Ops run alone at the solved batch taking more than this many times their fitted
# times: a solve says the fit from smaller batches likely understates that step.
FIT_UNDERSTATES = 1.25
# Other work on the machine: runnable threads per core (the 1-minute load average) above
# this while profiling. Our own step keeps about one per core busy; a second job as large
# doubles it. Steady load can slow every op alike (a small spread) and still change their
# ratios: ResNet-50's step profiled 4.4 times slower beside two other jobs, with 13% spread,
# and im2col against oneDNN came out faster than it runs on a quiet machine.
BUSY_LOAD_PER_CORE = 1.5


def load_per_core() -> float | None:
    """The 1-minute load average per core this process may use (None: not known)."""
    try:
        cores = len(os.sched_getaffinity(0))
        return os.getloadavg()[0] / max(cores, 1)
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class NodeProfile:
    node: int
    name: str
    kind: str
    module: str
    output_bytes: int
    forward_s: float  # the node's forward ops (compute op and its views)
    backward_s: float  # the backward ops autograd runs for it
    recompute_s: float  # running its forward again during backward
    workspace_bytes: int  # transient bytes of its forward compute op
    backward_workspace_bytes: int  # largest transient bytes among its backward ops


@dataclass
class Profile:
    format: int
    model: str
    fingerprint: str  # of the graph at the full batch
    batch: int
    profile_batch: int
    scaled: bool  # times and workspace scaled by batch / profile_batch
    input_shape: tuple[int, ...]
    dtype: str
    device: str
    torch_version: str
    repeats: int
    workspace_method: str
    nodes: list[NodeProfile]
    time_method: str = ""  # how the times were taken ('' in a profile from an older release)
    op_workspace: list[tuple[int, int]] = field(default_factory=list)  # (op index, bytes) > 0
    # (op index, seconds) of the ops run alone at the solved batch, where the profile is
    # taken at a smaller one: their times there, or where the times are fitted from two
    # smaller batches (too few ops ran alone), a check on the fit (`alone_over_fitted`)
    alone_seconds: list[tuple[int, float]] = field(default_factory=list)
    op_forward_s: float = 0.0  # whole-step totals over every op, attributed or not
    op_backward_s: float = 0.0
    profile_seconds: float = 0.0
    # conv mode: per convolution site, per direction ("forward", "data", "weight"), the
    # algorithms the device offers as [algorithm, seconds, workspace bytes]; "both": the
    # backward with PyTorch's choice for both parts, which runs as one call
    algorithms: dict[str, dict[str, list[list]]] = field(default_factory=dict)
    op_times_s: list[float] = field(default_factory=list)  # per op index, at the full batch
    aligned: str = ""  # how `align_times` set the times against another graph's profile
    # (max - min) / median of the whole step's time over the timed runs: the noise the
    # times were measured with (None: not recorded, a profile from an older release)
    time_spread: float | None = None
    # the ops timed alone (`workspace._check_alone`): how much slower their pass ran its
    # first ops than they ran timed again at its end (None: not checked); how many ran
    # while other work took the machine; how many were timed again for either; whether
    # that stopped, the machine still busy; where the drift had every op timed again: how
    # much slower its first ops' kept times were than those ops timed a third time (within
    # ALONE_DRIFT: a slow spell at the pass's start, repaired; None: not timed again whole)
    alone_drift: float | None = None
    alone_drift_after: float | None = None
    alone_retimed: int = 0
    alone_contended: int = 0
    alone_busy: bool = False
    # seconds each stage of profiling took, in order (what a cold solve's time went to)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # the machine's load while profiling (`load_per_core`, the larger at start and end)
    load_per_core: float | None = None
    cached: bool = field(default=False, compare=False)

    @property
    def noisy(self) -> str:
        """Why its times are unsure ('' where they are not): timed runs that differ by
        more than NOISY_SPREAD, ops timed alone whose check drifted more than ALONE_DRIFT
        (unless they were all timed again and that held when checked once more) or that ran
        beside other work and could not be timed again quiet, or other work on the machine
        while it was taken."""
        reasons = []
        if self.time_spread is not None and self.time_spread > NOISY_SPREAD:
            reasons.append(f"its timed runs of the whole step differ by {self.time_spread:.0%}")
        settled = drift_repaired(self.alone_drift_after)
        if self.alone_drift is not None and abs(self.alone_drift) > ALONE_DRIFT and not settled:
            how = "slower" if self.alone_drift > 0 else "faster"
            again = ", each op then timed again" if self.alone_retimed else ""
            if self.alone_drift_after is not None:
                again += f" and {abs(self.alone_drift_after):.0%} off when checked once more"
            reasons.append(
                f"its ops timed alone ran {abs(self.alone_drift):.0%} {how} at first than"
                f" at the end{again}"
            )
        if self.alone_busy:
            reasons.append(
                f"{self.alone_contended} of its ops timed alone ran beside other work, which"
                " was still running when they were to be timed again"
            )
        if self.load_per_core is not None and self.load_per_core > BUSY_LOAD_PER_CORE:
            reasons.append(
                f"it was taken with the machine busy ({self.load_per_core:.1f} runnable threads"
                " per core)"
            )
        return "; ".join(reasons)

    def workspace_by_op(
        self, graph: Graph | None = None, algorithms: dict[str, list[int]] | None = None
    ) -> dict[int, int]:
        """Transient bytes per op index of the graph, for `memory.store_all_timeline`.

        With `graph`, each convolution whose algorithms were measured (conv mode) takes
        the measured workspace of the algorithms in `algorithms` (site -> [forward,
        backward-data, backward-weight]; PyTorch's own, -1, for a site not named)."""
        workspace = dict(self.op_workspace)
        if graph is not None:
            workspace.update(algorithm_workspace(graph, self.algorithms, algorithms or {}))
        return workspace

    @property
    def alone_over_fitted(self) -> float | None:
        """The ops run alone at the solved batch (`alone_seconds`): their seconds there
        over their times in the profile; None where none was run, 1 where the times are
        theirs. Above 1, times fitted from smaller batches understate the step at this
        batch: on this project's 2-core CPU a real ResNet-50 step at 184 took 2.3 times
        the fitted one, its ops run alone about 0.8 to 0.9 of their time in it
        (docs/benchmarks.md, time fit)."""
        times = self.op_times_s
        pairs = [(s, times[i]) for i, s in self.alone_seconds if i < len(times)]
        fitted = sum(t for _, t in pairs)
        return sum(s for s, _ in pairs) / fitted if pairs and fitted > 0 else None

    @property
    def step_time_s(self) -> float:
        return self.op_forward_s + self.op_backward_s

    def to_dataframe(self):
        import pandas as pd

        return pd.DataFrame([asdict(n) for n in self.nodes])

    def to_csv(self, path: str | os.PathLike) -> None:
        self.to_dataframe().to_csv(path, index=False)

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("cached")
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        d = json.loads(text)
        if d.get("format") != PROFILE_FORMAT:
            raise ValueError(f"profile format {d.get('format')} is not {PROFILE_FORMAT}")
        d["nodes"] = [NodeProfile(**n) for n in d["nodes"]]
        d["input_shape"] = tuple(d["input_shape"])
        d["op_workspace"] = [tuple(p) for p in d["op_workspace"]]
        d["alone_seconds"] = [tuple(p) for p in d.get("alone_seconds", [])]
        return cls(**d)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def _node_profiles(graph: Graph, workspace: list[int]) -> list[NodeProfile]:
    """Each node's profile with its workspace from `workspace` (per op index) and its
    times zero: `_with_op_times` fills them from per-op times."""
    return [
        NodeProfile(
            node=n.id,
            name=n.name,
            kind=n.kind,
            module=n.module,
            output_bytes=n.output_bytes,
            forward_s=0.0,
            backward_s=0.0,
            recompute_s=0.0,
            workspace_bytes=workspace[n.op],
            backward_workspace_bytes=max((workspace[i] for i in n.backward_ops), default=0),
        )
        for n in graph.nodes
    ]
