"""Stage 1: capture the aten-level joint forward/backward graph of one training step.

We trace `loss(model(x)).backward()` with make_fx on fake tensors (the tracer under
AOTAutograd), so the capture costs no memory and runs at any batch size: ResNet-50 at
batch 184 takes about a second. The trace is not functionalized: in-place ops such as
`relu_` stay in-place, so storages and their lifetimes are those eager PyTorch has.
The backward ops are the ones autograd really runs, so the forward values they read
are exactly the tensors autograd saves.

The result is a plain `Graph`: storages (bytes), ops in execution order (which
storages each reads and allocates), and forward `Node`s at about MONeT's granularity
(one per aten compute op, views folded into their producer), each knowing its output
bytes, its consumers, its parameters and the forward storages its backward reads.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from monet_like.errors import UserError
from monet_like.inputs import input_dtype
from monet_like.units import GIB

FORWARD, BACKWARD = "forward", "backward"
# Ops that update buffers (BatchNorm's running statistics) whose values never reach their
# outputs in training: a recomputation runs them on copies of the buffers, so the update
# happens once and the outputs are those of the forward pass. The aten ones write the
# buffers without declaring it in their schema.
RUNNING_STAT_WRITERS = frozenset(
    {"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm", "batch_norm_inplace_"}
)
# Storage kinds. Placeholders stay alive the whole step; gradients live to its end.
PARAM, BUFFER, INPUT, SEED, ACTIVATION, GRADIENT = (
    "param",
    "buffer",
    "input",
    "seed",
    "activation",
    "gradient",
)


def default_loss(outputs: Any) -> torch.Tensor:
    """The scalar a training step differentiates: the sum of every floating output.

    Works for tensors, tuples, named tuples (GoogLeNet's aux heads) and dicts.
    """
    leaves = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor)]
    floats = [t for t in leaves if t.is_floating_point() and t.requires_grad]
    if not floats:
        raise UserError("the model returned no floating tensor that requires grad")
    loss = floats[0].sum()
    for t in floats[1:]:
        loss = loss + t.sum()
    return loss


@dataclass(frozen=True)
class Storage:
    id: int
    nbytes: int
    kind: str  # PARAM, BUFFER, INPUT, SEED, ACTIVATION or GRADIENT
    name: str  # parameter/buffer name, or the fx name of the op that allocated it


@dataclass(frozen=True)
class Op:
    """One aten op of the joint graph, in execution order."""

    index: int
    name: str  # fx node name, e.g. "convolution_3"
    target: str  # e.g. "aten.convolution.default"
    phase: str  # FORWARD or BACKWARD
    role: str  # "compute" (allocates), "inplace" (writes an input), or "view"
    reads: tuple[int, ...]  # storages of its tensor inputs
    allocates: tuple[int, ...]  # storages it creates
    outputs: tuple[int, ...]  # storages of all its outputs (new, aliased or written)
    node: int | None  # forward: the node it belongs to; backward: whose backward it is
    seq_nr: int
    random: bool = False  # draws from the RNG (dropout): recomputing it would differ
    writes: tuple[int, ...] = ()  # existing storages it writes in place (`Tensor(a!)`)


@dataclass(frozen=True)
class Node:
    """A forward node: one aten compute op with the views of its outputs folded in."""

    id: int
    name: str
    kind: str  # short op name: "convolution", "native_batch_norm", "relu_", "add"...
    module: str  # the nn.Module path that ran it, when known
    op: int  # index of its compute op
    ops: tuple[int, ...]  # all forward ops folded into it (the compute op and views)
    outputs: tuple[int, ...]  # storages it allocates
    output_bytes: int
    inplace: bool  # writes into an input's storage instead of allocating
    inputs: tuple[int, ...]  # nodes whose storages it reads
    consumers: tuple[int, ...]  # nodes that read its storages
    params: tuple[str, ...]  # parameters it reads
    saved: tuple[int, ...]  # forward storages its backward ops read
    backward_ops: tuple[int, ...]


@dataclass
class Graph:
    model: str
    batch: int
    input_shape: tuple[int, ...]
    dtype: str
    device: str
    torch_version: str
    storages: list[Storage]
    ops: list[Op]
    nodes: list[Node]
    fingerprint: str = ""
    input_grad: bool = False  # the step also computes the gradient of the input
    # The training loop holds the model's outputs until the backward pass ends
    # (`out = model(x); loss = f(out); loss.backward()`): they count to the step's end.
    # False: the loop drops them before backward (`f(model(x)).backward()`).
    outputs_held: bool = True
    output_storages: tuple[int, ...] = ()  # activation storages of the model's outputs
    # The forward pass runs under torch.autocast in this dtype ("bfloat16", "float16"):
    # its casts are ops of the graph. None: no autocast.
    autocast: str | None = None
    variants: tuple[str, ...] = ()  # operator variants rewritten into it (monet_like.variants)
    # BatchNorm nodes (fx names) output-activated BatchNorm is not rewritten into: their
    # gamma was zero when solved, which its backward would divide by.
    plain_batch_norms: tuple[str, ...] = ()
    # The traced torch.fx.GraphModule, for the profiler and the replay to run, and the
    # pytree spec of the model's outputs: not part of the value.
    fx: Any = field(default=None, repr=False, compare=False)
    out_spec: Any = field(default=None, repr=False, compare=False)
    # Which output leaves take an incoming gradient (one tangent placeholder each).
    diff_outputs: list[int] = field(default_factory=list, repr=False, compare=False)
    # (kind, name) of each placeholder of `fx`, in order.
    placeholders: list[tuple[str, str]] = field(default_factory=list, repr=False, compare=False)
    # fx value name -> the storages it lives in.
    values: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)
    # Variant sites rewritten into it (monet_like.variants), as plain dicts.
    sites: list[dict] = field(default_factory=list, repr=False, compare=False)

    # -- derived facts ------------------------------------------------------------
    def bytes_of(self, kind: str) -> int:
        return sum(s.nbytes for s in self.storages if s.kind == kind)

    @property
    def param_bytes(self) -> int:
        return self.bytes_of(PARAM)

    @property
    def buffer_bytes(self) -> int:
        return self.bytes_of(BUFFER)

    @property
    def grad_bytes(self) -> int:
        return self.bytes_of(GRADIENT)

    @property
    def input_bytes(self) -> int:
        return self.bytes_of(INPUT)

    @property
    def backward_start(self) -> int:
        """Index of the first backward op."""
        return next((o.index for o in self.ops if o.phase == BACKWARD), len(self.ops))

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("fx", "out_spec", "diff_outputs", "placeholders", "values", "sites"):
            d.pop(key)
        return d

    def summary(self) -> str:
        return (
            f"{self.model} batch {self.batch} input {self.input_shape} {self.dtype}: "
            f"{len(self.nodes)} nodes, {len(self.ops)} aten ops, "
            f"params {self.param_bytes / GIB:.3f} GiB"
        )


def _fingerprint(
    storages: list[Storage],
    ops: list[Op],
    input_grad: bool,
    outputs_held: bool = True,
    autocast: str | None = None,
) -> str:
    h = hashlib.sha256()
    for s in storages:
        h.update(
            f"s{s.id}:{s.nbytes}:{s.kind}:{s.name if s.kind in (PARAM, BUFFER) else ''};".encode()
        )
    for o in ops:
        h.update(f"o{o.target}:{o.phase}:{o.reads}:{o.allocates}:{o.outputs};".encode())
    h.update(b"input_grad" if input_grad else b"")
    h.update(b"" if outputs_held else b"outputs_freed")
    h.update(f"autocast:{autocast}".encode() if autocast else b"")
    return h.hexdigest()[:16]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _is_mutating(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def written_args(n: Any) -> list[Any]:
    """The fx input nodes an op's schema declares it writes (`Tensor(a!)`)."""
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
        if isinstance(value, torch.fx.Node):
            written.append(value)
    return written


def _short_kind(target: Any) -> str:
    name = getattr(target, "__name__", str(target))  # "convolution.default"
    return name.split(".")[0]


def _module_path(meta: dict) -> str:
    stack = meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1]
    return str(path[0] if isinstance(path, tuple) else path)


