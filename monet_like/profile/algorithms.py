"""Convolution algorithms (conv mode): each site's options timed at or near the solved
batch, their workspace measured or fitted, and the figures the solver reads."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from functools import partial

import torch

from monet_like.graph import Graph
from monet_like.profile.timing import _fastest_interleaved
from monet_like.profile.workspace import _extrapolate, _random_laid_out, _workspace_of


def option(rows: list[list], algo: int) -> tuple[float, int]:
    """(seconds, workspace bytes) of algorithm `algo` among one direction's measured rows."""
    return next((t, ws) for a, t, ws in rows if a == algo)


def backward_option(
    options: dict[str, list[list]], data: int, weight: int, weight_grad_bytes: int = 0
) -> tuple[float, int]:
    """(seconds, workspace bytes) of a convolution's backward with these algorithms: its
    parts run one after the other, data first (times add), except PyTorch's own choice
    for both, one call, measured as such ("both"). Workspace is above the op's outputs:
    the data part's scratch is gone before the weight part allocates the weight's
    gradient (`weight_grad_bytes`), so it counts less that gradient (ResNet-50's 3x3
    convolutions at batch 16: oneDNN's data part alone 10.1 MB, the weight gradient 9.4
    MB, im2col's weight part 4.7 MB; the call's 4.7 MB, not 10.1)."""
    if (data, weight) == (-1, -1) and "both" in options:
        return option(options["both"], -1)
    chosen = (("data", data), ("weight", weight))
    parts = {d: option(options[d], a) for d, a in chosen if d in options}
    seconds = sum(t for t, _ in parts.values())
    if len(parts) == 2:
        return seconds, max(parts["data"][1] - weight_grad_bytes, parts["weight"][1], 0)
    return seconds, max((ws for _, ws in parts.values()), default=0)


def weight_grad_bytes(graph: Graph, forward_op: int) -> int:
    """Bytes of the weight gradient a convolution's backward returns: the weight as its
    forward op reads it. 0 where the graph holds no traced module to read it from (the
    parts' larger workspace then counts whole, an upper bound)."""
    if graph.fx is None:
        return 0
    name = graph.ops[forward_op].name
    node = next((n for n in graph.fx.graph.nodes if n.name == name), None)
    value = node.args[1].meta.get("val") if node is not None and len(node.args) > 1 else None
    if not isinstance(value, torch.Tensor):
        return 0
    return value.numel() * value.element_size()


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
            grad_bytes = weight_grad_bytes(graph, forward_op)
            workspace[backward_op] = backward_option(options, data, weight, grad_bytes)[1]
    return workspace


def _steps_own(directions, forward_op: int, backward_op: int | None) -> list[tuple[str, int]]:
    """(direction, op index) of the options among `directions` whose PyTorch algorithm
    (-1) is the step's own op: the forward, and the backward as the step runs it (both
    parts in one call, or the one part its gradient mask asks for)."""
    steps = [("forward", forward_op)]
    if backward_op is not None:
        parts = [d for d in ("both", "data", "weight") if d in directions]
        if parts and (parts[0] == "both" or len(parts) == 1):
            steps.append((parts[0], backward_op))
    return steps


def _aten_options_take(
    graph: Graph, measured: dict[str, dict[str, list[list]]], workspace: list[int], ops: set[int]
) -> None:
    """Set the workspace of PyTorch's own algorithm (-1) in each convolution site's
    `measured` options to the step's `workspace` at that op, for the op indices in `ops`:
    the forward, and the backward as the step runs it (both parts in one call, or the
    one part its gradient mask asks for)."""
    for _, options, forward_op, backward_op in _measured_sites(graph, measured):
        for direction, i in _steps_own(options, forward_op, backward_op):
            if i in ops:
                for row in options[direction]:
                    if row[0] == -1:
                        row[2] = workspace[i]


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


