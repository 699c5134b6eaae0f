"""Differential checks of a replayed schedule against eager PyTorch.

One training step of the model run eagerly and one through `ScheduleWrapper`, from the
same parameters, buffers, input and random seed: their outputs, parameter gradients,
input gradient and buffers (BatchNorm's running statistics) are compared, and the
replay's peak is measured. `schedule.py --check_diff`, the tests and
`scripts/bench_corpus.py` all use these.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from monet_like.graph import default_loss

# Where the replay runs other kernels than eager PyTorch (convolution algorithms, the
# variants' own), the largest difference relative to each gradient's largest magnitude
# that a check accepts; where it runs the same kernels, it must be bitwise equal.
VARIANT_TOLERANCE = 1e-4
# A tensor off eager by more than that may still hold only rounding: a gradient that is zero
# in exact arithmetic (a BatchNorm bias before another BatchNorm) is float32 noise, which any
# other summation order changes by 100%. Such a replay passes where, against the same step
# in float64, each of its tensors is at most this many times further off than eager's own.
ROUNDING_RATIO = 4.0


@dataclass(frozen=True)
class Comparison:
    max_abs_output_diff: float
    max_abs_grad_diff: float
    max_rel_grad_diff: float
    max_abs_buffer_diff: float
    max_abs_input_grad_diff: float | None = None
    output_scale: float = 1.0  # largest magnitude among eager's outputs
    buffer_scale: float = 1.0  # and among its floating buffers
    # against a float64 eager step: the largest, over outputs, gradients and buffers, of the
    # replay's error over eager's own (None: not computed, or no float64 step possible)
    float64_error_ratio: float | None = None

    @property
    def bitwise(self) -> bool:
        """Everything equal to the last bit."""
        return (
            self.max_abs_output_diff == 0
            and self.max_abs_grad_diff == 0
            and self.max_abs_buffer_diff == 0
            and not self.max_abs_input_grad_diff
        )

    def within(self, tolerance: float) -> bool:
        """Gradients within `tolerance` of each one's largest magnitude, and outputs within
        it of theirs (relative), buffers likewise: the check for other kernels."""
        return (
            self.bitwise
            or (
                self.max_rel_grad_diff <= tolerance
                and self.max_abs_output_diff <= tolerance * max(self.output_scale, 1e-30)
                and self.max_abs_buffer_diff <= tolerance * max(self.buffer_scale, 1e-30)
            )
            or self.rounding_only
        )

    @property
    def rounding_only(self) -> bool:
        """Whether a float64 step showed the differences to be float32 rounding: the replay
        no more than ROUNDING_RATIO times further from it than eager, tensor by tensor."""
        return self.float64_error_ratio is not None and self.float64_error_ratio <= ROUNDING_RATIO

    def as_dict(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def full_float32():
    """float32 convolutions and matrix products without TF32 on CUDA, for comparisons: TF32
    rounds their inputs to 10-bit mantissas, so two summation orders (another algorithm, a
    variant's kernel) differ by 1e-3 relative there (ResNet-18 on an H200: 1.9e-3 with it,
    1.5e-5 without)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def autocast_context(device_type: str, dtype: str | None):
    """torch.autocast in `dtype` ("bfloat16"...), or nothing where None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, dtype))


def training_step(
    net: nn.Module,
    params_of: nn.Module,
    x: torch.Tensor,
    input_grad: bool = False,
    autocast: str | None = None,
    seed: int = 1,
):
    """One step of the usual loop from fresh gradients (those of `params_of`'s
    parameters) and random seed `seed`: the flattened outputs and the input's gradient
    (None without one). The outputs stay referenced until backward ends."""
    params_of.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    inputs = x.detach().clone().requires_grad_(input_grad)
    with autocast_context(x.device.type, autocast):
        out = net(inputs)
    default_loss(out).backward()
    return tree_flatten(out)[0], inputs.grad


def compare_steps(eager: nn.Module, eager_step, replayed: nn.Module, replay_step) -> Comparison:
    """The largest differences between two steps (`training_step`'s results) of models
    whose parameters and buffers are `eager`'s and `replayed`'s."""
    (outs, in_grad), (replay_outs, replay_in_grad) = eager_step, replay_step
    out_diff = out_scale = 0.0
    for a, b in zip(outs, replay_outs, strict=True):
        if isinstance(a, torch.Tensor):
            out_diff = max(out_diff, (a.float() - b.float()).abs().max().item())
            out_scale = max(out_scale, a.float().abs().max().item())
    grad_abs = grad_rel = 0.0
    for p, q in zip(eager.parameters(), replayed.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            grad_abs = grad_rel = float("inf")
            continue
        if p.grad is None:
            continue
        d = (p.grad.float() - q.grad.float()).abs().max().item()
        grad_abs = max(grad_abs, d)
        grad_rel = max(grad_rel, d / max(p.grad.float().abs().max().item(), 1e-30))
    buf_diff = buf_scale = 0.0
    for a, b in zip(eager.buffers(), replayed.buffers(), strict=True):
        if a.is_floating_point():
            buf_diff = max(buf_diff, (a.float() - b.float()).abs().max().item(), 0.0)
            buf_scale = max(buf_scale, a.float().abs().max().item())
        elif not torch.equal(a, b):
            buf_diff = float("inf")
    in_diff = None
    if in_grad is not None:
        in_diff = (in_grad.float() - replay_in_grad.float()).abs().max().item()
    return Comparison(
        out_diff, grad_abs, grad_rel, buf_diff, in_diff, max(out_scale, 1e-30), buf_scale
    )


def _step_tensors(net: nn.Module, step) -> list[torch.Tensor]:
    outs, in_grad = step
    tensors = [o for o in outs if isinstance(o, torch.Tensor)]
    tensors += [p.grad for p in net.parameters() if p.grad is not None]
    tensors += [b for b in net.buffers() if b.is_floating_point()]
    return tensors + ([in_grad] if in_grad is not None else [])


def float64_error_ratio(
    model: nn.Module, x: torch.Tensor, sol, eager: nn.Module, eager_step, replayed, replay_step
) -> float | None:
    """The same step of `model` (as it was before either step) in float64, against which each
    output, gradient and buffer of the replay is compared with eager's float32 one: the
    largest ratio of the replay's error to eager's. Each error has a floor of one ulp of
    the tensor's float64 magnitude in the step's precision (float32, or the autocast
    dtype: the float64 step runs without autocast, the exact value both round). None
    where the model does not run in float64."""
    try:
        truth = copy.deepcopy(model).double()
        inputs = x.double() if x.is_floating_point() else x
        truth_step = training_step(truth, truth, inputs, sol.input_grad)
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    precision = torch.float32 if sol.autocast is None else getattr(torch, sol.autocast)
    ulp = float(torch.finfo(precision).eps)
    ratio = 0.0
    for t, e, r in zip(
        _step_tensors(truth, truth_step),
        _step_tensors(eager, eager_step),
        _step_tensors(replayed, replay_step),
        strict=True,
    ):
        floor = max(ulp * t.abs().max().item(), 1e-30)
        eager_error = max((e.double() - t).abs().max().item(), floor)
        ratio = max(ratio, (r.double() - t).abs().max().item() / eager_error)
    return ratio


def with_float64_ratio(
    diff: Comparison, model, x, sol, eager, eager_step, replayed, replay_step
) -> Comparison:
    """`diff`, with its `float64_error_ratio` where it fails the relative rule (a gradient
    that is zero in exact arithmetic is all rounding: a float64 step tells)."""
    if diff.within(VARIANT_TOLERANCE):
        return diff
    ratio = float64_error_ratio(model, x, sol, eager, eager_step, replayed, replay_step)
    return replace(diff, float64_error_ratio=ratio)


def compare_with_eager(
    model: nn.Module, solution_file, input_shape, x: torch.Tensor, reference=None
) -> Comparison:
    """One step of `model` (left untouched) eagerly, or of `reference` (a fresh copy of
    it running other kernels, stepped as it is: a deep copy would keep its patched
    forwards bound to the original's modules), against one step replayed through
    `solution_file` on a copy of `model`."""
    from monet_like.wrapper import ScheduleWrapper

    replayed = copy.deepcopy(model)
    wrapped = ScheduleWrapper(replayed, solution_file, input_shape)
    sol = wrapped.solution
    eager = reference if reference is not None else copy.deepcopy(model)
    with full_float32():
        eager_step = training_step(eager, eager, x, sol.input_grad, sol.autocast)
        replay_step = training_step(wrapped, replayed, x, sol.input_grad, sol.autocast)
    diff = compare_steps(eager, eager_step, replayed, replay_step)
    return with_float64_ratio(diff, model, x, sol, eager, eager_step, replayed, replay_step)


def measured_peak(wrapped, x: torch.Tensor) -> int:
    """Peak bytes of one replayed step of the loop the schedule was solved for (outputs
    held or not, autocast or not), seen by PyTorch's CPU allocator (kernels' scratch
    included) or, on CUDA, by the caching allocator's statistics (bytes requested, after a
    first step)."""
    sol = wrapped.solution
    model = wrapped.model

    def step() -> None:
        torch.manual_seed(1)
        with autocast_context(x.device.type, sol.autocast):
            out = wrapped(x)
        if sol.outputs_held:
            default_loss(out).backward()
        else:
            loss = default_loss(out)
            del out
            loss.backward()

    return step_peak(model, step, x)


def step_peak(model: nn.Module, step, x: torch.Tensor) -> int:
    """Peak bytes of one training step `step()` of `model` on `x` (gradients reset before
    and after): PyTorch's CPU allocator events (kernels' scratch included) above the
    state and input, or on CUDA the caching allocator's requested bytes after a first
    step."""
    from monet_like.memory import measure, measure_allocator, state_tensors

    model.zero_grad(set_to_none=True)
    live = [*state_tensors(model), x]
    if x.device.type == "cuda":
        step()  # the libraries' persistent workspaces come with a process's first step
        model.zero_grad(set_to_none=True)
        peak = measure(step, live, x.device).peak_bytes
    else:
        peak = measure_allocator(step, live)
    model.zero_grad(set_to_none=True)
    return peak


def runs_native_lstm(model: nn.Module, device: str | torch.device) -> bool:
    """Whether `model` holds an LSTM run on the CPU: captured as PyTorch's native LSTM
    kernels, where eager runs oneDNN's fused layer, so its replay equals eager within
    rounding, not bitwise."""
    return torch.device(device).type == "cpu" and any(
        isinstance(m, nn.LSTM) for m in model.modules()
    )


@dataclass(frozen=True)
class Replayed:
    """One schedule of a differential run: its budget point, solution, comparison with
    eager PyTorch and measured peak."""

    fraction: float
    solution: object  # monet_like.solution.Solution
    comparison: Comparison
    measured_peak_bytes: int
    nodes: int

    lstm: bool = False  # the model holds a CPU LSTM (its replay runs native kernels)
    min_budget_bytes: int | None = None  # the smallest feasible budget found, where searched

    def exact(self) -> bool:
        """Bitwise where the replay runs eager's kernels; within VARIANT_TOLERANCE of eager
        running the same convolution algorithms where it runs variants, or an LSTM."""
        if self.solution.variants or self.lstm:
            return self.comparison.within(VARIANT_TOLERANCE)
        return self.comparison.bitwise

    def fits(self) -> bool:
        sol = self.solution
        return self.measured_peak_bytes <= sol.predicted_peak_bytes <= sol.budget_bytes


def replay_entry(
    expression: str,
    input_shape: tuple[int, ...],
    batch: int,
    mode: str,
    folder,
    fractions=(1.0, 0.5, 0.0),
    autocast: torch.dtype | None = None,
    time_limit: float = 120.0,
) -> list[Replayed]:
    """Solve `expression` at each fraction of its budget range (0.0 the smallest feasible
    budget, 1.0 the store-all peak), save the schedules in `folder`, replay each and
    compare it with eager PyTorch."""
    from pathlib import Path

    from monet_like.models import make_input, parse_model
    from monet_like.pipeline import compile_schedule
    from monet_like.variants.conv import eager_with_algorithms
    from monet_like.wrapper import ScheduleWrapper

    spec = parse_model(expression)
    torch.manual_seed(0)
    model = spec.build()
    x = make_input(model, input_shape, batch, torch.float32)
    lstm = runs_native_lstm(model, x.device)
    rows, low = [], None
    for fraction in fractions:
        path = Path(folder) / f"{spec.name}_{batch}_{mode}_{fraction}.json"
        compiled = compile_schedule(
            model,
            input_shape,
            batch,
            budget_fraction=fraction,
            min_budget_bytes=low,
            mode=mode,
            solver="HIGHS",
            model_name=expression,
            time_limit=time_limit,
            repeats=1,
            autocast=autocast,
            output=path,
        )
        sol, low = compiled.solution, compiled.min_budget_bytes
        reference = None
        if sol.algorithms:  # the replay's exactness: eager running the same kernels
            reference = eager_with_algorithms(model, compiled.graph, sol.algorithms)
        diff = compare_with_eager(model, path, input_shape, x, reference)
        wrapped = ScheduleWrapper(spec.build(), path, input_shape)
        peak = measured_peak(wrapped, x)
        rows.append(Replayed(fraction, sol, diff, peak, len(compiled.graph.nodes), lstm, low))
    return rows
