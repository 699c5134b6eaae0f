"""Stage 2: measure each node's time and workspace on the device in use.

Bytes come from the graph (exact, from shapes, at the full batch). Times and
workspace are measured by running the captured joint graph op by op on real
tensors: a warm-up run, then `repeats` timed runs, the median kept per op; one
more run under torch.profiler with memory recording gives each op's workspace
(the peak of what it allocates while it runs, above what it returns). On CUDA,
times come from CUDA events and workspace from the allocator's peak statistics.

On a slow device the profile may be taken at a smaller batch than the one solved
for; times are then measured at a second batch too and extrapolated per op as
a + b * batch (per-op overhead does not grow with the batch), and the profile says so
(`scaled`, `profile_batch`). Where no second batch fits (the batch is 1 or 2), times
scale linearly. Workspace is not linear in the batch (a library picks its blocking by
shape), so on CPU it is measured in one run at the solved batch when that run fits in
half the available memory; otherwise it is fitted like the times, and every op whose
fitted figure is large is then run alone at the solved batch and measured. Convolution
algorithms (conv mode) are timed apart, at or near the solved batch: see
`_algorithm_options`.
Profiles are cached on disk as JSON, keyed by graph fingerprint, profile batch,
dtype, device and torch version.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from monet_like.errors import UserError
from monet_like.files import atomic_write, cache_dir
from monet_like.graph import BACKWARD, FORWARD, Graph, capture, tangents_for
from monet_like.memory import allocation_peak, record_allocations, store_all_peak

PROFILE_FORMAT = 14  # 4: algorithms; 5: "both"; 6: algorithms timed interleaved near the batch;
# 7: CPU workspace measured at the solved batch when it fits in memory; 8: where it does not,
# large ops measured alone there, and PyTorch's convolution algorithm takes the step's figure;
# 9: per-op times kept (op_times_s), so two graphs' profiles can share their common ops' times;
# 10: on CPU, PyTorch's convolution algorithm over 2 and 8 batch chunks among the options;
# 11: their workspace, where fitted from batches below the chunk count, from PyTorch's own
# algorithm's fitted workspace at the chunk's batch plus one chunk's result;
# 12: a large op is measured alone where it takes up to 80% of the memory free then (was half
# of what was free before the first), and the ops left as fitted are named in workspace_method;
# 13: a convolution's backward options measured with its gradient expanded as in the graph;
# 14: its tensors laid out as in the graph (im2col is offered for contiguous inputs only).


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
    op_workspace: list[tuple[int, int]] = field(default_factory=list)  # (op index, bytes) > 0
    op_forward_s: float = 0.0  # whole-step totals over every op, attributed or not
    op_backward_s: float = 0.0
    profile_seconds: float = 0.0
    # conv mode: per convolution site, per direction ("forward", "data", "weight"), the
    # algorithms the device offers as [algorithm, seconds, workspace bytes]; "both": the
    # backward with PyTorch's choice for both parts, which runs as one call
    algorithms: dict[str, dict[str, list[list]]] = field(default_factory=dict)
    op_times_s: list[float] = field(default_factory=list)  # per op index, at the full batch
    aligned: str = ""  # how `align_times` set the times against another graph's profile
    cached: bool = field(default=False, compare=False)

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
        return cls(**d)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


# Profiles the solution zoo was solved from (solutions/profiles/), read like the cache's.
SHIPPED_PROFILES = Path(__file__).resolve().parent.parent / "solutions" / "profiles"


def cache_path(graph: Graph, profile_batch: int, device: torch.device) -> Path:
    """Where `graph`'s profile at `profile_batch` on `device` is cached."""
    return cache_dir() / "profiles" / f"{_cache_key(graph, profile_batch, device)}.json"