def _chunk_timing(algo: int, timed_at: int, batch: int) -> tuple[int, int]:
    """(batch, algorithm) a batch-chunk option (algorithm -k) is timed at: itself at the
    solved batch where that costs at most twice the timing batch, else 2 chunks, each as
    large as one of its chunks at the solved batch or as the timing batch where that is
    smaller. A chunk's speed depends on its own size (a few samples fit in cache where
    tens do not), and on a memory-bound layer on the whole call's: ResNet-50 at 184, one
    call over the timing batch, in chunks of a few samples, priced these options up to
    34% low, 2 chunks of their size up to 16% (docs/benchmarks.md)."""
    if batch <= 2 * timed_at:
        return batch, algo
    return 2 * min(max(1, round(batch / -algo)), timed_at), -2


def _timing_calls(
    site: dict,
    nodes: dict,
    timed_at: int,
    batch: int,
    device: torch.device,
    gen,
    built: dict[int, dict] | None = None,
) -> list[tuple[str, int, int, Callable[[], object]]]:
    """(direction, algorithm, batch it runs at, call) of every option of one convolution
    site as the profile times it: at `timed_at`, but for the batch chunks where that is
    not the solved `batch` (`_chunk_timing`). Each time is scaled linearly from its
    own batch to the solved one. The site's calls are built through `built`
    (`_calls_at`), for the caller to reuse."""
    built = {} if built is None else built
    calls = _calls_at(built, site, nodes, timed_at, device, gen)
    timed = [(d, a, timed_at, c) for d, rows in calls.items() for a, c in rows]
    if timed_at == batch:
        return timed
    for i, (direction, algo, _, _) in enumerate(timed):
        if algo <= -2:
            rows, chunked = _chunk_timing(algo, timed_at, batch)
            chunk_calls = _calls_at(built, site, nodes, rows, device, gen)
            timed[i] = (direction, algo, rows, dict(chunk_calls[direction])[chunked])
    return timed


def _calls_at(
    built: dict[int, dict], site: dict, nodes: dict, rows: int, device: torch.device, gen
) -> dict:
    """`_site_calls` at `rows`, kept in `built` (rows -> calls) so that a site's random
    tensors at one batch are drawn once."""
    if rows not in built:
        built[rows] = _site_calls(site, nodes, rows, device, gen)
    return built[rows]


