"""What makes a replay exact, each construct on a small model: in-place writes after a
read, lifted tensor constants, random ops, RNNs, the outputs held by the loop, mixed
precision; and the validator that refuses a schedule file edited to break any of it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from monet_like.errors import UserError
from monet_like.graph import capture
from monet_like.pipeline import compile_schedule
from monet_like.solution import SolutionFileError, load
from monet_like.solver.problem import build_problem
from monet_like.validate import ScheduleError
from monet_like.variants.conv import eager_with_algorithms
from monet_like.verify import compare_with_eager, measured_peak
from monet_like.wrapper import ScheduleMismatch, ScheduleWrapper


class SiluNet(nn.Module):
    """Convolutions, BatchNorm, in-place SiLU (autograd clones its input before the
    write) and a squeeze-excite gate: EfficientNet's constructs, small."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(8 if i else 3, 8, 3, padding=1) for i in range(4))
        self.bns = nn.ModuleList(nn.BatchNorm2d(8) for _ in range(4))
        self.act = nn.SiLU(inplace=True)
        self.gate = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        for conv, bn in zip(self.convs, self.bns, strict=True):
            x = self.act(bn(conv(x)))
            x = x * torch.sigmoid(self.gate(x.mean((2, 3))))[:, :, None, None]
        return self.head(x.mean((2, 3)))


class ConstantNet(nn.Module):
    """Tensors made in forward from Python values: the trace lifts them onto the module
    as `_tensor_constant*` attributes (a Hugging Face GPT-2 crashed on one)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x)) * torch.tensor([1.0 + i]) + torch.tensor(0.5)
        return x


class RecurrentNet(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.rnn = cell(16, 24, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        y, _ = self.rnn(torch.relu(self.conv(x)).transpose(1, 2))
        return self.head(y)


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.c(self.drop(torch.relu(self.b(self.drop(torch.relu(self.a(x)))))))


def solved(model, shape, batch, fraction, path, time_limit=60, **options):
    torch.manual_seed(0)
    compiled = compile_schedule(
        model, shape, batch, budget_fraction=fraction, solver="HIGHS", repeats=1,
        time_limit=time_limit, output=path, **options,
    )  # fmt: skip
    return compiled


def assert_exact(model, path, shape, batch, x=None):
    x = torch.randn(batch, *shape) if x is None else x
    diff = compare_with_eager(model, path, shape, x)
    assert diff.bitwise, diff
    wrapped = ScheduleWrapper(model, path, shape)
    sol = wrapped.solution
    assert measured_peak(wrapped, x) <= sol.predicted_peak_bytes <= sol.budget_bytes


def test_a_value_written_in_place_after_a_read_is_recomputed_with_its_writer(tmp_path):
    torch.manual_seed(0)
    model = SiluNet()
    graph = capture(model, (3, 16, 16), 4)
    clones = [n for n in graph.nodes if n.kind == "clone"]
    assert clones  # autograd's copy of each SiLU's input, read before silu_ writes it
    problem = build_problem(graph, _profile(model, graph))
    for clone in clones:
        unit = next(u for u in problem.units if clone.id in u.nodes)
        assert any(graph.nodes[n].kind == "silu_" for n in unit.nodes), unit
    compiled = solved(model, (3, 16, 16), 4, 0.0, tmp_path / "s.json")
    assert sum(len(s["recompute"]) for s in compiled.solution.stages) > 0
    assert_exact(model, tmp_path / "s.json", (3, 16, 16), 4)


def test_recomputing_the_clone_alone_is_refused(tmp_path):
    """The old units (the clone apart from the BatchNorm and SiLU it reads from), with
    the clone recomputed on its own: it would read the SiLU's output."""
    torch.manual_seed(0)
    model = SiluNet()
    path = tmp_path / "s.json"
    compiled = solved(model, (3, 16, 16), 4, 1.0, path)
    graph = compiled.graph
    data = json.loads(path.read_text())
    clone = next(n.id for n in graph.nodes if n.kind == "clone")
    owner = next(k for k, nodes in enumerate(data["units"]) if clone in nodes)
    data["units"][owner].remove(clone)
    data["units"].append([clone])
    data["keep"].append(False)
    stage = next(t for t, s in enumerate(data["stages"]) if s["unit"] == owner)
    data["stages"][stage]["recompute"].append(len(data["units"]) - 1)
    path.write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match="in-place writes") as info:
        ScheduleWrapper(model, path, (3, 16, 16))
    assert "\n" not in str(info.value)


