"""Stage 5: ScheduleWrapper, the nn.Module a user trains with.

    wrapped = ScheduleWrapper(model, "solutions/solution_resnet50_184_normal_10.json",
                              (3, 224, 224))
    out = wrapped(x); loss(out).backward(); optimizer.step()

It shares the model's parameters and buffers (optimizers built on
`model.parameters()`, `state_dict()`, `.train()`/`.eval()` all work). In training
mode with gradients enabled, forward and backward follow the schedule; in eval
mode or under `torch.no_grad()` it is the model's own forward. A schedule solved
with `--input_grad` also gives the input its gradient when it requires grad.
"""

from __future__ import annotations

import copy
import os
import warnings

import torch
from torch import nn
from torch.utils._pytree import tree_unflatten

from monet_like import zoo
from monet_like.errors import UserError
from monet_like.graph import capture
from monet_like.schedule import Executor, build, check_budget
from monet_like.solution import load
from monet_like.variants import apply as apply_variants
from monet_like.variants.multiway import GAMMA_MIN, divided_by_gamma


class ScheduleMismatch(UserError):
    """The solution file does not belong to this model, input shape or dtype."""


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, executor, buffers, diff_index, x, *params):
        env, outputs = executor.forward(params, buffers, x)
        ctx.executor, ctx.env, ctx.n_outputs = executor, env, len(outputs)
        ctx.diff_index, ctx.requires = diff_index, [p.requires_grad for p in params]
        ctx.device = x.device
        tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
        ctx.mark_non_differentiable(
            *[o for i, o in enumerate(outputs) if o is not None and i not in diff_index]
        )
        ctx.positions = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor)]
        return tuple(tensors)

    @staticmethod
    def backward(ctx, *grad_outputs):
        by_position = dict(zip(ctx.positions, grad_outputs, strict=True))
        tangents = []
        for i in ctx.diff_index:
            g = by_position.get(i)
            tangents.append(g if g is not None else torch.zeros((), device=ctx.device))
        grads = ctx.executor.backward(ctx.env, tangents)
        ctx.env = None
        param_grads = iter(grads)
        out = [next(param_grads) if req else None for req in ctx.requires]
        x_grad = next(param_grads, None) if ctx.needs_input_grad[3] else None
        return (None, None, None, x_grad, *out)


def solution_graph(model: nn.Module, sol, device: str | torch.device):
    """The graph `sol` (a Solution) runs on for `model`: the step captured as it was
    solved (batch, dtype, loop, autocast) with the solution's variants rewritten in. A
    mode's solve may keep the captured graph, or the convolution algorithms alone, when
    that schedule is faster; format 1 files predate variants (none). Its fingerprint is
    the solution's when the file belongs to this model."""
    graph = capture(
        model,
        tuple(sol.input_shape),
        sol.batch,
        getattr(torch, sol.dtype),
        device,
        sol.model,
        input_grad=sol.input_grad,
        outputs_held=sol.outputs_held,
        autocast=None if sol.autocast is None else getattr(torch, sol.autocast),
    )
    return apply_variants(graph, tuple(sol.variants or ()), tuple(sol.plain_batch_norms))


def _why_another_graph(sol, device: torch.device) -> str:
    """The likely cause of a fingerprint mismatch, and what to do, for the message."""
    solved_on = torch.device(sol.device).type
    if solved_on != device.type:
        # ResNet-50's CUDA graph has cuDNN's BatchNorm ops where the CPU's has aten's
        return (
            f"it was solved on {solved_on}, and PyTorch runs other kernels on {device.type} "
            f"(cuDNN's BatchNorm on CUDA): solve on {device.type}"
        )
    if sol.torch_version and sol.torch_version != torch.__version__:
        return (
            f"it was solved under torch {sol.torch_version}, whose graph may differ from "
            f"torch {torch.__version__}'s: solve again under this torch"
        )
    return "solve again for this model"