def _site_calls(site: dict, nodes: dict, rows: int, device: torch.device, gen) -> dict:
    """Direction -> [(algorithm, call)] for one convolution site (variants.conv) on random
    tensors of its shapes with `rows` samples: "forward", "data" and "weight" (each part
    of the backward alone, the other part PyTorch's), and "both" (PyTorch's choice for
    the whole backward, one call, as autograd runs it)."""
    ops = torch.ops.monet_like

    def real(node, batch_dim: bool) -> torch.Tensor | None:
        if node is None:
            return None
        return _random_laid_out(node.meta["val"], rows if batch_dim else None, gen, device)

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
        grad = real(nodes[site["backward"]].args[0], True)
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
    in `fitted`, not from their own runs (not run at the second batch: 5 of 13 calls a
    site): where a measured batch had fewer than k samples the call ran one per sample
    there, and its line says nothing of a chunk of batch / k at the solved batch
    (VGG-16's first layers at 4 and 8 gave 0.03 GB for 8 chunks of 22). A chunk runs
    PyTorch's algorithm on batch / k samples, then its result is copied into the whole
    output: the -1 option's line at that batch, plus one chunk's result (the layer's
    output in the forward, its input's gradient in the backward-data part)."""
    rows = {key: i for i, key in enumerate(keys)}
    x_val, y_val = fwd.args[0].meta["val"], fwd.meta["val"]
    result = {"forward": y_val, "data": x_val}
    for (direction, algo), i in rows.items():
        k = -algo
        if algo > -2 or (direction, -1) not in rows:
            continue
        whole = rows[(direction, -1)]
        rows_per_chunk = -(-batch // k)
        (line,) = _extrapolate([ws1[whole]], b1, [ws2[whole]], b2, rows_per_chunk)
        value = result.get(direction)
        chunk_result = 0
        if value is not None:
            chunk_result = value.numel() // value.shape[0] * rows_per_chunk * value.element_size()
        fitted[i] = line + chunk_result


@torch.no_grad()  # kernels run on random tensors: no autograd record
def _algorithm_options(
    graph: Graph,
    device: torch.device,
    profile_batch: int,
    repeats: int,
    progress: bool | None = None,
    tick: Callable[[], None] | None = None,
    measured_ops: set[int] | None = None,
) -> dict[str, dict[str, list[list]]]:
    """Every algorithm of every convolution site (variants.conv), run alone on random
    tensors of the site's shapes: [algorithm, seconds, workspace bytes] at the graph's
    batch. Times: the algorithms of a site run in turn, `repeats` - 1 rounds (at least
    2) after one call each that records its workspace (`_timed_and_measured`), at the
    graph's batch or the largest below it that ALGORITHM_TIMING_FLOPS allows (the batch
    chunks in chunks of their size at the graph's batch: `_timing_calls`), then scaled
    linearly to it (only their ratios are used: problem.AlgorithmChoice).
    Workspace: measured at the graph's batch (in that recorded call where the layer is
    timed there, else in a run of its own where ALGORITHM_WORKSPACE_FLOPS allows), else at the
    timing batch and a second one, fitted as a + b * batch (but for the batch chunks,
    `_fit_chunked`, im2col, in proportion to the batch, and PyTorch's whole backward where
    its op is among `measured_ops`, the op indices whose workspace the step measured at
    the solved batch)."""
    from monet_like.variants import algorithm_sites

    nodes = {n.name: n for n in graph.fx.graph.nodes}
    op_index = {op.name: op.index for op in graph.ops}
    im2col = 0 if device.type == "cpu" else None  # on CUDA, 0 is one of cuDNN's
    gen = torch.Generator(device="cpu").manual_seed(0)
    out: dict[str, dict[str, list[list]]] = {}
    sites = algorithm_sites(graph)
    measured: dict[tuple, dict[str, list[list]]] = {}  # signature -> options
    for site in sites:
        if tick is not None:
            tick()
        signature = _site_signature(site, nodes)
        if signature in measured:  # a repeated block's convolution: the same kernels
            out[site["id"]] = copy.deepcopy(measured[signature])
            continue
        fwd = nodes[site["forward"][0]]
        weight_shape, out_shape = fwd.args[1].meta["val"].shape, fwd.meta["val"].shape
        timed_at = _timing_batch(weight_shape, out_shape, graph.batch, profile_batch)
        built: dict[int, dict] = {}  # rows -> the site's calls there, drawn once
        timing = _timing_calls(site, nodes, timed_at, graph.batch, device, gen, built)
        keys = [(d, a) for d, a, _, _ in timing]
        flat = [c for _, _, _, c in timing]
        # Warmed up first only on CUDA (cuDNN and cuBLAS set up on first calls), but for
        # PyTorch's own at the profile's batch, which the graph's timed runs just ran at
        # these shapes. On CPU each option's first call allocates as its later ones do
        # (all 1,393 options of ResNet-50, GoogLeNet, VGG-16 and MobileNetV2 alike), and a
        # set-up counted would only overstate the workspace.
        warm = [device.type == "cpu" or (a == -1 and timed_at == profile_batch) for _, a in keys]
        seconds, workspace = _timed_and_measured(flat, device, max(repeats - 1, 2), warm)
        seconds = [t * graph.batch / at for t, (_, _, at, _) in zip(seconds, timing, strict=True)]
        if timed_at == graph.batch:
            pass  # measured where it is used (a fit through a smaller batch put chunks 4 kB under)
        elif _conv_flops(weight_shape, out_shape, graph.batch) <= ALGORITHM_WORKSPACE_FLOPS:
            # Measured where it is used (workspace is not linear in the batch), but for
            # im2col (in proportion to the batch, as below), PyTorch's own where the
            # step measured its op there (`_aten_options_take` takes that figure), and a
            # batch chunk timed as itself at the batch (recorded on that call).
            at_batch = _calls_at(built, site, nodes, graph.batch, device, gen)
            step_ops = _steps_own(at_batch, op_index[fwd.name], op_index.get(site["backward"]))
            taken = {(d, -1) for d, i in step_ops if i in (measured_ops or ())}
            there = [c for rows in at_batch.values() for _, c in rows]
            ran_at = [rows for _, _, rows, _ in timing]
            workspace = [
                ws * graph.batch // timed_at if key[1] == im2col
                else 0 if key in taken
                else ws if rows == graph.batch
                else _workspace_of(call, device)
                for key, ws, rows, call in zip(keys, workspace, ran_at, there, strict=True)
            ]  # fmt: skip
        else:
            second = profile_batch if timed_at != profile_batch else min(2 * timed_at, graph.batch)
            if second != timed_at:
                others = _calls_at(built, site, nodes, second, device, gen)
                # Not run there: the batch chunks (`_fit_chunked`); im2col, whose scratch is
                # its columns and copies of its inputs, each a whole batch's (in proportion
                # to it); and the whole backward where the step's own figure at the solved
                # batch replaces it.
                derived = {key for key in keys if key[1] <= -2 or key[1] == im2col}
                if op_index.get(site["backward"]) in (measured_ops or ()):
                    derived.add(("both", -1))
                other_ws = [
                    0 if (d, a) in derived else _workspace_of(c, device)
                    for d, rows in others.items()
                    for a, c in rows
                ]
                fitted = _extrapolate(workspace, timed_at, other_ws, second, graph.batch)
                for i, (_, algo) in enumerate(keys):
                    if algo == im2col:
                        fitted[i] = workspace[i] * graph.batch // timed_at
                _fit_chunked(keys, workspace, timed_at, other_ws, second, fitted, fwd, graph.batch)
                workspace = fitted
        entry: dict[str, list[list]] = {}
        for (direction, algo), t, ws in zip(keys, seconds, workspace, strict=True):
            entry.setdefault(direction, []).append([algo, t, ws])
        out[site["id"]] = measured[signature] = entry
    if progress is not False and len(measured) < len(sites):
        print(f"  {len(sites)} convolution sites, {len(measured)} distinct: each timed once")
    return out


def _timed_and_measured(
    calls: list[Callable[[], object]],
    device: torch.device,
    rounds: int,
    warm: list[bool] | None = None,
) -> tuple[list[float], list[int]]:
    """Each call's seconds, the least of `rounds` interleaved rounds
    (`_fastest_interleaved`), and its workspace, recorded on one call before them; the
    calls not `warm` are first run once more, unrecorded, so that a library's set-up on
    a first call is not taken for the call's workspace. The recorded call is not timed:
    recording made ResNet-50's options a third slower (median over 294), where a plain
    call's first timed round after it was 9% over their least of six."""
    warm = warm or [False] * len(calls)
    for call, ready in zip(calls, warm, strict=True):
        if not ready:
            call()
    workspace = [_workspace_of(call, device) for call in calls]
    return _fastest_interleaved(calls, device, rounds, warm_up=False), workspace


def _site_signature(site: dict, nodes: dict) -> tuple:
    """What a convolution site's algorithm options depend on: its input, weight, bias and
    incoming gradient as laid out in the graph (shape, strides, dtype), its geometry and
    which gradients its backward computes. Sites alike in all of it run the same kernels
    on the same shapes, and are measured once."""

    def laid_out(node) -> tuple | None:
        if not isinstance(node, torch.fx.Node):
            return None
        value = node.meta["val"]
        return tuple(value.shape), tuple(value.stride()), value.dtype

    x_node, w_node, b_node, *geometry = nodes[site["forward"][0]].args
    backward = nodes[site["backward"]] if site["backward"] else None
    return (
        laid_out(x_node),
        laid_out(w_node),
        laid_out(b_node),
        tuple(tuple(g) if isinstance(g, list) else g for g in geometry),
        None if backward is None else (laid_out(backward.args[0]), tuple(backward.args[7])),
    )