def test_lifted_tensor_constants_are_read_not_recomputed(tmp_path):
    torch.manual_seed(0)
    model = ConstantNet()
    graph = capture(model, (32,), 16)
    assert any(n.op == "get_attr" for n in graph.fx.graph.nodes)
    solved(model, (32,), 16, 0.0, tmp_path / "c.json")
    assert_exact(model, tmp_path / "c.json", (32,), 16)


def test_a_gru_replays_exactly_within_its_prediction(tmp_path):
    torch.manual_seed(0)
    model = RecurrentNet(nn.GRU)
    solved(model, (4, 6), 4, 0.5, tmp_path / "r.json")
    assert_exact(model, tmp_path / "r.json", (4, 6), 4)


def test_an_lstm_replays_pytorchs_native_kernels_within_its_prediction(tmp_path):
    """Eager PyTorch runs a CPU LSTM as oneDNN's fused layer, whose workspace exists only
    while autograd records and is 0 bytes to fake tensors: the capture takes PyTorch's
    native LSTM kernels instead, exact in memory, equal to eager within rounding."""
    from monet_like.verify import VARIANT_TOLERANCE

    torch.manual_seed(0)
    model = RecurrentNet(nn.LSTM)
    path = tmp_path / "r.json"
    compiled = solved(model, (4, 6), 4, 0.5, path)
    assert not any("mkldnn" in str(n.target) for n in compiled.graph.fx.graph.nodes)
    x = torch.randn(4, 4, 6)
    assert compare_with_eager(model, path, (4, 6), x).within(VARIANT_TOLERANCE)
    wrapped = ScheduleWrapper(model, path, (4, 6))
    assert measured_peak(wrapped, x) <= compiled.solution.predicted_peak_bytes


def test_outputs_held_by_the_loop_are_in_the_budget(tmp_path):
    """A masked language model's logits are the largest tensor of its step: held by
    `out = model(x); loss(out).backward()` until the backward pass ends."""
    from monet_like.models import make_input, parse_model
    from monet_like.models.corpus import BY_NAME

    entry = BY_NAME["bert"]
    torch.manual_seed(0)
    model = parse_model(entry.expression).build()
    x = make_input(model, entry.input_shape, entry.batch, torch.float32)
    shape, batch = entry.input_shape, entry.batch
    held = solved(model, shape, batch, 1.0, tmp_path / "held.json")
    freed = solved(model, shape, batch, 1.0, tmp_path / "freed.json", outputs_held=False)
    logits = held.graph.storages[held.graph.output_storages[0]].nbytes
    assert held.solution.outputs_held and not freed.solution.outputs_held
    # At the store-all peak (in the backward pass) the held logits count in full.
    assert held.solution.budget_bytes >= freed.solution.budget_bytes + logits // 2
    # Recomputing, near the smallest budget (searched for 20 s: the best one found).
    solved(model, shape, batch, 0.2, tmp_path / "held_low.json", time_limit=20)
    for path in (tmp_path / "held.json", tmp_path / "freed.json", tmp_path / "held_low.json"):
        wrapped = ScheduleWrapper(parse_model(entry.expression).build(), path, entry.input_shape)
        sol = wrapped.solution
        assert measured_peak(wrapped, x) <= sol.predicted_peak_bytes <= sol.budget_bytes
        assert compare_with_eager(model, path, entry.input_shape, x).bitwise


def test_a_random_op_is_never_recomputed(tmp_path):
    torch.manual_seed(0)
    model = DropoutNet()
    path = tmp_path / "d.json"
    compiled = solved(model, (32,), 32, 0.0, path)
    assert_exact(model, path, (32,), 32)
    graph = compiled.graph
    problem = build_problem(graph, compiled.profile)
    random_units = [u.id for u in problem.units if u.random]
    assert random_units and not any(
        u in s["recompute"] for s in compiled.solution.stages for u in random_units
    )
    data = json.loads(path.read_text())
    data["stages"][-1]["recompute"].append(random_units[0])  # the edit of the issue
    path.write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match="random op"):
        ScheduleWrapper(model, path, (32,))


