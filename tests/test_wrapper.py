"""ScheduleWrapper: replayed steps equal eager PyTorch and stay inside the prediction."""

import copy
import json

import pytest
import torch
from torch.utils._pytree import tree_flatten

from monet_like import ScheduleWrapper
from monet_like.errors import UserError
from monet_like.graph import capture, default_loss
from monet_like.memory import (
    measure_allocator,
    measure_training_step,
    state_tensors,
    training_step,
)
from monet_like.models import make_input, parse_model
from monet_like.profile import profile
from monet_like.schedule import ORIGINAL, build, finalize
from monet_like.solution import SolutionFileError
from monet_like.solver import DEFAULT_DEPTH, MIN_BUDGET_TIME_LIMIT, min_feasible_budget, solve
from monet_like.solver.evaluate import evaluate
from monet_like.solver.formulation import formulate
from monet_like.solver.problem import build_problem
from monet_like.solver.start import least_peak_start
from monet_like.wrapper import ScheduleMismatch, _slots

# (expression, input shape, batch, recomputation depth of the compact formulation;
# None: the full formulation). DenseNet's dense connectivity gives every stage hundreds
# of ancestors within 16 steps (75k binaries): depth 2 keeps its test at seconds. The
# GPT's tightest schedules recompute whole blocks, freeing each input after its last
# reader in the full formulation, and in the compact one with frees (FREES, depth 16):
# replayed too.
FREES = "compact formulation with frees"
MODELS = [
    ("torchvision.models.resnet18()", (3, 64, 64), 16, DEFAULT_DEPTH),
    # Batch 16: the smallest feasible budget is 49% of store-all, so 50% runs as itself.
    ("torchvision.models.mobilenet_v2()", (3, 64, 64), 16, DEFAULT_DEPTH),
    ("torchvision.models.googlenet()", (3, 64, 64), 4, DEFAULT_DEPTH),
    ("torchvision.models.densenet121()", (3, 32, 32), 4, 2),
    ("unet(base=8)", (3, 64, 64), 4, DEFAULT_DEPTH),
    ("gpt(depth=2, dim=64)", (64,), 8, DEFAULT_DEPTH),
    ("gpt(depth=2, dim=64)", (64,), 8, None),
    ("gpt(depth=2, dim=64)", (64,), 8, FREES),
]


def solved(
    expression,
    shape,
    batch,
    fractions,
    tmp_path,
    depth=DEFAULT_DEPTH,
    input_grad=False,
    of_store_all=False,
):
    """Yield (budget, solution file, model) for budgets spread over the feasible range:
    1.0 is the store-all peak, 0.0 the smallest feasible budget. With `of_store_all`,
    the fractions are of the store-all peak instead; one below the smallest feasible
    budget becomes that budget, tested once."""
    torch.manual_seed(0)
    model = parse_model(expression).build()
    graph = capture(model, shape, batch, model_name=expression, input_grad=input_grad)
    prof = profile(model, graph, repeats=1, progress=False)
    problem = build_problem(graph, prof)
    frees = depth == FREES
    depth = DEFAULT_DEPTH if frees else depth
    # With the frees the window search goes on lowering the smallest budget by a percent
    # or so for minutes: 30 s, as the budgets tested are what the replay is checked at.
    low = min_feasible_budget(
        problem,
        depth,
        False,
        "HIGHS",
        time_limit=30 if frees else MIN_BUDGET_TIME_LIMIT,
        frees=frees,
    )
    peak = problem.store_all_peak_bytes
    if of_store_all:
        budgets = sorted({max(low, int(f * peak)) for f in fractions}, reverse=True)
    else:
        budgets = [int(low + f * (peak - low)) for f in fractions]
    for budget in budgets:
        formulation = "compact" if depth is not None else "full"
        sol = solve(
            graph,
            prof,
            budget,
            solver="HIGHS",
            time_limit=30 if frees else 120,  # the frees' bound is weak: stopped, not proved
            depth=depth,
            formulation=formulation,
            frees=frees,
        )
        if sol.formulation != "store-all":
            assert sol.stats["frees"] == (frees or depth is None)
        bound = sol.predicted_peak_bytes
        assert_recomputation_reads_its_own_versions(build(graph, sol))
        finalize(graph, sol, prof)
        assert sol.predicted_peak_bytes <= bound <= budget
        path = sol.save(tmp_path / f"{budget}.json")
        yield budget, path, model, sol


