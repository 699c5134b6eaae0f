"""Workspace: the bytes an op allocates while it runs above what it returns, from the
CPU allocator's events or the CUDA allocator's peak; fitted over the batch where the
solved batch does not fit, and the ops then measured (and timed) alone there."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from monet_like.graph import Graph, written_args
from monet_like.memory import allocation_peak, record_allocations, store_all_peak
from monet_like.profile.timing import _OpRunner


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


# Ops run alone at the solved batch (`_remeasure_alone`) are timed as well: the call
# whose allocations are recorded, and where it took less than this many seconds (the
# recording's own cost, under a millisecond a call, would show) the median of
# ALONE_REPEATS plain calls after it.
ALONE_REPEAT_BELOW = 0.02
ALONE_REPEATS = 3

# Each op runs alone once, so a slow spell while they run goes into their times unseen
# by the timed runs' spread. At the end of a pass its first ALONE_CHECK_OPS ops of at
# least ALONE_CHECK_LEAST_S each (more, up to ALONE_CHECK_SHARE of the pass's seconds)
# are timed again (`_check_alone`). Quiet, pass against pass: within 3% at 4 ops and 2% at
# 8 on ResNet-50 (64 px, 16), 13% and 9% on GoogLeNet (112 px, 8); a first pass ran 6%
# slower than later ones there (oneDNN sets up a kernel at its shapes' first call).
ALONE_CHECK_OPS = 6
ALONE_CHECK_SHARE = 0.05
ALONE_CHECK_LEAST_S = 0.002
# Their drift beyond this: the pass's times are unsure. Where the pass ran the slower,
# every op in it is timed again and keeps the lesser of its two times, and the first ops
# are timed a third time: kept times within this of it stand (a slow start, repaired).
ALONE_DRIFT = 0.15
# A spell later in the pass shows as other processes' CPU time while it ran (/proc/stat's
# busy time, the host's steal included, less this process's), over windows of at least
# CONTENTION_WINDOW_S. As a share of the machine: under 1% quiet on this project's 2-core
# CPU, 35% beside one busy process, 50% beside two. The ops of a window above
# CONTENDED_SHARE are timed again at the end of the pass, each keeping its lesser time;
# where that runs contended too (a machine busy throughout), it stops and says so.
CONTENTION_WINDOW_S = 0.5
CONTENDED_SHARE = 0.2


def _others_cpu_s() -> float | None:
    """The machine's busy CPU seconds (all cores, steal included) less this process's:
    differences of it are other work's CPU time. None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    own = os.times()
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return busy - own.user - own.system


def _others_share(start: tuple[float, float], end: tuple[float, float]) -> float:
    """The share of the machine other work took between two (wall seconds,
    `_others_cpu_s`) readings."""
    wall = end[0] - start[0]
    return (end[1] - start[1]) / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0


def _contended(marks: list[tuple]) -> set[tuple]:
    """The signatures run in windows where other work took more than CONTENDED_SHARE
    of the machine. `marks`: (signature or None, wall seconds, `_others_cpu_s`) before the
    first op and after each, in order."""
    found: set[tuple] = set()
    start, window = marks[0], []
    for i, mark in enumerate(marks[1:], 1):
        window.append(mark[0])
        wall = mark[1] - start[1]
        last = i == len(marks) - 1
        if wall > 0 and (wall >= CONTENTION_WINDOW_S or (last and wall >= CONTENTION_WINDOW_S / 5)):
            if _others_share(start[1:], mark[1:]) > CONTENDED_SHARE:
                found.update(s for s in window if s is not None)
            start, window = mark, []
    return found


# The share of the free memory an op measured alone may take (inputs, outputs, fitted
# workspace); the rest is the margin for a real workspace above the fitted one.
REMEASURE_MEMORY_SHARE = 0.8


def _node_inputs(node) -> list:
    """The values (meta "val") of the fx nodes among `node`'s arguments."""
    return [a.meta.get("val") for a in _input_nodes(node)]


def _input_nodes(node) -> list:
    """The fx nodes among `node`'s arguments, in order."""
    from torch.fx.node import Node, map_aggregate

    found: list = []
    map_aggregate(
        (node.args, node.kwargs), lambda a: found.append(a) if isinstance(a, Node) else None
    )
    return found