def test_autocast_mismatch_is_refused_both_ways(tmp_path):
    torch.manual_seed(0)
    model = SiluNet()
    x = torch.randn(4, 3, 16, 16)
    plain = tmp_path / "plain.json"
    mixed = tmp_path / "mixed.json"
    solved(model, (3, 16, 16), 4, 1.0, plain)
    solved(model, (3, 16, 16), 4, 1.0, mixed, autocast=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ScheduleMismatch):
        ScheduleWrapper(model, plain, (3, 16, 16))(x)
    with pytest.raises(ScheduleMismatch, match="without autocast"):
        ScheduleWrapper(model, mixed, (3, 16, 16))(x)


def test_another_dtype_is_refused(tmp_path):
    torch.manual_seed(0)
    model = ConstantNet()
    path = tmp_path / "c.json"
    solved(model, (32,), 16, 1.0, path)
    with pytest.raises(ScheduleMismatch, match="float32"):
        ScheduleWrapper(ConstantNet().double(), path, (32,))


class ChannelsLastNet(nn.Module):
    """ConvNeXt's pattern: a convolution, a LayerNorm over channels-last features, a
    convolution of the permuted result (a channels-last input) and a strided one whose
    weight gradient comes back channels-last (AccumulateGrad copies it)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.norm = nn.LayerNorm(16)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.down = nn.Conv2d(16, 32, 2, stride=2)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = self.down(torch.relu(self.conv(x)).contiguous(memory_format=torch.channels_last))
        return self.head(x.mean((2, 3)))


def test_channels_last_convolutions_replay_in_the_conv_mode(tmp_path):
    from monet_like.verify import VARIANT_TOLERANCE

    torch.manual_seed(0)
    model = ChannelsLastNet()
    path = tmp_path / "cl.json"
    compiled = solved(model, (3, 16, 16), 8, 0.5, path, mode="conv_normal")
    sol = compiled.solution
    assert sol.variants == ["conv"] and sum(len(s["recompute"]) for s in sol.stages)
    x = torch.randn(8, 3, 16, 16)
    same = eager_with_algorithms(model, compiled.graph, sol.algorithms)
    assert compare_with_eager(model, path, (3, 16, 16), x, same).within(VARIANT_TOLERANCE)
    wrapped = ScheduleWrapper(model, path, (3, 16, 16))
    assert measured_peak(wrapped, x) <= sol.predicted_peak_bytes <= sol.budget_bytes


def _profile(model, graph):
    from monet_like.profile import profile

    return profile(model, graph, repeats=1, progress=False)


# -- random edits of a schedule's decisions -----------------------------------------------


@pytest.fixture(scope="module")
def dropout_schedule(tmp_path_factory):
    torch.manual_seed(0)
    model = SiluNet()
    path = tmp_path_factory.mktemp("edits") / "s.json"
    solved(model, (3, 16, 16), 4, 0.3, path)
    return model, path, json.loads(path.read_text())


_EDITS = ("flip_keep", "add_recompute", "drop_recompute", "move_node", "swap_stage_ops")


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(edits=st.lists(st.tuples(st.sampled_from(_EDITS), st.integers(0, 10**6)), min_size=1))
def test_edited_decisions_are_refused_or_replay_exactly_within_budget(
    dropout_schedule, edits, tmp_path_factory
):
    model, _, original = dropout_schedule
    data = json.loads(json.dumps(original))
    n_units, n_stages = len(data["units"]), len(data["stages"])
    for edit, k in edits:
        stage = data["stages"][k % n_stages]
        if edit == "flip_keep":
            data["keep"][k % n_units] = not data["keep"][k % n_units]
        elif edit == "add_recompute":
            stage["recompute"] = sorted(set(stage["recompute"]) | {k % n_units})
        elif edit == "drop_recompute" and stage["recompute"]:
            stage["recompute"].pop(k % len(stage["recompute"]))
        elif edit == "move_node":
            src = data["units"][k % n_units]
            if src:
                node = src.pop(k % len(src))
                data["units"][(k // 7) % n_units].append(node)
        elif edit == "swap_stage_ops" and len(stage["ops"]) > 1:
            i = k % (len(stage["ops"]) - 1)
            stage["ops"][i], stage["ops"][i + 1] = stage["ops"][i + 1], stage["ops"][i]
    path = tmp_path_factory.mktemp("edit") / "e.json"
    path.write_text(json.dumps(data))
    try:
        wrapped = ScheduleWrapper(model, path, (3, 16, 16))
    except (ScheduleError, SolutionFileError) as exc:
        assert "\n" not in str(exc)
        return
    except UserError as exc:  # any other refusal is one line too
        assert "\n" not in str(exc)
        return
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    assert compare_with_eager(model, path, (3, 16, 16), x).bitwise
    assert measured_peak(wrapped, x) <= load(path).budget_bytes


def test_full_mode_under_autocast_keeps_float32_batch_norms_out_of_place(tmp_path):
    """Under bfloat16 autocast a BatchNorm with float32 parameters keeps float32 statistics of
    its bfloat16 input; the in-place BatchNorm writes them in the input's dtype, so the full
    mode leaves such a BatchNorm as it is, and the replay stays within tolerance."""
    from monet_like.verify import VARIANT_TOLERANCE

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 16 * 16, 10),
    )  # fmt: skip
    path = tmp_path / "mixed.json"
    compiled = solved(model, (3, 16, 16), 4, 0.5, path, mode="inplace_conv_multiway_newnode",
                      autocast=torch.bfloat16)  # fmt: skip
    algorithms = compiled.solution.algorithms
    # eager running the convolution algorithms the schedule chose
    reference = eager_with_algorithms(model, compiled.graph, algorithms) if algorithms else None
    x = torch.randn(4, 3, 16, 16)
    # within the variants' tolerance: output-activated BatchNorm is not bitwise
    diff = compare_with_eager(model, path, (3, 16, 16), x, reference)
    assert diff.within(VARIANT_TOLERANCE), diff
    wrapped = ScheduleWrapper(model, path, (3, 16, 16))
    assert measured_peak(wrapped, x) <= wrapped.solution.predicted_peak_bytes


def _bias_before_batch_norm() -> tuple[nn.Module, torch.Tensor]:
    """A net with a BatchNorm's bias feeding another BatchNorm (through a convolution),
    whose gradient is zero in exact arithmetic, and an input for it."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 16, 1),
        nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10),
    )  # fmt: skip
    return model, torch.randn(8, 3, 8, 8)