def _differentiable(outputs: Any) -> tuple[list[torch.Tensor], Any, list[int]]:
    """Flatten a model's outputs: (tensor leaves, pytree spec, indices that need grad)."""
    from torch.utils._pytree import tree_flatten as flatten

    leaves, spec = flatten(outputs)
    diff = [
        i
        for i, t in enumerate(leaves)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not diff:
        raise UserError("the model returned no floating tensor that requires grad")
    return leaves, spec, diff


def _trace(
    model: nn.Module,
    example: torch.Tensor,
    fake_params,
    fake_buffers,
    fake_mode,
    input_grad: bool,
    autocast: torch.dtype | None = None,
):
    """make_fx over one training step written functionally.

    The step takes one incoming gradient ("tangent") per differentiable output, so a
    replay can take whatever gradient autograd hands it. The tangents are traced as
    one scalar expanded to each output's shape: what `loss.sum().backward()` passes,
    so the memory model counts what an eager step holds. With `input_grad` the input's
    gradient is the last of the gradients. Returns the GraphModule, the outputs'
    pytree spec and the indices of the differentiable outputs.
    """
    import torch.fx.traceback as fx_traceback
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    param_names = [n for n, _ in model.named_parameters()]
    buffer_names = [n for n, _ in model.named_buffers()]
    trainable = [i for i, (_, p) in enumerate(model.named_parameters()) if p.requires_grad]

    def forward(params, buffers, x):
        state = dict(zip(param_names, params, strict=True))
        state.update(zip(buffer_names, buffers, strict=True))
        if autocast is None:
            return functional_call(model, state, (x,))
        # as a training loop runs it: the forward under autocast, the backward outside
        with torch.autocast(example.device.type, dtype=autocast):
            return functional_call(model, state, (x,))

    if input_grad:
        example.requires_grad_(True)
    with fake_mode:  # a first, untraced pass to learn the outputs' structure
        leaves, spec, diff = _differentiable(forward(fake_params, fake_buffers, example))
        # on the outputs' device: a CPU scalar expanded is no CPU scalar, and a CUDA matmul
        # refuses it
        tangents = [
            torch.ones((), dtype=leaves[i].dtype, device=leaves[i].device).expand(leaves[i].shape)
            for i in diff
        ]

    def step(params, buffers, x, tangents):
        leaves, _, diff = _differentiable(forward(params, buffers, x))
        wrt = [params[i] for i in trainable] + ([x] if input_grad else [])
        _tag_backward_ops([leaves[i] for i in diff])
        grads = torch.autograd.grad([leaves[i] for i in diff], wrt, tangents, allow_unused=True)
        grads = [_in_layout_of(g, w) for g, w in zip(grads, wrt, strict=True)]
        return [t if isinstance(t, torch.Tensor) else None for t in leaves], list(grads)

    handles = _record_module_paths(model)
    try:
        with fx_traceback.preserve_node_meta(), _native_rnn_kernels():
            gm = make_fx(step, tracing_mode="fake")(fake_params, fake_buffers, example, tangents)
    finally:
        for h in handles:
            h.remove()
    return gm, spec, diff


_REDUCED = (torch.bfloat16, torch.float16)


def kernel_nbytes(target: Any, args: Any, index: int, t: torch.Tensor) -> int:
    """Bytes the real kernel allocates for output `index` of op `target` (called with
    `args`), where fake tensors say otherwise: on CPU, BatchNorm of a bfloat16 or float16
    input with float32 parameters or statistics keeps its batch statistics in float32,
    which the fake kernel gives the input's dtype (a mixed-precision step's peak would
    be under-predicted by those bytes). Elsewhere the tensor's own storage size."""
    name = getattr(target, "__name__", "").split(".")[0]
    if (
        index in (1, 2)
        and name in ("native_batch_norm", "_native_batch_norm_legit")
        and t.device.type == "cpu"
        and isinstance(args, (list, tuple))
        and isinstance(args[0], torch.Tensor)
        and args[0].dtype in _REDUCED
        and any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args[1:5])
    ):
        return t.numel() * 4
    return int(t.untyped_storage().nbytes())