def _random_laid_out(
    meta: torch.Tensor,
    rows: int | None,
    gen: torch.Generator,
    device: torch.device,
    arena: _InputArena | None = None,
) -> torch.Tensor:
    """Random values of `meta`'s shape (its first dimension `rows` long, if given) laid out
    in memory as the graph's value is: a kernel copies an input that is not contiguous, and
    that copy is part of the workspace measured. The strides are the graph's: its dimension
    order (a channels-last input takes other algorithms), the gaps of a slice of a larger
    tensor (ViT's patch-embedding gradient, a view of the token sequence, which the im2col
    backward copies: 48 KiB above the prediction where a dense one had been measured),
    and stride 0 where the value is broadcast (the gradient of a sum reaching a network's
    last convolution, copied whole in each part of the im2col backward). In `arena`'s
    buffer where given, else in a storage of its own."""
    shape = list(meta.shape) if rows is None else [rows, *meta.shape[1:]]
    stride = list(meta.stride())
    if rows is not None and rows > meta.shape[0] and meta.dim() > 1:
        # more rows than the graph's strides were laid out for: the same dimension order,
        # without gaps (overlapping memory otherwise)
        order = sorted(range(meta.dim()), key=lambda d: stride[d])
        step = 1
        for d in order:
            stride[d] = 0 if meta.stride(d) == 0 else step
            step *= shape[d] if meta.stride(d) else 1
    expanded = [d for d in range(meta.dim()) if stride[d] == 0 and shape[d] > 1]
    stored = [1 if d in expanded else n for d, n in enumerate(shape)]
    if arena is None:
        value = torch.empty_strided(stored, stride, dtype=meta.dtype, device=device)
        _fill_normal(value, gen)
    else:
        value = arena.take(stored, stride, meta.dtype)
        if not arena.holds_pool(value):  # else random already: an earlier op's inputs
            _fill_normal(value, gen)
            arena.filled(value)
    return value.expand(shape) if expanded else value


# Random inputs repeat one pool of this many normal values: drawing every value of the
# large ops' inputs at the solved batch (hundreds of MB each) took 15 s of ResNet-50's
# (184) cold profile, and a kernel's workspace and speed do not depend on which values
# it reads.
RANDOM_POOL = 1 << 20


def _fill_normal(value: torch.Tensor, gen: torch.Generator) -> None:
    """Set every element of the storage span `value` covers (a strided layout's gaps
    too) to normal random values drawn from `gen` on the CPU (a mask: true where the
    draw is positive): above RANDOM_POOL of them, one pool (drawn once per process)
    repeated, written in one pass (drawing the values whole, then copying them in, took
    half a second per large op's inputs: 0.5 of the 1.3 s of a ResNet-50 (184) weight
    gradient measured alone)."""
    n = _span(value.shape, value.stride())
    flat = torch.empty(0, dtype=value.dtype, device=value.device)
    flat.set_(value.untyped_storage(), value.storage_offset(), (n,), (1,))
    if n >= RANDOM_POOL:
        pool = _pool(value.dtype, value.device, gen)
    else:
        pool = _drawn(n, value.dtype, gen).to(value.device)
    repeats, rest = divmod(n, pool.numel()) if n else (0, 0)
    if repeats:
        flat[: repeats * pool.numel()].view(repeats, -1).copy_(pool.expand(repeats, -1))
    if rest:
        flat[repeats * pool.numel() :].copy_(pool[:rest])


_POOLS: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> RANDOM_POOL values