def test_rounding_is_told_from_a_wrong_step_by_a_float64_step():
    """A BatchNorm's bias before another BatchNorm has a gradient of zero in exact arithmetic:
    in float32 it is rounding noise, which other convolution algorithms change by ~100%
    (the per-tensor relative rule fails). Against the step in float64 such a replay is as
    far off as eager; a step that computes something else (another epsilon) is not."""
    from types import SimpleNamespace

    from monet_like.variants import apply
    from monet_like.verify import (
        ROUNDING_RATIO,
        VARIANT_TOLERANCE,
        compare_steps,
        float64_error_ratio,
        training_step,
    )

    model, x = _bias_before_batch_norm()
    graph = apply(capture(model, (3, 8, 8), 8), ("conv",))
    im2col = {site["id"]: [0, 0, 0] for site in graph.sites if site.get("algorithm")}
    sol = SimpleNamespace(autocast=None, input_grad=False)
    eager = copy.deepcopy(model)
    eager_step = training_step(eager, eager, x)
    other = eager_with_algorithms(model, graph, im2col)
    other_step = training_step(other, other, x)
    diff = compare_steps(eager, eager_step, other, other_step)
    assert not diff.within(VARIANT_TOLERANCE)  # bn1.bias: 3e-7 of noise, changed by ~100%
    ratio = float64_error_ratio(model, x, sol, eager, eager_step, other, other_step)
    assert ratio <= ROUNDING_RATIO
    wrong = copy.deepcopy(model)
    wrong[1].eps = 1e-4
    wrong_step = training_step(wrong, wrong, x)
    assert float64_error_ratio(model, x, sol, eager, eager_step, wrong, wrong_step) > 100