def _dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its storage span exactly once (a permutation of contiguous)."""
    expected = 1
    dims = zip(t.shape, t.stride(), strict=True)
    for stride, size in sorted((st, sz) for sz, st in dims if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _obeys_layout(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether autograd's AccumulateGrad takes `grad` as `param.grad` as it is: with the
    parameter's strides where the parameter is dense (size-1 dimensions aside),
    contiguous otherwise. Else it copies it, a transient the memory model must see."""
    if not _dense(param):
        return grad.is_contiguous()
    for size, g, p in zip(grad.shape, grad.stride(), param.stride(), strict=True):
        if (size != 1 and g != p) or (size == 1 and g == 0):
            return False
    return True


def _in_layout_of(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor | None:
    """`grad` laid out as AccumulateGrad wants it (a convolution on a channels-last input
    gives its weight a channels-last gradient): the copy it would make, made in the graph,
    where its bytes are counted at the op that makes it."""
    if grad is None or _obeys_layout(grad, param):
        return grad
    if not _obeys_layout(param, param):  # not dense: AccumulateGrad wants it contiguous
        return grad.contiguous()
    return torch.empty_strided(
        param.shape, param.stride(), dtype=grad.dtype, device=grad.device
    ).copy_(grad)


@contextlib.contextmanager
def _native_rnn_kernels():
    """Trace LSTMs and GRUs as PyTorch's native kernels compose them (matmuls and
    pointwise ops), not as oneDNN's fused RNN layer: that one returns the workspace its
    backward needs only when autograd records (never inside a replay) and its fake
    kernel gives that workspace 0 bytes. Only the RNNs' traced form changes: the
    captured graphs of every other op are the same either way."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _tag_backward_ops(outputs: list[torch.Tensor]) -> None:
    """Have each traced backward op carry the seq_nr of the forward op it differentiates.

    This is the hook AOTAutograd installs for the same purpose; without it every
    backward op would be left unattributed (the times still add up to the step's).
    """
    try:
        from torch._functorch._aot_autograd.logging_utils import (
            setup_stacktrace_preservation_hooks,
        )
    except ImportError:  # moved in a later torch: attribution degrades, capture works
        return
    roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
    if roots:
        setup_stacktrace_preservation_hooks(roots)


def _record_module_paths(model: nn.Module) -> list:
    """Forward hooks that put the running submodule's path into the traced ops' meta."""
    import torch.fx.traceback as fx_traceback

    def enter(path: str, module: nn.Module):
        def hook(*_):
            stack = dict(fx_traceback.current_meta.get("nn_module_stack", {}))
            stack[path] = (path, type(module).__name__)
            fx_traceback.current_meta["nn_module_stack"] = stack

        return hook

    def leave(path: str):
        def hook(*_):
            stack = dict(fx_traceback.current_meta.get("nn_module_stack", {}))
            stack.pop(path, None)
            fx_traceback.current_meta["nn_module_stack"] = stack

        return hook

    handles = []
    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_pre_hook(enter(path, module)))
            handles.append(module.register_forward_hook(leave(path)))
    return handles


def tangents_for(graph: Graph, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The incoming gradients a sum loss gives each differentiable output: one scalar one
    (per dtype) expanded to each output's shape, as autograd hands them out. Under a
    FakeTensorMode, fake ones."""
    placeholders = [n for n in graph.fx.graph.nodes if n.op == "placeholder"]
    metas = [p.meta["val"] for p in placeholders[len(placeholders) - len(graph.diff_outputs) :]]
    ones: dict[torch.dtype, torch.Tensor] = {}
    for m in metas:
        ones.setdefault(m.dtype, torch.ones((), dtype=m.dtype, device=device))
    return [ones[m.dtype].expand(m.shape) for m in metas]


def fake_like(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor shaped like `t` (floating ones cast to `dtype`), keeping its
    requires_grad; under a FakeTensorMode it allocates nothing."""
    dt = dtype if t.is_floating_point() else t.dtype
    f = torch.empty_strided(t.shape, t.stride(), dtype=dt, device=device)
    return f.requires_grad_(t.requires_grad)


def capture(
    model: nn.Module,
    input_shape: tuple[int, ...],
    batch: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model_name: str = "",
    input_grad: bool = False,
    outputs_held: bool = True,
    autocast: torch.dtype | None = None,
) -> Graph:
    """Capture the joint forward/backward graph of one training step on fake tensors.

    `model` may live on any device, "meta" included: only shapes are read. The
    model is put in training mode for the capture and restored afterwards. With
    `input_grad` the step also differentiates with respect to the (floating) input.
    `outputs_held`: the training loop keeps the outputs referenced until the backward
    pass ends (the usual loop); False where it drops them before calling backward.
    `autocast`: the loop runs the forward pass under `torch.autocast` in this dtype.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if batch < 1:
        raise UserError(f"batch size must be at least 1, got {batch}")
    if not dtype.is_floating_point:
        raise UserError(f"dtype {dtype} is not a floating-point type; a model cannot train in it")
    device = torch.device(device)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    was_training = model.training
    model.train()
    try:
        with fake_mode:
            params = [fake_like(p, dtype, device) for p in model.parameters()]
            buffers = [fake_like(b, dtype, device) for b in model.buffers()]
            in_dtype = input_dtype(model, dtype)
            x = torch.empty((batch, *input_shape), dtype=in_dtype, device=device)
        if input_grad and not in_dtype.is_floating_point:
            raise UserError(
                f"{model_name or type(model).__name__} takes {in_dtype} input (token ids?): "
                "it has no input gradient"
            )
        try:
            gm, out_spec, diff_outputs = _trace(
                model, x, params, buffers, fake_mode, input_grad, autocast
            )
        except UserError:
            raise
        except Exception as exc:
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"{model_name or type(model).__name__} cannot run on input shape "
                f"{(batch, *input_shape)} in {dtype}: {msg}"
            ) from None
    finally:
        model.train(was_training)

    named = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    kinds = [PARAM] * len(params) + [BUFFER] * len(buffers) + [INPUT]
    kinds += [SEED] * len(diff_outputs)
    names = named + ["input"] + [f"tangent{i}" for i in range(len(diff_outputs))]
    return derive(
        gm,
        list(zip(kinds, names, strict=True)),
        out_spec,
        list(diff_outputs),
        model=model_name or type(model).__name__,
        batch=batch,
        input_shape=tuple(input_shape),
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        input_grad=input_grad,
        outputs_held=outputs_held,
        autocast=None if autocast is None else str(autocast).removeprefix("torch."),
    )


def derive(
    gm: Any,
    placeholders: list[tuple[str, str]],
    out_spec: Any,
    diff_outputs: list[int],
    variants: tuple[str, ...] = (),
    **facts: Any,
) -> Graph:
    """The plain Graph of a traced joint GraphModule whose nodes carry fake values
    (`meta["val"]`): storages, ops in order, forward nodes.

    `placeholders`: (kind, name) of each placeholder in order. `facts`: model, batch,
    input_shape, dtype, device, input_grad, outputs_held, autocast. Used by `capture` and
    again after a variant rewrites the graph (`monet_like.variants`).
    """
    from torch.multiprocessing.reductions import StorageWeakRef

    storage_ids: dict[Any, int] = {}
    storages: list[Storage] = []

    def storage_of(
        t: torch.Tensor, kind: str, name: str, nbytes: int | None = None
    ) -> tuple[int, bool]:
        key = StorageWeakRef(t.untyped_storage())
        if key in storage_ids:
            return storage_ids[key], False
        sid = len(storages)
        storage_ids[key] = sid
        size = int(t.untyped_storage().nbytes()) if nbytes is None else nbytes
        storages.append(Storage(sid, size, kind, name))
        return sid, True

    fx_nodes = list(gm.graph.nodes)
    phs = [n for n in fx_nodes if n.op == "placeholder"]
    for ph, (kind, name) in zip(phs, placeholders, strict=True):
        for t in _tensors(ph.meta.get("val")):
            storage_of(t, kind, name)
    # An eager step holds the sum loss and the one scalar its backward starts from, which
    # every output's incoming gradient is a view of: two scalars however many outputs
    # there are. The first tangent's storage stands for both, the others for nothing.
    seeds = [s for s in storages if s.kind == SEED]
    for k, seed in enumerate(seeds):
        storages[seed.id] = Storage(seed.id, 2 * seed.nbytes if k == 0 else 0, SEED, seed.name)

    values: dict[str, tuple[int, ...]] = {  # fx value name -> its storages
        ph.name: tuple(
            storage_ids[StorageWeakRef(t.untyped_storage())] for t in _tensors(ph.meta.get("val"))
        )
        for ph in phs
    }
    # Tensor constants the trace lifted onto the module (`_tensor_constant0`): held by
    # it for the whole step, read and never recomputed, like buffers.
    for n in fx_nodes:
        if n.op == "get_attr":
            values[n.name] = tuple(
                storage_of(t, BUFFER, n.name)[0] for t in _tensors(n.meta.get("val"))
            )
    ops: list[Op] = []
    op_meta: list[dict] = []
    tainted = {s.id for s in storages if s.kind == SEED}  # depend on the incoming gradients
    in_backward = False
    for n in fx_nodes:
        if n.op != "call_function":
            continue
        if n.target.__name__ == "getitem":  # its value is its parent's, already seen
            values[n.name] = tuple(
                storage_of(t, ACTIVATION, n.name)[0] for t in _tensors(n.meta.get("val"))
            )
            continue
        reads: list[int] = []
        for arg in n.all_input_nodes:
            for t in _tensors(arg.meta.get("val")):
                sid, _ = storage_of(t, ACTIVATION, arg.name)
                if sid not in reads:
                    reads.append(sid)
        outputs, allocates = [], []
        arg_vals = torch.fx.node.map_arg(n.args, lambda a: a.meta.get("val"))
        for i, t in enumerate(_tensors(n.meta.get("val"))):
            size = kernel_nbytes(n.target, arg_vals, i, t)
            sid, new = storage_of(t, ACTIVATION, n.name, size)
            if sid not in outputs:
                outputs.append(sid)
            if new:
                allocates.append(sid)
        values[n.name] = tuple(outputs)
        writes: list[int] = []
        for arg in written_args(n):  # an op may write an input it does not return
            for t in _tensors(arg.meta.get("val")):
                sid, _ = storage_of(t, ACTIVATION, arg.name)
                if sid not in outputs:
                    outputs.append(sid)
                if sid not in allocates and sid not in writes:
                    writes.append(sid)
        if not in_backward and tainted.intersection(reads):
            in_backward = True
        if in_backward:
            tainted.update(outputs)
        role = "compute" if allocates else ("inplace" if _is_mutating(n.target) else "view")
        ops.append(
            Op(
                index=len(ops),
                name=n.name,
                target=str(n.target),
                phase=BACKWARD if in_backward else FORWARD,
                role=role,
                reads=tuple(reads),
                allocates=tuple(allocates),
                outputs=tuple(outputs),
                node=None,
                seq_nr=int(n.meta.get("seq_nr", -1)),
                random=torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()),
                writes=tuple(writes),
            )
        )
        op_meta.append({"kind": _short_kind(n.target), "module": _module_path(n.meta)})

    output_storages = _mark_outputs(fx_nodes[-1], out_spec, storages, values, storage_of)
    nodes, ops = _coarsen(ops, op_meta, storages)
    graph = Graph(
        **facts,
        torch_version=torch.__version__,
        storages=storages,
        ops=ops,
        nodes=nodes,
        variants=tuple(variants),
        fx=gm,
        out_spec=out_spec,
        diff_outputs=list(diff_outputs),
        placeholders=list(placeholders),
        values=values,
        output_storages=output_storages,
    )
    graph.fingerprint = _fingerprint(
        storages, ops, graph.input_grad, graph.outputs_held, graph.autocast
    )
    return graph


def _mark_outputs(output_node, out_spec, storages: list[Storage], values, storage_of) -> tuple:
    """The graph returns (forward outputs, parameter gradients). The gradients' storages
    become GRADIENT (they live to the end of the step); the outputs are the user's, and
    die as eager's would: their activation storages, returned."""
    flat_outputs = output_node.args[0]  # make_fx flattens: the leaves, then the gradients
    grad_nodes = [a for a in flat_outputs[out_spec.num_leaves :] if isinstance(a, torch.fx.Node)]
    for arg in grad_nodes:
        for t in _tensors(arg.meta.get("val")):
            sid, _ = storage_of(t, GRADIENT, arg.name)
            s = storages[sid]
            if s.kind == ACTIVATION:
                storages[sid] = Storage(s.id, s.nbytes, GRADIENT, s.name)
    return tuple(
        dict.fromkeys(
            s
            for a in flat_outputs[: out_spec.num_leaves]
            if isinstance(a, torch.fx.Node)
            for s in values.get(a.name, ())
            if storages[s].kind == ACTIVATION
        )
    )


def _coarsen(
    ops: list[Op], op_meta: list[dict], storages: list[Storage]
) -> tuple[list[Node], list[Op]]:
    """Group forward ops into nodes and attach each backward op to its forward node."""
    placeholder_kinds = (PARAM, BUFFER, INPUT, SEED)
    owner: dict[int, int] = {}  # activation storage -> forward node that allocated it
    node_ops: list[list[int]] = []
    node_of_op: dict[int, int] = {}
    first_node_of_seq: dict[int, int] = {}

    for op in ops:
        if op.phase != FORWARD:
            continue
        if op.role == "view":
            base = next((owner[s] for s in op.reads if s in owner), None)
            if base is not None:
                node_ops[base].append(op.index)
                node_of_op[op.index] = base
                first_node_of_seq.setdefault(op.seq_nr, base)  # its backward is the node's
            continue
        nid = len(node_ops)
        node_ops.append([op.index])
        node_of_op[op.index] = nid
        first_node_of_seq.setdefault(op.seq_nr, nid)
        for s in op.allocates:
            owner[s] = nid

    # An in-place op whose backward needs its input (silu_) runs a clone inside its
    # autograd kernel, and its grad_fn's seq_nr falls just before the forward ops'
    # own: attribute such backward ops to the last node of the next seq_nr.
    last_node_of_seq: dict[int, int] = {}
    for nid, idxs in enumerate(node_ops):
        last_node_of_seq[ops[idxs[0]].seq_nr] = nid
    forward_seqs = sorted(last_node_of_seq)

    def node_for(seq_nr: int) -> int | None:
        if seq_nr in first_node_of_seq:
            return first_node_of_seq[seq_nr]
        k = bisect.bisect_right(forward_seqs, seq_nr)
        return last_node_of_seq[forward_seqs[k]] if k < len(forward_seqs) else None

    backward_of: dict[int, list[int]] = {nid: [] for nid in range(len(node_ops))}
    for op in ops:
        if op.phase == BACKWARD and op.seq_nr >= 0:
            nid = node_for(op.seq_nr)
            if nid is not None:
                backward_of[nid].append(op.index)
                node_of_op[op.index] = nid

    new_ops = [
        Op(**{**asdict(op), "node": node_of_op.get(op.index)}) for op in ops
    ]  # dataclasses are frozen: rebuild with the node filled in
    forward_storages = {s for op in ops if op.phase == FORWARD for s in op.outputs} | {
        s.id for s in storages if s.kind in placeholder_kinds and s.kind != SEED
    }

    nodes: list[Node] = []
    consumers: dict[int, set[int]] = {nid: set() for nid in range(len(node_ops))}
    inputs_of: dict[int, set[int]] = {}
    for nid, idxs in enumerate(node_ops):
        compute = ops[idxs[0]]
        ins = {owner[s] for i in idxs for s in ops[i].reads if s in owner and owner[s] != nid}
        inputs_of[nid] = ins
        for p in ins:
            consumers[p].add(nid)
    for nid, idxs in enumerate(node_ops):
        compute = ops[idxs[0]]
        outs = tuple(s for i in idxs for s in ops[i].allocates)
        params = sorted(
            {storages[s].name for i in idxs for s in ops[i].reads if storages[s].kind == PARAM}
        )
        saved = sorted({s for b in backward_of[nid] for s in ops[b].reads if s in forward_storages})
        nodes.append(
            Node(
                id=nid,
                name=compute.name,
                kind=op_meta[compute.index]["kind"],
                module=op_meta[compute.index]["module"],
                op=compute.index,
                ops=tuple(idxs),
                outputs=outs,
                output_bytes=sum(storages[s].nbytes for s in outs),
                inplace=compute.role == "inplace",
                inputs=tuple(sorted(inputs_of[nid])),
                consumers=tuple(sorted(consumers[nid])),
                params=tuple(params),
                saved=tuple(saved),
                backward_ops=tuple(backward_of[nid]),
            )
        )
    return nodes, new_ops