def assert_recomputation_reads_its_own_versions(schedule) -> None:
    """A value recomputed before a stage is read in that stage's version by the other
    recomputations, never as the forward pass's (that one, dropped, would have to be
    held alive, uncounted: ResNet's residual add_ once read its shortcut's stale value)."""
    emitted: dict[int, set[str]] = {}
    for step in schedule.steps:
        if step.version != ORIGINAL:
            emitted.setdefault(step.version, set()).add(step.node)
    for step in schedule.steps:
        if step.version != ORIGINAL:
            stale = [n for n, v in step.reads if v == ORIGINAL and n in emitted[step.version]]
            assert not stale, (step.node, step.version, stale)


def eager_and_replayed(model, path, shape, batch):
    eager, replayed = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = ScheduleWrapper(replayed, path, shape)
    x = make_input(model, shape, batch, torch.float32)
    torch.manual_seed(1)
    out_e = eager(x)
    default_loss(out_e).backward()
    torch.manual_seed(1)
    out_r = wrapped(x)
    default_loss(out_r).backward()
    return eager, replayed, wrapped, x, out_e, out_r


@pytest.mark.parametrize("expression, shape, batch, depth", MODELS)
def test_replay_equals_eager_and_fits_the_prediction(expression, shape, batch, depth, tmp_path):
    # 100%, 70% and 50% of the store-all peak, and the smallest feasible budget. At
    # these sizes the smallest is 49% (MobileNetV2) to 97% (GoogLeNet) of store-all:
    # 50% is below it for every model but MobileNetV2, and 70% for ResNet-18,
    # GoogLeNet and DenseNet; such a budget is replaced by the smallest.
    budgets = solved(
        expression, shape, batch, (1.0, 0.7, 0.5, 0.0), tmp_path, depth, of_store_all=True
    )
    tested = []
    for budget, path, model, sol in budgets:
        tested.append(budget)
        eager, replayed, wrapped, x, out_e, out_r = eager_and_replayed(model, path, shape, batch)
        # Same aten ops on the same inputs: bitwise equal, recomputation included.
        for a, b in zip(tree_flatten(out_e)[0], tree_flatten(out_r)[0], strict=True):
            assert torch.equal(a, b)
        for (name, p), q in zip(eager.named_parameters(), replayed.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or torch.equal(p.grad, q.grad), name
        # Running statistics updated once, not again by recomputation.
        for (name, b1), b2 in zip(eager.named_buffers(), replayed.buffers(), strict=True):
            assert torch.equal(b1, b2), name

        replayed.zero_grad(set_to_none=True)
        live = measure_training_step(wrapped, x).peak_bytes
        allocator = measure_allocator(
            lambda w=wrapped, x=x: training_step(w, x), [*state_tensors(replayed), x]
        )
        assert live <= sol.predicted_peak_bytes * 1.02 and live <= budget
        # The allocator sees kernels' scratch too: still inside the budget.
        assert allocator <= sol.predicted_peak_bytes * 1.02 and allocator <= budget
        assert allocator == pytest.approx(sol.predicted_peak_bytes, rel=0.01)
    if "mobilenet_v2" in expression:  # its 50% budget ran as itself, not as the smallest
        assert int(0.5 * sol.store_all_peak_bytes) in tested


def test_a_value_held_across_a_bridged_stage_replays_as_predicted(tmp_path):
    """The softmax output held across the stage between its two readers
    (`formulation.bridge_stages`): the replay reads the held version, bitwise equal to
    eager, at the predicted peak."""
    torch.manual_seed(0)
    expression, shape, batch = "gpt(depth=2, dim=32, heads=4, max_len=128, dropout=0.0)", (128,), 4
    model = parse_model(expression).build()
    graph = capture(model, shape, batch, model_name=expression)
    prof = profile(model, graph, repeats=1, progress=False)
    problem = build_problem(graph, prof)
    # The greedy least-peak schedule's peak: the start heuristics reach it at once.
    f = formulate(problem, DEFAULT_DEPTH, True, frees=True)
    budget = evaluate(f, least_peak_start(f))["peak_bytes"]
    sol = solve(graph, prof, budget, solver="HIGHS", time_limit=30, frees=True)
    stages, kept = sol.stages, sol.keep
    held = [
        u
        for t in range(1, len(stages) - 1)
        if not problem.stages[t].need and stages[t]["candidates"]
        for u in stages[t]["candidates"]
        if not kept[u]
        and u in problem.stages[t + 1].need
        and u not in stages[t + 1]["recompute"]
        and u not in stages[t]["recompute"]
    ]
    assert held, "no value held across a stage that reads nothing"
    path = sol.save(tmp_path / "held.json")
    eager, replayed, wrapped, x, out_e, out_r = eager_and_replayed(model, path, shape, batch)
    assert torch.equal(out_e, out_r)
    for (name, p), q in zip(eager.named_parameters(), replayed.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    replayed.zero_grad(set_to_none=True)
    allocator = measure_allocator(lambda: training_step(wrapped, x), [*state_tensors(replayed), x])
    assert allocator <= budget
    assert allocator == pytest.approx(sol.predicted_peak_bytes, rel=0.01)


@pytest.mark.parametrize(
    "expression, shape, batch",
    [("torchvision.models.resnet18()", (3, 64, 64), 16), ("unet(base=8)", (3, 64, 64), 4)],
)
def test_input_gradient_equals_eager(expression, shape, batch, tmp_path):
    fractions = (1.0, 0.0)
    budgets = solved(expression, shape, batch, fractions, tmp_path, input_grad=True)
    for fraction, (budget, path, model, sol) in zip(fractions, budgets, strict=True):
        assert sol.input_grad
        if fraction == 0.0:  # the smallest budget: values are dropped and recomputed
            assert budget < sol.store_all_peak_bytes and not all(sol.keep)
        eager, replayed = copy.deepcopy(model), copy.deepcopy(model)
        wrapped = ScheduleWrapper(replayed, path, shape)
        x = make_input(model, shape, batch, torch.float32)
        x_e, x_r = x.clone().requires_grad_(), x.clone().requires_grad_()
        default_loss(eager(x_e)).backward()
        default_loss(wrapped(x_r)).backward()
        assert x_r.grad is not None and torch.equal(x_e.grad, x_r.grad)
        for p, q in zip(eager.parameters(), replayed.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        # The same schedule with an input that needs no gradient: parameters only.
        replayed.zero_grad(set_to_none=True)
        default_loss(wrapped(x)).backward()
        assert x.grad is None
        replayed.zero_grad(set_to_none=True)  # a step from no gradients, as predicted
        x_r.grad = None
        allocator = measure_allocator(
            lambda w=wrapped, x=x_r: training_step(w, x), [*state_tensors(replayed), x_r]
        )
        # The allocator also sees the user's loss scalar, which no schedule predicts.
        assert allocator == pytest.approx(sol.predicted_peak_bytes, rel=0.01)
        assert allocator <= sol.predicted_peak_bytes * 1.02


@pytest.fixture(scope="module")
def resnet_solution(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sol")
    budget, path, model, sol = next(
        solved("torchvision.models.resnet18()", (3, 64, 64), 16, (0.3,), tmp)
    )
    return path, model, sol


def test_wrapper_shares_parameters_and_modes(resnet_solution):
    path, model, sol = resnet_solution
    wrapped = ScheduleWrapper(model, path, (3, 64, 64))
    assert [id(p) for p in wrapped.parameters()] == [id(p) for p in model.parameters()]
    assert wrapped.state_dict().keys() == {f"model.{k}" for k in model.state_dict()}
    x = make_input(model, (3, 64, 64), 16, torch.float32)
    wrapped.eval()
    with torch.no_grad():
        assert torch.equal(wrapped(x), model(x))  # eval: the model's own forward
    wrapped.train()
    with torch.no_grad():
        before = model.bn1.num_batches_tracked.clone()
        wrapped(torch.randn(3, 3, 64, 64))  # no_grad: plain forward, any batch
        assert model.bn1.num_batches_tracked == before + 1


def test_a_mismatched_graph_is_explained_by_the_device_or_torch_it_was_solved_on(
    resnet_solution, tmp_path
):
    path, model, sol = resnet_solution
    assert sol.torch_version == torch.__version__  # recorded by the solve
    data = json.loads(path.read_text())
    data["fingerprint"] = "0" * 16  # as another torch's or device's graph would give
    cases = {
        "cuda": (
            dict(data, device="cuda"),
            "solved on cuda, and PyTorch runs other kernels on cpu",
        ),
        "torch": (dict(data, torch_version="2.0.0"), "solved under torch 2.0.0"),
        "unknown": (
            {k: v for k, v in data.items() if k != "torch_version"},
            "solve again for this",
        ),
    }
    for name, (edited, why) in cases.items():
        file = tmp_path / f"{name}.json"
        file.write_text(json.dumps(edited))
        with pytest.raises(ScheduleMismatch, match="another graph") as err:
            ScheduleWrapper(model, file, (3, 64, 64))
        assert why in str(err.value), name


def test_refusals(resnet_solution, tmp_path):
    path, model, sol = resnet_solution
    with pytest.raises(ScheduleMismatch, match="input shape"):
        ScheduleWrapper(model, path, (3, 32, 32))
    other = parse_model("torchvision.models.resnet34()").build()
    with pytest.raises(ScheduleMismatch, match="another graph"):
        ScheduleWrapper(other, path, (3, 64, 64))
    wrapped = ScheduleWrapper(model, path, (3, 64, 64))
    with pytest.raises(ScheduleMismatch, match="solved for"):
        wrapped(torch.randn(8, 3, 64, 64))
    with pytest.raises(UserError, match="solve again with --input_grad"):
        wrapped(torch.randn(16, 3, 64, 64, requires_grad=True))
    text = path.read_text()
    (tmp_path / "cut.json").write_text(text[:100])
    with pytest.raises(SolutionFileError, match="truncated"):
        ScheduleWrapper(model, tmp_path / "cut.json", (3, 64, 64))
    newer = json.loads(text)
    newer["format_version"] += 1
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    with pytest.raises(SolutionFileError, match="newer"):
        ScheduleWrapper(model, tmp_path / "newer.json", (3, 64, 64))


def test_training_steps_match_eager_over_several_iterations(resnet_solution):
    path, model, sol = resnet_solution
    eager, replayed = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = ScheduleWrapper(replayed, path, (3, 64, 64))
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_r = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(16, 3, 64, 64, generator=torch.Generator().manual_seed(step))
        for net, opt in ((eager, opt_e), (wrapped, opt_r)):
            opt.zero_grad()
            net(x).logsumexp(1).mean().backward()  # any loss, not only the sum
            opt.step()
    for p, q in zip(eager.parameters(), replayed.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_parameter_assigned_after_wrapping_is_the_one_replayed(resnet_solution):
    path, model, sol = resnet_solution
    eager, replayed = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = ScheduleWrapper(replayed, path, (3, 64, 64))
    for net in (eager, replayed):  # as a fine-tuning script replaces a head
        net.fc.weight = torch.nn.Parameter(net.fc.weight.detach() * 2)
    x = torch.randn(16, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    default_loss(eager(x)).backward()
    default_loss(wrapped(x)).backward()
    assert replayed.fc.weight.grad is not None
    for p, q in zip(eager.parameters(), replayed.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_the_step_reads_parameters_and_buffers_as_the_module_lists_them():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            self.head.weight = self.embed.weight  # listed once
            self.again = self.embed  # a module under two names: walked once
            self.norm = torch.nn.BatchNorm1d(4, track_running_stats=False)  # None buffers
            self.register_buffer("scale", torch.ones(4))

    model = Tied()
    for kind, listed in (("_parameters", model.parameters()), ("_buffers", model.buffers())):
        slots = _slots(model, kind)
        assert [id(table[key]) for table, key in slots] == [id(t) for t in listed]
    assert len(_slots(model, "_parameters")) == 5 and len(_slots(model, "_buffers")) == 1


def test_a_deep_copy_trains_its_own_parameters_as_the_original(resnet_solution):
    path, model, sol = resnet_solution
    wrapped = ScheduleWrapper(copy.deepcopy(model), path, (3, 64, 64))
    twin = copy.deepcopy(wrapped)  # an EMA copy, a replica
    ours = list(wrapped.parameters())
    assert len(ours) == len(list(twin.parameters()))
    assert all(
        p is not q and torch.equal(p, q) for p, q in zip(ours, twin.parameters(), strict=True)
    )
    counted = int(wrapped.model.bn1.num_batches_tracked)
    x = torch.randn(16, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    for net in (wrapped, twin):
        default_loss(net(x)).backward()
    for p, q in zip(ours, twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert (
        twin.model.bn1.num_batches_tracked == wrapped.model.bn1.num_batches_tracked == counted + 1
    )