def test_under_autocast_rounding_is_told_from_a_wrong_step_by_a_float64_step():
    """Under bfloat16 autocast the float64 step (without autocast) is the exact value both
    steps round: a replay running other kernels is as far from it as eager (a BatchNorm
    from its output under bfloat16 changed a bias gradient that is zero in exact
    arithmetic by 21% of its noise), a step that updates its statistics otherwise is not."""
    from types import SimpleNamespace

    from monet_like.variants import apply
    from monet_like.verify import ROUNDING_RATIO, compare_steps, float64_error_ratio, training_step

    model, x = _bias_before_batch_norm()
    graph = apply(capture(model, (3, 8, 8), 8, autocast=torch.bfloat16), ("conv",))
    chunked = {site["id"]: [-2, -2, -2] for site in graph.sites if site.get("algorithm")}
    sol = SimpleNamespace(autocast="bfloat16", input_grad=False)
    eager = copy.deepcopy(model)
    eager_step = training_step(eager, eager, x, autocast="bfloat16")
    other = eager_with_algorithms(model, graph, chunked)
    other_step = training_step(other, other, x, autocast="bfloat16")
    assert not compare_steps(eager, eager_step, other, other_step).bitwise
    assert float64_error_ratio(model, x, sol, eager, eager_step, other, other_step) <= (
        ROUNDING_RATIO
    )
    wrong = copy.deepcopy(model)
    wrong[1].momentum = 0.2
    wrong_step = training_step(wrong, wrong, x, autocast="bfloat16")
    assert float64_error_ratio(model, x, sol, eager, eager_step, wrong, wrong_step) > 100


class ZeroInitResidual(nn.Module):
    """A residual block whose branch ends in a BatchNorm with gamma zero-initialised."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.branch = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        nn.init.zeros_(self.branch[1].weight)
        self.head = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        h = self.stem(x)
        return self.head(torch.relu(h + self.branch(h)).flatten(1))


def test_output_activated_batch_norm_is_left_out_where_gamma_is_zero(tmp_path, monkeypatch):
    """Residual branches zero-initialised (timm's default for ResNets; torchvision's
    zero_init_residual) start with gamma = 0, which output-activated BatchNorm divides by:
    the full mode leaves that BatchNorm as PyTorch runs it (it keeps its input), says so,
    and replays within tolerance of eager and within its prediction; the other BatchNorm
    still runs output-activated."""
    import monet_like.solver as solver_module
    from monet_like.variants.multiway import divided_by_gamma
    from monet_like.verify import VARIANT_TOLERANCE

    # This block is faster with the convolution algorithms alone, which the solve would
    # keep: only the mode's own graph is weighed, so that its BatchNorms are what replays.
    weighed = solver_module.candidate_graphs
    monkeypatch.setattr(solver_module, "candidate_graphs", lambda *a: weighed(*a)[:1])
    torch.manual_seed(0)
    model = ZeroInitResidual()
    lines: list[str] = []
    path = tmp_path / "full.json"
    compiled = compile_schedule(
        model, (3, 16, 16), 2, budget_fraction=0.5, mode="inplace_conv_multiway_newnode",
        solver="HIGHS", repeats=1, time_limit=60, output=path, progress=lines.append,
    )  # fmt: skip
    assert any("keep their input" in line and "branch.1.weight" in line for line in lines), lines
    sol = compiled.solution
    assert len(sol.plain_batch_norms) == 1
    wrapped = ScheduleWrapper(model, path, (3, 16, 16))
    gammas = {wrapped.graph.placeholders[i][1] for i in wrapped._gammas}
    assert "branch.1.weight" not in gammas  # no backward divides by the zero gamma
    assert "stem.1.weight" in gammas and divided_by_gamma(wrapped.graph.fx)
    x = torch.randn(2, 3, 16, 16)
    same = eager_with_algorithms(model, compiled.graph, sol.algorithms)
    assert compare_with_eager(model, path, (3, 16, 16), x, same).within(VARIANT_TOLERANCE)
    assert measured_peak(wrapped, x) <= sol.predicted_peak_bytes <= sol.budget_bytes
    with torch.no_grad():  # training drives a divided-by gamma to zero: refused, named
        model.stem[1].weight[5] = 0.0
    with pytest.raises(UserError, match=r"stem\.1\.weight has reached 0\.0e\+00"):
        wrapped(x)


class RotaryLike(nn.Module):
    """Qwen2's rotary embedding, small: `q * cos + rotate_half(q) * sin` with q a transposed
    view, so the sum is laid out as q is; added in place into the contiguous second term
    instead, a later view of it (transpose, reshape) no longer fits."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x).view(x.shape[0], 8, 2, 8).transpose(1, 2)
        rotated = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
        y = q * 2.0 + rotated * 3.0
        return self.o(y.transpose(1, 2).reshape(x.shape[0], 8, 16))


def test_in_place_add_keeps_the_layout_later_views_need(tmp_path):
    torch.manual_seed(0)
    model = RotaryLike()
    solved(model, (8, 16), 4, 1.0, tmp_path / "s.json", mode="inplace")
    assert_exact(model, tmp_path / "s.json", (8, 16), 4)
