"""The memory model: what one training step holds, predicted, simulated and measured.

Three independent ways to get the peak of a step, so that each checks the others:

- `store_all_peak(graph)`: predicted from the captured graph alone, by walking its
  ops in order with every storage alive from the op that allocates it to its last
  reader (placeholders for the whole step, gradients to its end).
- `simulate(...)`: an eager training step run on fake tensors (exact bytes, no
  allocation, any batch size) under a live-storage tracker.
- `measure(...)`: the real peak of a real step. CPU: the same live-storage tracker
  on real tensors (every storage counted once however many views it has); CUDA:
  the caching allocator's statistics.

All sizes are bytes (int).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from monet_like.graph import (
    BUFFER,
    GRADIENT,
    INPUT,
    PARAM,
    SEED,
    Graph,
    default_loss,
    fake_like,
    kernel_nbytes,
)
from monet_like.streams import silenced


@dataclass(frozen=True)
class FixedBytes:
    """What every schedule holds, whatever it keeps or recomputes."""

    params: int
    buffers: int
    grads: int
    input: int

    @property
    def total(self) -> int:
        return self.params + self.buffers + self.grads + self.input


def fixed_bytes(graph: Graph) -> FixedBytes:
    return FixedBytes(graph.param_bytes, graph.buffer_bytes, graph.grad_bytes, graph.input_bytes)


@dataclass(frozen=True)
class Timeline:
    """Live bytes during each op of the joint graph under the store-all schedule."""

    live: list[int]  # live[i]: bytes alive while op i runs (its inputs, outputs, workspace)
    peak_bytes: int
    peak_op: int  # index of the op at which the peak is reached


def last_uses(graph: Graph) -> list[int]:
    """For each storage, the index of the last op that reads or writes it (-1: none)."""
    last = [-1] * len(graph.storages)
    for op in graph.ops:
        for s in (*op.reads, *op.outputs):
            last[s] = op.index
    return last


def store_all_timeline(graph: Graph, workspace: dict[int, int] | None = None) -> Timeline:
    """Walk the ops with the store-everything schedule eager PyTorch runs.

    `workspace` optionally maps an op index to transient bytes it needs while it runs.
    Where the loop holds the model's outputs (`graph.outputs_held`), they live to the
    step's end, as gradients do.
    """
    n_ops = len(graph.ops)
    delta = [0] * (n_ops + 1)  # difference array over op indices
    always = 0
    last = last_uses(graph)
    alloc_at = [-1] * len(graph.storages)
    for op in graph.ops:
        for s in op.allocates:
            alloc_at[s] = op.index
    to_the_end = held_outputs(graph)
    for s in graph.storages:
        if s.kind in (PARAM, BUFFER, INPUT, SEED):
            always += s.nbytes
        elif alloc_at[s.id] >= 0:
            end = n_ops if s.kind == GRADIENT or s.id in to_the_end else last[s.id] + 1
            delta[alloc_at[s.id]] += s.nbytes
            delta[end] -= s.nbytes
    live, running = [], always
    for i in range(n_ops):
        running += delta[i]
        live.append(running + (workspace or {}).get(i, 0))
    peak_op = max(range(n_ops), key=live.__getitem__) if live else 0
    return Timeline(live, live[peak_op] if live else always, peak_op)


def held_outputs(graph: Graph) -> frozenset[int]:
    """The activation storages the training loop holds to the step's end: the model's
    outputs, where `graph.outputs_held`."""
    return frozenset(graph.output_storages) if graph.outputs_held else frozenset()


def store_all_peak(graph: Graph, workspace: dict[int, int] | None = None) -> int:
    """Predicted peak bytes of one eager training step (everything stored)."""
    return store_all_timeline(graph, workspace).peak_bytes


# -- live-storage tracking ------------------------------------------------------------


class LiveStorageTracker(TorchDispatchMode):
    """Counts the bytes of every storage created by an aten op, until it is freed.

    A storage is counted once however many tensors view it; its release is seen
    through a weak reference, at the moment its last tensor dies.
    """

    def __init__(self, live: Iterable[torch.Tensor] = ()) -> None:
        """`live`: tensors alive before tracking starts; counted from the start, so a
        view of one of them (a parameter's `.t()`) is not taken for a new storage."""
        super().__init__()
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        for t in live:
            self.track(t)
        self.baseline = self.current

    def _forget(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def track(self, t: torch.Tensor, nbytes: int | None = None) -> None:
        st = t.untyped_storage()
        key = st._cdata
        size = int(st.nbytes()) if nbytes is None else nbytes
        old = self._sizes.get(key)
        if old is None:
            self._refs[key] = weakref.ref(st, lambda _r, k=key: self._forget(k))
            self._sizes[key] = size
            self.current += size
        elif size > old:  # resized in place by an out= kernel (storages only grow)
            self._sizes[key] = size
            self.current += size - old
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for i, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor):
                self.track(t, kernel_nbytes(func, args, i, t))
        return out


@dataclass(frozen=True)
class Measurement:
    peak_bytes: int  # peak of everything alive during the step, baseline included
    baseline_bytes: int  # alive before the step (parameters, buffers, input)
    method: str  # "live-storage" or "cuda-allocator"


def measure(
    step_fn: Callable[[], object],
    live: Iterable[torch.Tensor] = (),
    device: str | torch.device = "cpu",
) -> Measurement:
    """The real peak memory of `step_fn()`.

    `live` are the tensors alive before the step (parameters, buffers, the input);
    on CPU they form the baseline, on CUDA the allocator already knows them.
    """
    device = torch.device(device)
    if device.type == "cuda":
        # As on the CPU: the step's own bytes above what was allocated before it, plus
        # `live`. Other tensors of the process, and the workspaces cuBLAS and cuDNN keep
        # from a process's first step on (65 MiB on an H200), are no part of it. Bytes as
        # requested: the caching allocator's rounding of blocks is not counted.
        state = LiveStorageTracker(live).baseline
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_stats(device)["requested_bytes.all.current"]
        step_fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.memory_stats(device)["requested_bytes.all.peak"]
        return Measurement(peak - base + state, state, "cuda-allocator")
    tracker = LiveStorageTracker(live)
    with tracker:
        step_fn()
    return Measurement(tracker.peak, tracker.baseline, "live-storage")


def record_allocations(fn: Callable[[], object]):
    """Run `fn` under torch.profiler with memory recording; return its event tree roots.

    Returns None where this torch no longer offers the (experimental) event tree.
    """
    from torch.profiler import ProfilerActivity, profile

    with silenced(2), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        return prof.profiler.kineto_results.experimental_event_tree()
    except AttributeError:
        return None


def allocations_under(roots) -> list[tuple[int, int]]:
    """(time ns, signed bytes) of every allocator event below `roots`, in time order."""
    found, stack = [], list(roots)
    while stack:
        ev = stack.pop()
        if str(ev.tag).endswith("Allocation"):
            found.append((ev.start_time_ns, int(ev.extra_fields.alloc_size)))
        else:
            stack.extend(ev.children)
    return sorted(found)


def allocation_peak(roots) -> tuple[int, int]:
    """(peak, held at the end): bytes the allocator events below `roots` reach at most,
    and the net bytes they still hold when the last event is over."""
    running = peak = 0
    for _, size in allocations_under(roots):
        running += size
        peak = max(peak, running)
    return peak, running


def measure_allocator(step_fn: Callable[[], object], live: Iterable[torch.Tensor] = ()) -> int:
    """CPU: peak bytes seen by PyTorch's CPU allocator during `step_fn()`, plus `live`.

    Unlike live-storage tracking this sees kernels' internal scratch (workspace) too.
    """
    base = LiveStorageTracker(live).baseline
    roots = record_allocations(step_fn)
    if roots is None:
        raise RuntimeError("this torch offers no allocation events to measure with")
    return base + allocation_peak(roots)[0]


def training_step(
    model: nn.Module, x: torch.Tensor, loss_fn=default_loss, hold_outputs: bool = True
) -> None:
    """One eager step: forward, loss, backward. With `hold_outputs` (the usual loop) the
    outputs stay referenced until backward ends; without, they die before it runs."""
    if hold_outputs:
        out = model(x)
        loss_fn(out).backward()
        del out
    else:
        loss_fn(model(x)).backward()


def state_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def measure_training_step(
    model: nn.Module, x: torch.Tensor, hold_outputs: bool = True
) -> Measurement:
    """Measured peak of one eager training step, gradients starting from None."""
    model.train()
    model.zero_grad(set_to_none=True)
    if x.device.type == "cuda":  # the libraries' persistent workspaces come with a first step
        training_step(model, x, hold_outputs=hold_outputs)
        model.zero_grad(set_to_none=True)
    m = measure(
        lambda: training_step(model, x, hold_outputs=hold_outputs),
        [*state_tensors(model), x],
        x.device,
    )
    model.zero_grad(set_to_none=True)
    return m


def simulate(
    model: nn.Module,
    input_shape: tuple[int, ...],
    batch: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    hold_outputs: bool = True,
) -> Measurement:
    """Peak of an eager training step run on fake tensors: exact bytes, nothing allocated.

    The model may live on the "meta" device; its state is replaced by fake tensors.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    from monet_like.inputs import input_dtype

    device = torch.device(device)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    was_training = model.training
    model.train()
    try:
        with fake_mode:
            state = {n: fake_like(p, dtype, device) for n, p in model.named_parameters()}
            state.update({n: fake_like(b, dtype, device) for n, b in model.named_buffers()})
            x = torch.empty((batch, *input_shape), dtype=input_dtype(model, dtype), device=device)

        def step() -> None:
            with fake_mode:
                training_step(
                    lambda x: functional_call(model, state, (x,)), x, hold_outputs=hold_outputs
                )

        tracker = LiveStorageTracker([*state.values(), x])
        with tracker:
            step()
        return Measurement(tracker.peak, tracker.baseline, "fake-live-storage")
    finally:
        model.train(was_training)