class ScheduleWrapper(nn.Module):
    def __init__(
        self, model: nn.Module, solution_file: str | os.PathLike, input_shape: tuple[int, ...]
    ) -> None:
        super().__init__()
        self.model = model
        if str(solution_file).startswith(zoo.PREFIX):  # "zoo:NAME": local, else downloaded
            solution_file = zoo.resolve(str(solution_file))
        self.solution = load(solution_file)
        self.input_shape = tuple(input_shape)
        sol = self.solution
        if self.input_shape != tuple(sol.input_shape):
            raise ScheduleMismatch(
                f"{solution_file} was solved for input shape {tuple(sol.input_shape)}, "
                f"not {self.input_shape}: solve again for this shape"
            )
        param = next(model.parameters())
        if sol.algorithms and param.device.type != sol.device.split(":")[0]:
            # Convolution algorithms are the profiled device's: elsewhere PyTorch's run.
            warnings.warn(
                f"{solution_file} chose convolution algorithms on {sol.device}; on "
                f"{param.device.type} PyTorch's own run instead (solve there for its own)",
                stacklevel=2,
            )
            sol.algorithms = {}
        if param.dtype != getattr(torch, sol.dtype):
            raise ScheduleMismatch(
                f"{solution_file} was solved for {sol.dtype}, this model's parameters are "
                f"{str(param.dtype).removeprefix('torch.')}: solve again for this dtype"
            )
        graph = solution_graph(model, sol, param.device)
        if graph.fingerprint != sol.fingerprint:
            raise ScheduleMismatch(
                f"{solution_file} was solved for another graph ({sol.model}, batch {sol.batch},"
                f" {sol.dtype}; fingerprint {sol.fingerprint}, this model gives "
                f"{graph.fingerprint}): {_why_another_graph(sol, param.device)}"
            )
        self._graph = graph
        self._schedule = build(graph, sol)  # refuses decisions that would change a value
        check_budget(graph, self._schedule, sol)  # and decisions that exceed the budget
        self._executor = Executor(graph, self._schedule)
        self._diff_index = graph.diff_outputs
        self._gammas = _output_activated_gammas(self._schedule)
        self._param_slots = _slots(model, "_parameters")
        self._buffer_slots = _slots(model, "_buffers")
        s = self._schedule
        x_name = s.placeholders[s.n_params + s.n_buffers]
        self._input_dtype = next(n.meta["val"].dtype for n in s.fx.graph.nodes if n.name == x_name)

    def __deepcopy__(self, memo: dict) -> ScheduleWrapper:
        """A copy with its own model (an EMA copy, a second replica); the graph, schedule
        and executor, plans read only, are shared (deep-copying the traced module
        recurses past Python's limit)."""
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        shared = ("_graph", "_schedule", "_executor")
        for name, value in self.__dict__.items():
            clone.__dict__[name] = value if name in shared else copy.deepcopy(value, memo)
        return clone

    @property
    def graph(self):
        """The graph the schedule runs on (captured, the solution's variants rewritten in)."""
        return self._graph

    def _check_gammas(self, params: list[torch.Tensor]) -> None:
        """Output-activated BatchNorm divides by gamma; refuse the step before it runs
        if training has driven a gamma to zero (the kernel would refuse mid-backward).
        One reduction over all of them: a loop costs a step 0.7 ms on ResNet-50."""
        if not self._gammas:
            return
        every = torch.cat([params[i].detach().reshape(-1) for i in self._gammas])
        if not float(every.abs().min()) < GAMMA_MIN:
            return
        for i in self._gammas:
            smallest = float(params[i].detach().abs().min())
            if smallest < GAMMA_MIN:
                name = self._graph.placeholders[i][1]
                raise UserError(
                    f"BatchNorm weight {name} has reached {smallest:.1e}: the output-activated"
                    f" backward of mode {self.solution.mode!r} cannot divide by it; solve "
                    "again without 'multiway' for this model"
                )

    @property
    def batch(self) -> int:
        return self.solution.batch

    def forward(self, x: torch.Tensor):
        if not (self.training and torch.is_grad_enabled()):
            return self.model(x)
        expected = (self.solution.batch, *self.input_shape)
        if tuple(x.shape) != expected:
            raise ScheduleMismatch(
                f"input of shape {tuple(x.shape)} given to a schedule solved for {expected}"
            )
        device_type = x.device.type
        active = (
            str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
            if torch.is_autocast_enabled(device_type)
            else None
        )
        if active != self.solution.autocast:
            raise ScheduleMismatch(
                f"this step runs {f'under autocast({active})' if active else 'without autocast'}"
                " but the schedule was solved "
                + (
                    f"under autocast({self.solution.autocast})"
                    if self.solution.autocast
                    else "without it"
                )
                + ": solve again with the training loop's autocast"
            )
        if x.dtype != self._input_dtype:
            raise ScheduleMismatch(
                f"input of dtype {x.dtype} given to a schedule solved for {self._input_dtype}"
            )
        if x.requires_grad and not self.solution.input_grad:
            raise ScheduleMismatch(
                "the input requires grad but this schedule computes parameter gradients "
                "only: solve again with --input_grad"
            )
        params = [table[key] for table, key in self._param_slots]
        buffers = [table[key] for table, key in self._buffer_slots]
        self._check_gammas(params)
        tensors = _Replay.apply(self._executor, buffers, self._diff_index, x, *params)
        leaves, k = [], 0
        for name in self._schedule.outputs:
            if name is None:
                leaves.append(None)
            else:
                leaves.append(tensors[k])
                k += 1
        return tree_unflatten(leaves, self._graph.out_spec)


def _slots(model: nn.Module, kind: str) -> list[tuple[dict, str]]:
    """Where each of `model.parameters()` (kind "_parameters") or `model.buffers()`
    ("_buffers") is held, in that order: a step reads them with one lookup each and
    still sees a tensor assigned anew, where walking the module tree costs it 1.5 ms
    on GoogLeNet."""
    seen: set[int] = set()
    slots = []
    for module in model.modules():
        table = getattr(module, kind)
        for key, value in table.items():
            if value is not None and id(value) not in seen:
                seen.add(id(value))
                slots.append((table, key))
    return slots


def _output_activated_gammas(schedule) -> list[int]:
    """Indices of the parameters that an output-activated BatchNorm backward divides by."""
    divided = divided_by_gamma(schedule.fx)
    params = schedule.placeholders[: schedule.n_params]
    return [i for i, name in enumerate(params) if name in divided]