def _cache_key(graph: Graph, profile_batch: int, device: torch.device) -> str:
    text = "|".join(
        [graph.fingerprint, str(profile_batch), graph.dtype, device_name(device), torch.__version__]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class _OpRunner:
    """Runs a captured joint graph on real tensors, one fx node at a time, timing each."""

    def __init__(self, graph: Graph, device: torch.device) -> None:
        self.graph = graph
        self.device = device
        self.index = {op.name: op.index for op in graph.ops}

    def run(self, args: list, on_op=None) -> None:
        from torch.fx import Interpreter

        runner = self

        class Timed(Interpreter):
            def run_node(self, n):
                idx = runner.index.get(n.name)
                if idx is None or on_op is None:
                    return super().run_node(n)
                return on_op(idx, lambda: super(Timed, self).run_node(n))

        with torch.no_grad():
            Timed(self.graph.fx).run(*args)


def _median_times(runner: _OpRunner, args_fn, repeats: int, progress) -> list[float]:
    n = len(runner.graph.ops)
    samples: list[list[float]] = [[] for _ in range(n)]
    cuda = runner.device.type == "cuda"

    for r in range(repeats + 1):  # the first run warms up and is dropped
        events: list[tuple[int, object, object]] = []

        def on_op(idx, fn, events=events):
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                out = fn()
                end.record()
                events.append((idx, start, end))
                return out
            t0 = time.perf_counter()
            out = fn()
            events.append((idx, time.perf_counter() - t0, None))
            return out

        runner.run(args_fn(), on_op)
        if cuda:
            torch.cuda.synchronize(runner.device)
        if r > 0:
            for idx, a, b in events:
                samples[idx].append(a.elapsed_time(b) / 1e3 if cuda else a)
        progress(1)
    return [statistics.median(s) if s else 0.0 for s in samples]


def _workspace_cpu(runner: _OpRunner, args) -> tuple[list[int], str]:
    """Per op: peak bytes allocated while it runs minus what it still holds at its end."""
    from torch.profiler import record_function

    def on_op(idx, fn):
        with record_function(f"monet_op:{idx}"):
            return fn()

    roots = record_allocations(lambda: runner.run(args, on_op))
    workspace = [0] * len(runner.graph.ops)
    if roots is None:  # the private API moved: say so rather than guess
        return workspace, "unavailable"
    stack = list(roots)
    while stack:
        ev = stack.pop()
        if ev.name.startswith("monet_op:"):
            peak, held = allocation_peak([ev])
            workspace[int(ev.name.split(":")[1])] = max(0, peak - max(held, 0))
        else:
            stack.extend(ev.children)
    return workspace, "torch.profiler allocation events"


def _workspace_cuda(runner: _OpRunner, args) -> tuple[list[int], str]:
    workspace = [0] * len(runner.graph.ops)

    def on_op(idx, fn):
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        out = fn()
        torch.cuda.synchronize(runner.device)
        after = torch.cuda.memory_allocated(runner.device)
        workspace[idx] = max(0, torch.cuda.max_memory_allocated(runner.device) - after)
        return out

    runner.run(args, on_op)
    return workspace, "cuda allocator peak statistics"


def _bar_hidden(progress: bool | None) -> bool | None:
    """tqdm's `disable` for a `progress` flag: None lets tqdm ask the terminal."""
    return None if progress is None else not progress


def _available_memory_bytes() -> int | None:
    """Memory the system could give this process now (Linux's MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# Where a step at the solved batch does not fit in memory, its workspace is fitted from two
# small batches, and each op whose fitted figure is at least this many bytes is then run
# alone at the solved batch, on random inputs of its shapes, and measured. A library may
# change its method with the size: oneDNN's weight gradient of VGG-16's second convolution
# takes two activations of scratch at each batch measured from 8 to 160 and a twentieth of
# one at 176.
OP_REMEASURE_BYTES = 64 * 2**20
# The share of the free memory an op measured alone may take (inputs, outputs, fitted
# workspace); the rest is the margin for a real workspace above the fitted one.
REMEASURE_MEMORY_SHARE = 0.8


def _node_inputs(node) -> list:
    """The values (meta "val") of the fx nodes among `node`'s arguments."""
    from torch.fx.node import Node, map_aggregate

    values: list = []
    map_aggregate(
        (node.args, node.kwargs),
        lambda a: values.append(a.meta.get("val")) if isinstance(a, Node) else None,
    )
    return values


def _workspace_alone(node, device: torch.device, gen: torch.Generator) -> int:
    """Workspace of `node`'s op run once by itself on random inputs of its shapes."""
    from torch.fx.node import Node, map_aggregate

    def real(a):
        if not isinstance(a, Node):
            return a
        v = a.meta["val"]
        t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
        return t.normal_(generator=gen)

    args, kwargs = map_aggregate((node.args, node.kwargs), real)
    return _workspace_of(lambda: node.target(*args, **kwargs), device)


def _remeasure_alone(
    graph: Graph, device: torch.device, workspace: list[int], progress: bool | None = None
) -> tuple[list[int], list[str]]:
    """Measure again, each alone at `graph`'s batch, the compute ops whose `workspace`
    (fitted) is at least OP_REMEASURE_BYTES; `workspace` is updated in place. An op is left
    as fitted when an input is not a floating-point tensor (indices, masks: random values
    could be invalid), when its inputs, outputs and fitted workspace would take more than
    REMEASURE_MEMORY_SHARE of the memory free just before it, or when it fails on random
    inputs. Returns the indices measured, and the names of the ops left as fitted for lack
    of memory."""
    from tqdm import tqdm

    if device.type != "cpu" or _available_memory_bytes() is None:
        return [], []
    nodes = {n.name: n for n in graph.fx.graph.nodes}
    gen = torch.Generator(device="cpu").manual_seed(0)
    large = [
        op for op in graph.ops if op.role == "compute" and workspace[op.index] >= OP_REMEASURE_BYTES
    ]
    measured, too_large = [], []
    desc = f"measuring large ops alone at batch {graph.batch}"
    for op in tqdm(large, desc=desc, unit="op", disable=_bar_hidden(progress)):
        node = nodes[op.name]
        inputs = _node_inputs(node)
        if not all(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in inputs):
            continue
        touched = sum(graph.storages[i].nbytes for i in {*op.reads, *op.outputs})
        # Read per op: what other processes hold moves. Was half of what was free before the
        # first op, which left VGG-16's (176) largest backward (10.5 GiB with its fitted
        # scratch, on a 24 GB machine) fitted at twice its scratch in some runs.
        free = _available_memory_bytes() or 0
        if touched + workspace[op.index] > REMEASURE_MEMORY_SHARE * free:
            too_large.append(op.name)
            continue
        try:
            workspace[op.index] = _workspace_alone(node, device, gen)
        except (RuntimeError, NotImplementedError):
            continue  # keep the fitted figure
        measured.append(op.index)
    return measured, too_large


def _fits_in_memory(graph: Graph, device: torch.device) -> bool:
    """Whether a CPU step of `graph` at its own batch, everything stored, takes at most
    half the memory available: then its workspace is measured there, not extrapolated."""
    if device.type != "cpu" or (available := _available_memory_bytes()) is None:
        return False
    return store_all_peak(graph) <= available // 2


def _extrapolate_float(w1: list[float], b1: int, w2: list[float], b2: int, batch: int):
    """Per op, the line through (b1, w1) and (b2, w2) evaluated at `batch`; never negative,
    never below what was measured."""
    out = []
    for a, b in zip(w1, w2, strict=True):
        slope = max(0.0, (a - b) / (b1 - b2))
        intercept = max(0.0, a - slope * b1)
        out.append(max(a, b, intercept + slope * batch))
    return out


def _extrapolate(w1: list[int], b1: int, w2: list[int], b2: int, batch: int) -> list[int]:
    return [int(w) for w in _extrapolate_float(w1, b1, w2, b2, batch)]


def option(rows: list[list], algo: int) -> tuple[float, int]:
    """(seconds, workspace bytes) of algorithm `algo` among one direction's measured rows."""
    return next((t, ws) for a, t, ws in rows if a == algo)


def backward_option(options: dict[str, list[list]], data: int, weight: int) -> tuple[float, int]:
    """(seconds, workspace bytes) of a convolution's backward with these algorithms: its
    parts run one after the other (times add, the larger workspace counts), except
    PyTorch's own choice for both, one call, measured as such ("both")."""
    if (data, weight) == (-1, -1) and "both" in options:
        return option(options["both"], -1)
    parts = [option(options[d], a) for d, a in (("data", data), ("weight", weight)) if d in options]
    return sum(t for t, _ in parts), max((ws for _, ws in parts), default=0)


def _measured_sites(graph: Graph, measured: dict[str, dict[str, list[list]]]):
    """(site id, its options, forward op index, backward op index or None) of every
    convolution site of `graph` with options in `measured`."""
    from monet_like.variants import algorithm_sites

    op_index = {op.name: op.index for op in graph.ops}
    for site in algorithm_sites(graph):
        options = measured.get(site["id"])
        if options is not None:
            yield site["id"], options, op_index[site["forward"][0]], op_index.get(site["backward"])


def algorithm_workspace(
    graph: Graph, measured: dict[str, dict[str, list[list]]], chosen: dict[str, list[int]]
) -> dict[int, int]:
    """Op index -> workspace bytes of every measured convolution op of `graph`, with the
    algorithms `chosen` for it (site -> [forward, backward-data, backward-weight]; -1,
    PyTorch's own, for a site not named)."""
    workspace = {}
    for site, options, forward_op, backward_op in _measured_sites(graph, measured):
        forward, data, weight = chosen.get(site, (-1, -1, -1))
        workspace[forward_op] = option(options["forward"], forward)[1]
        if backward_op is not None:
            workspace[backward_op] = backward_option(options, data, weight)[1]
    return workspace


def _aten_options_take(
    graph: Graph, measured: dict[str, dict[str, list[list]]], workspace: list[int], ops: set[int]
) -> None:
    """Set the workspace of PyTorch's own algorithm (-1) in each convolution site's
    `measured` options to the step's `workspace` at that op, for the op indices in `ops`:
    the forward, and the backward as the step runs it (both parts in one call, or the
    one part its gradient mask asks for)."""
    for _, options, forward_op, backward_op in _measured_sites(graph, measured):
        steps = [("forward", forward_op)]
        if backward_op is not None:
            parts = [d for d in ("both", "data", "weight") if d in options]
            if parts and (parts[0] == "both" or len(parts) == 1):
                steps.append((parts[0], backward_op))
        for direction, i in steps:
            if i in ops:
                for row in options[direction]:
                    if row[0] == -1:
                        row[2] = workspace[i]


def _workspace_of(call, device: torch.device) -> int:
    """Peak bytes `call()` allocates above what it returns."""
    held: list = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        held.append(call())
        torch.cuda.synchronize(device)
        after = torch.cuda.memory_allocated(device)
        return max(0, torch.cuda.max_memory_allocated(device) - max(after, before))
    peak, kept = allocation_peak(record_allocations(lambda: held.append(call())) or [])
    return max(0, peak - max(kept, 0))


def _fastest_interleaved(calls: list, device: torch.device, rounds: int) -> list[float]:
    """Seconds of each call: the least over `rounds` rounds that run every call once in
    turn, after a warm-up round. Interleaved, so a busy spell of a shared machine falls
    on all of them alike; the least, because noise only ever adds time."""
    cuda = device.type == "cuda"
    best = [float("inf")] * len(calls)
    for r in range(rounds + 1):
        for i, call in enumerate(calls):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            call()
            if cuda:
                torch.cuda.synchronize(device)
            if r:
                best[i] = min(best[i], time.perf_counter() - t0)
    return best


# A convolution's algorithms are timed at the graph's batch, or at a smaller one when a
# forward call would cost more than this many floating-point operations: timing the
# choice at the batch it is for, not extrapolating small batches' times (an error at two
# small batches grows with the distance to the real one).
ALGORITHM_TIMING_FLOPS = 1e9


# Their workspace is measured at the graph's batch when one call there costs at most this
# many; otherwise it is fitted as a + b * batch from two smaller batches.
ALGORITHM_WORKSPACE_FLOPS = 1e10


def _conv_flops(w_shape, y_shape, batch: int) -> int:
    return 2 * batch * math.prod(y_shape[1:]) * math.prod(w_shape[1:])


def _timing_batch(w_shape, y_shape, batch: int, least: int) -> int:
    """The batch a convolution's algorithms are timed at (see ALGORITHM_TIMING_FLOPS)."""
    per_sample = _conv_flops(w_shape, y_shape, 1)
    return max(least, min(batch, int(ALGORITHM_TIMING_FLOPS // max(per_sample, 1))))


def _site_calls(site: dict, nodes: dict, rows: int, device: torch.device, gen) -> dict:
    """Direction -> [(algorithm, call)] for one convolution site (variants.conv) on random
    tensors of its shapes with `rows` samples: "forward", "data" and "weight" (each part
    of the backward alone, the other part PyTorch's), and "both" (PyTorch's choice for
    the whole backward, one call, as autograd runs it)."""
    ops = torch.ops.monet_like

    def real(node, batch_dim: bool) -> torch.Tensor | None:
        if node is None:
            return None
        v = node.meta["val"]
        shape = [rows, *v.shape[1:]] if batch_dim else list(v.shape)
        # laid out as in the graph (a channels-last input takes other algorithms)
        order = sorted(range(v.dim()), key=lambda d: -v.stride(d))
        dense = torch.randn([shape[d] for d in order], generator=gen, dtype=v.dtype)
        return dense.permute([order.index(d) for d in range(v.dim())]).to(device)

    fwd = nodes[site["forward"][0]]
    x_node, w_node, b_node, stride, padding, dilation, groups, _ = fwd.args
    x, w, b = real(x_node, True), real(w_node, False), real(b_node, False)
    geometry = (stride, padding, dilation, groups)
    flat = list(ops.conv2d_algorithms(x, w, *geometry))
    n_fwd, n_data = flat[0], flat[flat[0] + 1]
    choices = {
        "forward": flat[1 : 1 + n_fwd],
        "data": flat[n_fwd + 2 : n_fwd + 2 + n_data],
        "weight": flat[n_fwd + n_data + 3 :],
    }
    forward = partial(ops.conv2d_algo, x, w, b, *geometry)
    calls = {"forward": [(a, partial(forward, a)) for a in choices["forward"]]}
    if site["backward"]:
        grad = _like_in_graph(torch.randn_like(forward(-1)), nodes[site["backward"]].args[0])
        mask = nodes[site["backward"]].args[7]
        backward = partial(ops.conv2d_backward_algo, grad, x, w, *geometry)
        for k, direction in enumerate(("data", "weight")):
            if mask[k]:
                parts = [k == 0, k == 1, False]
                pair = (lambda a: (a, -1)) if k == 0 else (lambda a: (-1, a))
                calls[direction] = [
                    (a, partial(backward, parts, *pair(a))) for a in choices[direction]
                ]
        if mask[0] and mask[1]:
            calls["both"] = [(-1, partial(backward, [True, True, False], -1, -1))]
    return calls


def _like_in_graph(value: torch.Tensor, node: torch.fx.Node) -> torch.Tensor:
    """`value` laid out as the graph's `node` is: broadcast along the dimensions `node`
    is expanded in (stride 0), such as the gradient of a sum reaching a network's last
    convolution, which the im2col backward then copies whole in each of its parts (an
    uncounted 8 KiB above the prediction in a one-thread test, where a contiguous
    gradient had been measured)."""
    meta = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(meta, torch.Tensor) or meta.dim() != value.dim():
        return value
    expanded = [d for d in range(meta.dim()) if meta.stride(d) == 0 and meta.shape[d] > 1]
    if not expanded:
        return value
    index = tuple(slice(0, 1) if d in expanded else slice(None) for d in range(value.dim()))
    return value[index].contiguous().expand(value.shape)


def _fit_chunked(
    keys: list[tuple[str, int]],
    ws1: list[int],
    b1: int,
    ws2: list[int],
    b2: int,
    fitted: list[int],
    fwd: torch.fx.Node,
    batch: int,
) -> None:
    """Fitted workspace of the batch-chunk options (algorithm -k, see csrc/ops.cpp), set
    in `fitted`: where a measured batch had fewer than k samples the call ran one per
    sample there, and its line says nothing of a chunk of batch / k at the solved batch
    (VGG-16's first layers at 4 and 8 gave 0.03 GB for 8 chunks of 22). A chunk runs
    PyTorch's algorithm on batch / k samples, then its result is copied into the whole
    output: the -1 option's line at that batch, plus one chunk's result (the layer's
    output in the forward, its input's gradient in the backward-data part)."""
    rows = {key: i for i, key in enumerate(keys)}
    x_val, y_val = fwd.args[0].meta["val"], fwd.meta["val"]
    result = {"forward": y_val, "data": x_val}
    for (direction, algo), i in rows.items():
        k = -algo
        if algo > -2 or min(b1, b2) >= k or (direction, -1) not in rows:
            continue
        whole = rows[(direction, -1)]
        rows_per_chunk = -(-batch // k)
        (line,) = _extrapolate([ws1[whole]], b1, [ws2[whole]], b2, rows_per_chunk)
        value = result.get(direction)
        chunk_result = 0
        if value is not None:
            chunk_result = value.numel() // value.shape[0] * rows_per_chunk * value.element_size()
        fitted[i] = line + chunk_result


def _algorithm_options(
    graph: Graph,
    device: torch.device,
    profile_batch: int,
    repeats: int,
    progress: bool | None = None,
) -> dict[str, dict[str, list[list]]]:
    """Every algorithm of every convolution site (variants.conv), run alone on random
    tensors of the site's shapes: [algorithm, seconds, workspace bytes] at the graph's
    batch. Times: the algorithms of a site run in turn, `repeats` rounds (at least 3),
    at the graph's batch or the largest below it that ALGORITHM_TIMING_FLOPS allows,
    then scaled linearly to it (only their ratios are used: problem.AlgorithmChoice).
    Workspace: measured at the graph's batch where ALGORITHM_WORKSPACE_FLOPS allows, else
    at the timing batch and a second one, fitted as a + b * batch."""
    from tqdm import tqdm

    from monet_like.variants import algorithm_sites

    nodes = {n.name: n for n in graph.fx.graph.nodes}
    gen = torch.Generator(device="cpu").manual_seed(0)
    out: dict[str, dict[str, list[list]]] = {}
    sites = algorithm_sites(graph)
    bar = tqdm(
        sites, desc="timing convolution algorithms", unit="conv", disable=_bar_hidden(progress)
    )
    for site in bar:
        fwd = nodes[site["forward"][0]]
        weight_shape, out_shape = fwd.args[1].meta["val"].shape, fwd.meta["val"].shape
        timed_at = _timing_batch(weight_shape, out_shape, graph.batch, profile_batch)
        calls = _site_calls(site, nodes, timed_at, device, gen)
        keys = [(d, a) for d, rows in calls.items() for a, _ in rows]
        flat = [c for rows in calls.values() for _, c in rows]
        seconds = _fastest_interleaved(flat, device, max(repeats, 3))
        workspace = [_workspace_of(c, device) for c in flat]
        if timed_at != graph.batch and _conv_flops(weight_shape, out_shape, graph.batch) <= (
            ALGORITHM_WORKSPACE_FLOPS
        ):  # measured where it is used: workspace is not linear in the batch
            at_batch = _site_calls(site, nodes, graph.batch, device, gen)
            workspace = [_workspace_of(c, device) for rows in at_batch.values() for _, c in rows]
        else:
            second = profile_batch if timed_at != profile_batch else min(2 * timed_at, graph.batch)
            if second != timed_at:
                others = _site_calls(site, nodes, second, device, gen)
                other_ws = [_workspace_of(c, device) for rows in others.values() for _, c in rows]
                fitted = _extrapolate(workspace, timed_at, other_ws, second, graph.batch)
                _fit_chunked(keys, workspace, timed_at, other_ws, second, fitted, fwd, graph.batch)
                workspace = fitted
        entry: dict[str, list[list]] = {}
        for (direction, algo), t, ws in zip(keys, seconds, workspace, strict=True):
            entry.setdefault(direction, []).append([algo, t * graph.batch / timed_at, ws])
        out[site["id"]] = entry
    return out


def _real_args(model: nn.Module, graph: Graph, device: torch.device, dtype: torch.dtype):
    """Placeholders for the joint graph: parameters, copies of buffers, input, tangents."""
    from monet_like.models import make_input

    gen = torch.Generator(device="cpu").manual_seed(0)

    def prep(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(device)
        return t.to(dtype) if t.is_floating_point() else t

    params = [prep(p) for p in model.parameters()]
    x = make_input(model, graph.input_shape, graph.batch, dtype, "cpu", gen).to(device)
    tangents = tangents_for(graph, device)

    def fresh():  # buffers are updated in place by BatchNorm: never touch the model's
        return [*params, *[prep(b).clone() for b in model.buffers()], x, *tangents]

    return fresh


def profile(
    model: nn.Module,
    graph: Graph,
    profile_batch: int | None = None,
    device: str | torch.device | None = None,
    repeats: int = 3,
    use_cache: bool = True,
    progress: bool | None = None,
) -> Profile:
    """Measure per-node times and workspace of `graph` (captured from `model`).

    `model` must hold real parameters (not "meta"). `profile_batch` defaults to the
    graph's batch on CUDA and to min(batch, 4) on CPU.
    """
    device = torch.device(device or graph.device)
    dtype = getattr(torch, graph.dtype)
    if profile_batch is None:
        profile_batch = graph.batch if device.type == "cuda" else min(graph.batch, 4)
    if not 1 <= profile_batch <= graph.batch:
        raise UserError(f"profile batch must be between 1 and {graph.batch}, got {profile_batch}")
    if any(p.is_meta for p in model.parameters()):
        raise UserError("the profiler needs a model with real parameters, not one on 'meta'")

    path = cache_path(graph, profile_batch, device)
    shipped = SHIPPED_PROFILES / path.name  # the zoo's, for its models (read-only)
    for source in (path, shipped) if use_cache else ():
        if not source.exists():
            continue
        try:
            cached = Profile.from_json(source.read_text())
            cached.cached = True
            return cached
        except (ValueError, KeyError, TypeError):
            if source == path:
                path.unlink(missing_ok=True)  # unreadable or older format: profile again

    started = time.perf_counter()

    def graph_at(batch: int) -> Graph:
        if batch == graph.batch:
            if graph.fx is None:
                raise UserError("this graph carries no traced module to run: capture it again")
            return graph
        from monet_like.variants import apply as apply_variants

        other = capture(
            model,
            graph.input_shape,
            batch,
            dtype,
            device,
            graph.model,
            graph.input_grad,
            graph.outputs_held,
            None if graph.autocast is None else getattr(torch, graph.autocast),
        )
        other = apply_variants(other, graph.variants)
        if [o.target for o in other.ops] != [o.target for o in graph.ops]:
            raise UserError(
                f"the graph at batch {batch} differs from the one at batch {graph.batch} "
                f"(batch-dependent control flow?): profile with --profile_batch {graph.batch}"
            )
        return other

    def workspace_at(g: Graph) -> tuple[list[int], str]:
        runner = _OpRunner(g, device)
        args = _real_args(model, g, device, dtype)()
        if device.type == "cuda":
            return _workspace_cuda(runner, args)
        return _workspace_cpu(runner, args)

    from tqdm import tqdm

    scaled = profile_batch != graph.batch
    every_op = {op.index for op in graph.ops}
    at_batch: set[int] = set() if scaled else every_op  # ops whose workspace is measured there
    small = graph_at(profile_batch)
    runner = _OpRunner(small, device)
    args_fn = _real_args(model, small, device, dtype)
    bar = tqdm(
        total=repeats + 2 + scaled,
        desc=f"profiling {graph.model} at batch {profile_batch} on {device_name(device)}",
        unit="run",
        disable=_bar_hidden(progress),
    )
    try:
        times = _median_times(runner, args_fn, repeats, bar.update)
        time_fit = False
        workspace, method = workspace_at(small)
        bar.update(1)
        if scaled:
            other_batch = profile_batch * 2 if profile_batch * 2 <= graph.batch else 1
            other_graph = graph_at(other_batch) if other_batch != profile_batch else None
            if graph.fx is not None and _fits_in_memory(graph, device):
                # Workspace is not linear in the batch (a library picks its blocking by
                # shape): ResNet-50 at 224 px, batch 16, fitted from batches 4 and 8,
                # came out 0.34 MiB under the measured peak. Measure it where it is used.
                workspace, method = workspace_at(graph)
                method += f", at batch {graph.batch}"
                at_batch = every_op
            elif other_graph is not None:
                # A weight reorder does not grow with the batch: fit each op's a + b * batch.
                other, _ = workspace_at(other_graph)
                workspace = _extrapolate(workspace, profile_batch, other, other_batch, graph.batch)
                method += f", fitted a + b*batch from batches {profile_batch} and {other_batch}"
                if graph.fx is not None:
                    alone, too_large = _remeasure_alone(graph, device, workspace, progress)
                    at_batch = set(alone)
                    method += f"; {len(at_batch)} large ops measured alone at batch {graph.batch}"
                    if too_large:
                        names = ", ".join(too_large)
                        method += f"; left as fitted, too large for the memory free: {names}"
            if other_graph is not None:
                # Times: a small batch is dominated by per-op overhead, which a
                # linear scaling would multiply along with the real work.
                other_runner = _OpRunner(other_graph, device)
                other_args = _real_args(model, other_graph, device, dtype)
                other_times = _median_times(other_runner, other_args, repeats, lambda _n: None)
                times = _extrapolate_float(
                    times, profile_batch, other_times, other_batch, graph.batch
                )
                time_fit = True
            bar.update(1)
    except (RuntimeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{graph.model} cannot run in {graph.dtype} on {device_name(device)}: {first}"
        ) from None
    finally:
        bar.close()

    scale = 1.0 if time_fit or not scaled else graph.batch / profile_batch
    from monet_like.variants import algorithm_sites

    algorithms: dict = {}
    if graph.fx is not None and algorithm_sites(graph):
        with torch.no_grad():
            algorithms = _algorithm_options(graph, device, profile_batch, repeats, progress)
        # One figure per convolution op, so that the store-all prediction and the solver's
        # options agree: the step's where it was measured at the solved batch (the
        # options' own may be fitted from small batches), else the options'.
        _aten_options_take(graph, algorithms, workspace, at_batch)
        for i, w in algorithm_workspace(graph, algorithms, {}).items():
            workspace[i] = w
    op_times = [t * scale for t in times]
    nodes = _node_profiles(graph, workspace)  # times: from op_times, by _with_op_times
    result = Profile(
        format=PROFILE_FORMAT,
        model=graph.model,
        fingerprint=graph.fingerprint,
        batch=graph.batch,
        profile_batch=profile_batch,
        scaled=scaled,
        input_shape=graph.input_shape,
        dtype=graph.dtype,
        device=device_name(device),
        torch_version=torch.__version__,
        repeats=repeats,
        workspace_method=method,
        nodes=nodes,
        op_workspace=[(i, w) for i, w in enumerate(workspace) if w > 0],
        profile_seconds=time.perf_counter() - started,
        algorithms=algorithms,
    )
    result = _with_op_times(result, graph, op_times)
    if use_cache:  # a unique temporary file renamed over it: never half a profile
        atomic_write(path, result.to_json())
    return result


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


def _with_op_times(prof: Profile, graph: Graph, op_times: list[float]) -> Profile:
    """`prof` with every time derived from `op_times` (seconds per op index of `graph`):
    each node's forward (and recompute) and backward, and the step's totals."""
    nodes = {n.id: n for n in graph.nodes}
    timed = []
    for n in prof.nodes:
        fwd = sum(op_times[i] for i in nodes[n.node].ops)
        bwd = sum(op_times[i] for i in nodes[n.node].backward_ops)
        timed.append(replace(n, forward_s=fwd, backward_s=bwd, recompute_s=fwd))
    return replace(
        prof,
        nodes=timed,
        op_times_s=list(op_times),
        op_forward_s=sum(op_times[o.index] for o in graph.ops if o.phase == FORWARD),
        op_backward_s=sum(op_times[o.index] for o in graph.ops if o.phase == BACKWARD),
    )


def align_times(prof: Profile, graph: Graph, reference: Profile, captured: Graph) -> Profile:
    """`prof` (of `graph`, the captured graph with variants rewritten in) with its times
    put on the same footing as `reference` (of `captured`), so that the two graphs'
    schedules can be compared by time.

    Two profiles taken minutes apart on a shared machine differ by more than the
    variants change (ResNet-50's store-all step: 24 s in one, 32 s in the next, the same
    kernels). Here every op both graphs run takes the reference's time: the same name and
    aten op, or a convolution rewritten for `conv`, which the step runs with PyTorch's
    own algorithm (the solver scales the other algorithms' times from it). Each op only
    `graph` runs (a variant's) takes its own time times the ratio of the reference's to
    `prof`'s over the common ops: the machine's speed during the one profile against
    the other. A profile without per-op times, or one already aligned to `reference`,
    is returned as it is."""
    n = len(getattr(graph, "ops", ()))
    own, theirs_s = getattr(prof, "op_times_s", ()), getattr(reference, "op_times_s", ())
    if not n or len(own) != n or len(theirs_s) != len(captured.ops):
        return prof
    common = {i: theirs_s[j] for i, j in _counterparts(graph, captured).items()}
    own_common = sum(own[i] for i in common)
    speed = sum(common.values()) / own_common if own_common > 0 else 1.0
    times = [common.get(i, t * speed) for i, t in enumerate(own)]
    if prof.aligned and times == own:
        return prof
    aligned = _with_op_times(prof, graph, times)
    return replace(
        aligned,
        aligned=f"{len(common)} of {n} ops timed as in the captured graph's profile,"
        f" the other {n - len(common)} scaled by {speed:.3f}",
    )


def _counterparts(graph: Graph, captured: Graph) -> dict[int, int]:
    """Op index in `graph` -> index of the op of `captured` (the graph it was rewritten
    from) that does the same work: the same name and aten op, or a `conv` site's
    convolution or its backward, which the profiled step runs with PyTorch's own
    algorithm, mapped to the aten op it replaced. Ops only `graph` runs are absent."""
    theirs = {o.name: o for o in captured.ops}
    same_work = _same_work(graph)
    found = {}
    for o in graph.ops:
        match = theirs.get(o.name)
        if match is None or str(match.target) != str(o.target):
            match = theirs.get(same_work.get(o.name, ""))
        if match is not None:
            found[o.index] = match.index
    return found


def _same_work(graph: Graph) -> dict[str, str]:
    """Ops of `graph` (by name) that run the same kernel as an op of the graph it was
    rewritten from: the convolutions of `conv` sites (PyTorch's algorithm in the step),
    mapped to the aten convolution each replaced."""
    from monet_like.variants import algorithm_sites

    if graph.fx is None:
        return {}
    nodes = {n.name: n for n in graph.fx.graph.nodes}
    found = {}
    for site in algorithm_sites(graph):
        for name in (site["forward"][0], site["backward"]):
            replaced = nodes[name].meta.get("replaces", []) if name in nodes else []
            if replaced:
                found[name] = replaced[0]  # the captured op, before any rewrite
    return found


def derived_profile(
    graph: Graph, captured: Graph, reference: Profile, measured: Profile, measured_graph: Graph
) -> Profile | None:
    """A profile of `graph` (the captured graph with only `conv` rewritten in) built from
    measurements already taken: every op's time and workspace from `reference` (the
    captured graph's profile; a convolution site runs PyTorch's algorithm in the step,
    the kernel the captured op ran), and each convolution's algorithm options from
    `measured`, the profile of `measured_graph`, another rewrite of the same captured
    graph with `conv` in it (the sites matched through the captured op each replaced).
    None when an op of `graph` or one of its sites has no counterpart there.

    The full mode's solve uses it to weigh the convolution algorithms without the
    mode's other variants, without a third profile."""
    ref_times = getattr(reference, "op_times_s", ())
    counterpart = _counterparts(graph, captured)
    if len(ref_times) != len(captured.ops) or len(counterpart) != len(graph.ops):
        return None
    ref_workspace = dict(reference.op_workspace)
    source = [counterpart[o.index] for o in graph.ops]  # the captured op each runs as
    same_work = _same_work(graph)
    # a site's options, keyed by the captured convolution it replaced
    measured_same = _same_work(measured_graph)
    by_captured = {
        measured_same[site_id]: options
        for site_id, options in measured.algorithms.items()
        if site_id in measured_same
    }
    from monet_like.variants import algorithm_sites

    algorithms = {}
    for site in algorithm_sites(graph):
        options = by_captured.get(same_work.get(site["id"], ""))
        if options is None:
            return None
        if site["backward"] and not {"both", "data", "weight"} & set(options):
            # Measured there without its backward (a rewrite that left a site unpaired,
            # as the conv pass once did in MobileNetV2's full mode): options without one
            # would price this graph's backward at nothing. It runs PyTorch's choice.
            continue
        algorithms[site["id"]] = copy.deepcopy(options)
    workspace = [ref_workspace.get(i, 0) for i in source]
    for i, w in algorithm_workspace(graph, algorithms, {}).items():
        workspace[i] = w
    nodes = _node_profiles(graph, workspace)
    derived = replace(
        reference,
        fingerprint=graph.fingerprint,
        nodes=nodes,
        op_workspace=[(i, w) for i, w in enumerate(workspace) if w > 0],
        algorithms=algorithms,
        profile_seconds=0.0,
        aligned="every op timed as in the captured graph's profile; the convolution"
        " algorithms' options from the mode's profile",
        cached=False,
    )
    return _with_op_times(derived, graph, [ref_times[i] for i in source])