def _pool(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """RANDOM_POOL normal values of `dtype` (a mask: true where positive), drawn from `gen`
    once per process: drawing them for each large input took 10 ms."""
    key = (dtype, str(device))
    if key not in _POOLS:
        _POOLS[key] = _drawn(RANDOM_POOL, dtype, gen).to(device)
    return _POOLS[key]


def _drawn(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """`n` normal values of `dtype` drawn from `gen` on the CPU (a mask: true where the
    draw is positive)."""
    if dtype == torch.bool:
        return torch.randn(n, generator=gen) > 0
    return torch.randn(n, generator=gen, dtype=dtype)


def _span(shape, stride) -> int:
    """Elements of storage a tensor of this shape and stride covers."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))


# Offsets in the arena: PyTorch's CPU allocator aligns each allocation so.
ARENA_ALIGNMENT = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ARENA_ALIGNMENT) * ARENA_ALIGNMENT


class _InputArena:
    """One buffer that the random inputs of the ops run alone are laid out in, op after
    op: fresh memory is paged in at its first write, 0.1 s more per 564 MiB on this
    machine, and the inputs of ResNet-50's (184) large ops are tens of GB in all."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.empty(0, dtype=torch.uint8, device=device)
        self.used = 0
        # The buffer's bytes [0, pool_end) hold random values of pool_dtype that no op
        # has written since: an input laid out within them is not written again (the
        # inputs' writing was 5.6 of the 39 s of ResNet-50's ops alone at 184).
        self.pool_end = 0
        self.pool_dtype: torch.dtype | None = None

    @staticmethod
    def nbytes_for(values: list[torch.Tensor]) -> int:
        """Bytes `take` uses for tensors laid out as `values`, one after the other."""
        return sum(_aligned(_span(v.shape, v.stride()) * v.element_size()) for v in values)

    def reset(self, nbytes: int) -> None:
        """Start again at the buffer's beginning, with room for `nbytes` (a larger
        buffer replaces it where it has less)."""
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)  # freed first
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.pool_end = 0
        self.used = 0

    def _bytes(self, value: torch.Tensor) -> tuple[int, int]:
        start = value.storage_offset() * value.element_size()
        return start, start + _span(value.shape, value.stride()) * value.element_size()

    def holds_pool(self, value: torch.Tensor) -> bool:
        """Whether `value` (taken here) lies within random values of its dtype."""
        return value.dtype == self.pool_dtype and self._bytes(value)[1] <= self.pool_end

    def filled(self, value: torch.Tensor) -> None:
        """`value` (taken here) was just filled with random values."""
        start, end = self._bytes(value)
        if value.dtype == self.pool_dtype and start <= self.pool_end:
            self.pool_end = max(self.pool_end, end)  # the run goes on
        elif start == 0:
            self.pool_end, self.pool_dtype = end, value.dtype  # a run of another dtype
        else:  # another dtype (a mask) inside the run ends it there
            self.pool_end = min(self.pool_end, start)

    def written(self) -> None:
        """An op wrote into its inputs here: none of them holds random values now."""
        self.pool_end = 0

    def take(self, shape, stride, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of this shape, stride and dtype in the buffer, after those taken."""
        size = dtype.itemsize
        nbytes = _span(shape, stride) * size
        if self.used + nbytes > self.buffer.numel():
            raise RuntimeError("input arena too small: reset it with the op's input bytes")
        value = torch.empty(0, dtype=dtype, device=self.device)
        value.set_(self.buffer.untyped_storage(), self.used // size, tuple(shape), tuple(stride))
        self.used += _aligned(nbytes)
        return value


def _workspace_alone(
    node,
    device: torch.device,
    gen: torch.Generator,
    arena: _InputArena | None = None,
    at: BatchRows | None = None,
) -> tuple[int, float]:
    """Workspace of `node`'s op run once by itself on random inputs of its shapes (in
    `arena`, where given: the inputs are allocated before the op and not counted), and
    the seconds the call took (its inputs' writing not counted). `at`: the inputs' and
    outputs' first dimensions at a smaller batch to run it at instead."""
    from torch.fx.node import Node, map_aggregate

    if arena is not None:
        arena.reset(arena.nbytes_for([v for v in _node_inputs(node) if v is not None]))

    def real(a):  # laid out as in the graph, broadcast (stride 0) values included
        if not isinstance(a, Node):
            return a
        rows = None if at is None else at.inputs.get(a.name)
        return _random_laid_out(a.meta["val"], rows, gen, device, arena)

    args, kwargs = map_aggregate((node.args, node.kwargs), real)
    seconds, shapes = [], []

    def call():
        started = time.perf_counter()
        out = node.target(*args, **kwargs)
        seconds.append(time.perf_counter() - started)
        shapes.append(_shapes(out))
        return out

    if arena is not None and _writes_inputs(node):
        arena.written()
    workspace = _workspace_of(call, device)
    if shapes[0] != (_shapes(node.meta.get("val")) if at is None else at.outputs):
        # a result shaped by the values (a random mask selecting): not the graph's op
        raise RuntimeError(f"{node.target} alone returned other shapes than in the graph")
    if seconds[0] < ALONE_REPEAT_BELOW:
        seconds.clear()
        for _ in range(ALONE_REPEATS):
            call()  # its result is dropped before the next call
        return workspace, statistics.median(seconds)
    return workspace, seconds[0]


# Where the solved batch is large, an op whose scratch no library sizes by shape is run
# alone at an ALONE_REDUCTION-th of it (when that is at least ALONE_REDUCED_LEAST samples,
# each input far beyond the caches) and its time scaled: ResNet-50's (184) ops other than
# convolutions took 4.08 s at 46 so scaled against 4.17 s at 184, in a quarter of the time.
# Its workspace is the line through the profile's batch and that one.
ALONE_REDUCTION = 4
ALONE_REDUCED_LEAST = 16


def reduced_batch(batch: int, profile_batch: int) -> int | None:
    """The smaller batch the ops `_sized_by_shape` leaves out are run alone at, if any."""
    reduced = batch // ALONE_REDUCTION
    return reduced if reduced >= max(ALONE_REDUCED_LEAST, 2 * profile_batch) else None


def _sized_by_shape(node) -> bool:
    """Whether `node`'s op calls a library that picks its algorithm, and with it its
    scratch, by the shapes (convolutions: oneDNN, cuDNN), so that its workspace is
    measured where it is used: ResNet-50's (184) last convolution's weight gradient alone
    took 7.5 MB of scratch at batch 184, 148 MB at 46."""
    name = str(node.target)
    return any(word in name for word in ("conv", "mkldnn", "cudnn"))


@dataclass(frozen=True)
class BatchRows:
    """An op's run at a smaller `batch`: the first dimension there of each input that
    carries the batch (by fx node name), and its outputs' shapes and dtypes (`_shapes`)."""

    batch: int
    inputs: dict[str, int]
    outputs: list


def _batch_rows(node, small_node, batch: int, small_batch: int, reduced: int) -> BatchRows | None:
    """`node`'s op (in the graph at `batch`) run at `reduced`, read from its counterpart
    in the graph at `small_batch` (`small_node`): a value whose first dimension differs
    between the two carries the batch there, in proportion. None where another dimension
    differs, where the arguments other than tensors differ (a size that spells the batch),
    where a size is not in proportion, or where no input carries the batch."""
    from torch.fx.node import Node, map_aggregate

    def others(n) -> str:
        return repr(map_aggregate((n.args, n.kwargs), lambda a: None if isinstance(a, Node) else a))

    if small_node is None or others(node) != others(small_node):
        return None

    def rows(big, small) -> int | None:
        """The first dimension at `reduced` (-1: not in proportion; None: no batch)."""
        if not isinstance(big, torch.Tensor) or not isinstance(small, torch.Tensor):
            return None if type(big) is type(small) else -1
        if big.shape == small.shape:
            return None
        n = big.shape[0] if big.dim() else 0
        if big.shape[1:] != small.shape[1:] or n * small_batch != small.shape[0] * batch:
            return -1
        return -1 if (n * reduced) % batch else n * reduced // batch

    leaves = torch.utils._pytree.tree_leaves
    big_in, small_in = _input_nodes(node), _input_nodes(small_node)
    big_out, small_out = leaves(node.meta.get("val")), leaves(small_node.meta.get("val"))
    if len(big_in) != len(small_in) or len(big_out) != len(small_out):
        return None
    inputs: dict[str, int] = {}
    for big, small in zip(big_in, small_in, strict=True):
        found = rows(big.meta.get("val"), small.meta.get("val"))
        if found == -1:
            return None
        if found is not None:
            inputs[big.name] = found
    if not inputs:
        return None
    outputs = []
    for big, small in zip(big_out, small_out, strict=True):
        found = rows(big, small)
        if found == -1:
            return None
        if isinstance(big, torch.Tensor):
            shape = tuple(big.shape) if found is None else (found, *big.shape[1:])
            outputs.append((shape, big.dtype))
        else:
            outputs.append(None)
    return BatchRows(reduced, inputs, outputs)


def _writes_inputs(node) -> bool:
    """Whether `node`'s op writes into one of its inputs (an op without a schema is
    taken to)."""
    return getattr(node.target, "_schema", None) is None or bool(written_args(node))


def _shapes(value) -> list:
    """The shape and dtype of each tensor in `value` (nested), in order."""
    return [
        (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
        for v in torch.utils._pytree.tree_leaves(value)
    ]


@dataclass
class AloneRuns:
    """Ops measured alone, by `_op_signature`: a repeated block's ops, and the ops the
    captured graph shares with its variants' graph (profiled in turn with one `captures`),
    are run once (half of a cold ResNet-50 (184) profile went to these runs). Kept per
    profile or per `captures`, not per process: a profile taken afresh measures afresh."""

    # None: it failed on random inputs
    workspace: dict[tuple, int | None] = field(default_factory=dict)
    seconds: dict[tuple, float] = field(default_factory=dict)  # the same runs' seconds
    reduced: dict[tuple, int] = field(default_factory=dict)  # those run at a smaller batch
    check: AloneCheck | None = None  # the last pass's check (`_check_alone`), if one ran


@dataclass(frozen=True)
class AloneCheck:
    """A pass of ops alone checked at its end (`_check_alone`)."""

    ops: int  # its first ops timed again (0: too few to tell)
    first_s: float  # their seconds in the pass
    again_s: float  # their seconds timed again
    contended: int = 0  # its ops run while other work took over CONTENDED_SHARE
    retimed: int = 0  # its ops timed again, each keeping its lesser time
    busy: bool = False  # the timing again ran contended too, and stopped
    # where the pass was timed again whole: how much slower its first ops' kept times
    # were than those ops timed a third time after it (None: not timed again whole)
    after: float | None = None

    @property
    def drift(self) -> float | None:
        """How much slower the pass ran its first ops than the check (negative: faster)."""
        return self.first_s / self.again_s - 1 if self.ops and self.again_s > 0 else None

    @property
    def settled(self) -> bool:
        """Whether the pass, slow at first, was timed again whole and its kept times held
        when its first ops were timed a third time: a slow spell at its start, repaired."""
        return drift_repaired(self.after)


def drift_repaired(after: float | None) -> bool:
    """Whether a pass of ops alone timed again whole held when its first ops were timed a
    third time (`after`, `AloneCheck.after`: within ALONE_DRIFT)."""
    return after is not None and abs(after) <= ALONE_DRIFT


def alone_runs_of(captures: dict | None) -> AloneRuns:
    """The `AloneRuns` shared through `captures` (a new one where there is none)."""
    if captures is None:
        return AloneRuns()
    return captures.setdefault("ops alone", AloneRuns())


def _op_signature(node, device: torch.device) -> tuple:
    """What an op's workspace alone depends on: its target, its tensor arguments as laid
    out (shape, strides, dtype) and its other arguments, on this device."""
    from torch.fx.node import Node, map_aggregate

    def laid_out(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), tuple(v.stride()), str(v.dtype))
        return repr(v)

    def described(a):
        if isinstance(a, Node):
            return torch.utils._pytree.tree_map(laid_out, a.meta.get("val"))
        return repr(a)

    target, args = _same_call(node)
    args = map_aggregate((args, node.kwargs), described)
    return (target, repr(args), str(device), torch.__version__)


def _same_call(node) -> tuple[str, tuple]:
    """`node`'s target and arguments, with a convolution that the conv mode rewrote and
    left at PyTorch's algorithm (-1) spelled as the aten op it calls, so that the captured
    graph and the variants' graph share the measurement (the backward only without a bias
    gradient: the rewritten op computes that one apart)."""
    target, args = str(node.target), tuple(node.args)

    def plain(*values):
        return tuple(list(v) if isinstance(v, (list, tuple)) else v for v in values)

    if target == "aten.convolution.default" and len(args) == 9:
        x, w, b, stride, padding, dilation, transposed, output_padding, groups = args
        if not transposed and not any(output_padding):
            return "conv2d", plain(x, w, b, stride, padding, dilation, groups)
    if target == "monet_like.conv2d_algo.default" and args[-1] == -1:
        return "conv2d", plain(*args[:-1])
    if target == "aten.convolution_backward.default" and len(args) == 11:
        grad, x, w, _, stride, padding, dilation, transposed, output_padding, groups, mask = args
        if not transposed and not any(output_padding) and not mask[2]:
            return "conv2d_backward", plain(grad, x, w, stride, padding, dilation, groups, mask)
    if target == "monet_like.conv2d_backward_algo.default" and tuple(args[-2:]) == (-1, -1):
        if not args[7][2]:
            return "conv2d_backward", plain(*args[:-2])
    return target, args


def _remeasure_alone(
    graph: Graph,
    device: torch.device,
    workspace: list[int],
    tick: Callable[[], None] | None = None,
    seconds: dict[int, float] | None = None,
    workspace_too: bool = True,
    runs: AloneRuns | None = None,
    small: Graph | None = None,
    small_workspace: list[int] | None = None,
) -> tuple[list[int], list[str]]:
    """Run each op that computes or writes in place alone at `graph`'s batch, on random
    inputs of its shapes (ops alike, by `_op_signature`, once in `runs`): its
    workspace replaces the figure in `workspace` (fitted from smaller batches) where
    `workspace_too`, and `seconds`, where given, receives its time. An op is left as it
    was when an input is not a tensor of floats or booleans (random indices could be
    invalid), when its inputs, outputs and `workspace` figure would take more than
    REMEASURE_MEMORY_SHARE of the memory free just before it, or when it fails on random
    inputs or returns other shapes than in the graph. Where `small` (the graph at the
    profile's batch, each op's workspace there `small_workspace`) is given and
    `reduced_batch` allows, an op not `_sized_by_shape` runs at that smaller batch
    instead: its time scaled, its workspace the line through the two batches. Returns
    the indices measured, and the names of the ops left for lack of memory."""
    if device.type != "cpu" or _available_memory_bytes() is None:
        return [], []
    gen = torch.Generator(device="cpu").manual_seed(0)
    arena = _InputArena(device)
    runs = AloneRuns() if runs is None else runs
    reduced = None if small_workspace is None else reduced_batch(graph.batch, small.batch)
    small_nodes = {} if reduced is None else {n.name: n for n in small.fx.graph.nodes}
    too_large: list[str] = []
    found: list[tuple[int, tuple]] = []  # (op index, signature) of each op run or alike
    calls: dict[tuple, tuple] = {}  # signature -> (node, at, scale): this pass's own runs
    others = _others_cpu_s()
    marks = [] if others is None else [(None, time.perf_counter(), others)]
    for op, node, signature in _alone_ops(graph, device):
        if tick is not None:
            tick()
        if signature not in runs.workspace:
            at = None
            if reduced is not None and not _sized_by_shape(node):
                counterpart = small_nodes.get(small.ops[op.index].name)
                at = _batch_rows(node, counterpart, graph.batch, small.batch, reduced)
            share = 1.0 if at is None else at.batch / graph.batch
            touched = sum(graph.storages[i].nbytes for i in {*op.reads, *op.outputs})
            # Read per op: what other processes hold moves. Was half of what was free before
            # the first op, which left VGG-16's (176) largest backward (10.5 GiB with its
            # fitted scratch, on a 24 GB machine) fitted at twice its scratch in some runs.
            free = (_available_memory_bytes() or 0) + arena.buffer.numel()  # reused
            if share * (touched + workspace[op.index]) > REMEASURE_MEMORY_SHARE * free:
                too_large.append(op.name)
                continue
            try:
                bytes_alone, seconds_there = _workspace_alone(node, device, gen, arena, at)
            except (RuntimeError, NotImplementedError):
                runs.workspace[signature] = None  # fails on random inputs: as fitted
            else:
                if marks:
                    marks.append((signature, time.perf_counter(), _others_cpu_s() or 0.0))
                scale = 1.0 if at is None else graph.batch / at.batch
                if at is not None:
                    (bytes_alone,) = _extrapolate(
                        [small_workspace[op.index]],
                        small.batch,
                        [bytes_alone],
                        at.batch,
                        graph.batch,
                    )
                    runs.reduced[signature] = at.batch
                runs.workspace[signature] = bytes_alone
                runs.seconds[signature] = seconds_there * scale
                calls[signature] = (node, at, scale)
        if runs.workspace[signature] is not None:
            found.append((op.index, signature))
    if calls:
        contended = _contended(marks) if len(marks) > 1 else set()
        check = _check_alone(calls, runs, device, gen, arena, tick, contended)
        if check.ops or check.contended or runs.check is None:  # else the last pass's
            runs.check = check
    for index, signature in found:
        if workspace_too:
            workspace[index] = runs.workspace[signature]
        if seconds is not None and signature in runs.seconds:
            seconds[index] = runs.seconds[signature]
    return [index for index, _ in found], too_large


def _check_alone(
    calls: dict[tuple, tuple],
    runs: AloneRuns,
    device: torch.device,
    gen: torch.Generator,
    arena: _InputArena,
    tick: Callable[[], None] | None = None,
    contended: set[tuple] | None = None,
) -> AloneCheck:
    """Check a pass of ops alone at its end (`calls`, signature -> (node, at, scale), in
    the order run; their times in `runs.seconds`): its first ALONE_CHECK_OPS ops of at
    least ALONE_CHECK_LEAST_S, and more up to ALONE_CHECK_SHARE of the pass's seconds, are
    timed again (none where it has too few such ops to tell a slow spell from an op's own
    noise). Where the pass ran them more than ALONE_DRIFT slower, every op of the pass is
    timed again, else those run while other work took the machine (`contended`); each
    keeps the lesser of its two times in `runs.seconds`. A pass timed again whole has its
    first ops timed a third time after it, to tell whether the kept times hold."""

    def again(signature) -> float | None:
        node, at, scale = calls[signature]
        try:
            return _workspace_alone(node, device, gen, arena, at)[1] * scale
        except (RuntimeError, NotImplementedError):  # other random values: left as timed
            return None

    contended = {s for s in contended or () if s in calls}
    total = sum(runs.seconds[s] for s in calls)
    sample: list[tuple] = []
    for signature in calls:
        covered = sum(runs.seconds[s] for s in sample)
        if len(sample) >= ALONE_CHECK_OPS and covered >= ALONE_CHECK_SHARE * total:
            break
        if runs.seconds[signature] >= ALONE_CHECK_LEAST_S:
            sample.append(signature)
    timed_again = {s: again(s) for s in sample} if len(sample) >= ALONE_CHECK_OPS else {}
    kept = [s for s in timed_again if timed_again[s] is not None]
    if len(kept) < ALONE_CHECK_OPS:
        kept, timed_again = [], {}
    first_s = sum(runs.seconds[s] for s in kept)
    again_s = sum(timed_again[s] for s in kept)
    slow = bool(kept) and again_s > 0 and first_s / again_s - 1 > ALONE_DRIFT
    retimed, busy = 0, False
    others = _others_cpu_s()
    start = (time.perf_counter(), others)
    for signature in calls if slow else [s for s in calls if s in contended]:
        if tick is not None:
            tick()
        seconds = timed_again[signature] if signature in timed_again else again(signature)
        if seconds is not None:
            runs.seconds[signature] = min(runs.seconds[signature], seconds)
            retimed += 1
        wall = time.perf_counter() - start[0]
        if others is not None and wall > 0 and wall >= CONTENTION_WINDOW_S:
            now = (time.perf_counter(), _others_cpu_s() or 0.0)
            if _others_share(start, now) > CONTENDED_SHARE:  # busy now too: gains nothing
                busy = True
                break
            start = now
    after = None
    if slow and not busy:
        third = {s: again(s) for s in kept}
        held = [s for s in kept if third[s] is not None]
        third_s = sum(third[s] for s in held)
        if len(held) >= ALONE_CHECK_OPS and third_s > 0:
            after = sum(runs.seconds[s] for s in held) / third_s - 1
    return AloneCheck(len(kept), first_s, again_s, len(contended), retimed, busy, after)


def _alone_ops(graph: Graph, device: torch.device):
    """(op, its fx node, `_op_signature`) of each op that computes or writes in place and
    whose inputs are all floating-point or boolean tensors (random indices could be
    invalid; a random mask is a mask): the ops `_remeasure_alone` runs, in order."""
    nodes = {n.name: n for n in graph.fx.graph.nodes}
    for op in graph.ops:
        if op.role == "view":
            continue
        node = nodes[op.name]
        inputs = _node_inputs(node)
        if all(_random_fits(v) for v in inputs):
            yield op, node, _op_signature(node, device)


def _random_fits(value) -> bool:
    """Whether random values can stand for `value` (a tensor of floats or booleans)."""
    return isinstance(value, torch.Tensor) and (
        value.dtype.is_floating_point or value.dtype == torch.bool
    )


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
