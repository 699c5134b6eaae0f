"""DistributedDataParallel(ScheduleWrapper(...)): two processes (gloo) train like one."""

import copy
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from monet_like.graph import capture
from monet_like.models import parse_model
from monet_like.profile import profile
from monet_like.schedule import finalize
from monet_like.solver import DEFAULT_DEPTH, min_feasible_budget, solve
from monet_like.solver.problem import build_problem
from monet_like.wrapper import ScheduleWrapper

# No BatchNorm and no dropout: per-process batch statistics or masks would differ
# from the single-process run on the concatenated batch by design, not by a bug.
MODEL = "gpt(depth=2, dim=32, heads=2, vocab_size=64, dropout=0.0)"
SEQ, PER_RANK = 16, 4


def _worker(rank: int, world: int, init_file: str, solution: str, state: dict, out: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = parse_model(MODEL).build()
    model.load_state_dict(state)
    ddp = torch.nn.parallel.DistributedDataParallel(ScheduleWrapper(model, solution, (SEQ,)))
    tokens = torch.load(os.path.join(os.path.dirname(out), "tokens.pt"))
    mine = tokens[rank * PER_RANK : (rank + 1) * PER_RANK]
    ddp(mine).sum().backward()
    if rank == 0:
        torch.save({n: p.grad for n, p in model.named_parameters()}, out)
    dist.barrier()
    del ddp  # its reducer holds the process group: drop it so the group really closes
    dist.destroy_process_group()
    # Skip interpreter finalization: gloo's threads torn down there abort the worker now and
    # then ("terminate called without an active exception") after all the work is done.
    os._exit(0)


def test_ddp_two_processes_match_one_process_on_the_whole_batch(tmp_path):
    torch.manual_seed(0)
    model = parse_model(MODEL).build()
    graph = capture(model, (SEQ,), PER_RANK)
    prof = profile(model, graph, repeats=1, progress=False)
    problem = build_problem(graph, prof)
    low = min_feasible_budget(problem, DEFAULT_DEPTH, False, "HIGHS")
    sol = solve(graph, prof, low, solver="HIGHS")  # the tightest schedule: recomputes
    assert any(s["recompute"] for s in sol.stages)
    finalize(graph, sol, prof)
    path = str(sol.save(tmp_path / "sol.json"))

    tokens = torch.randint(0, 64, (2 * PER_RANK, SEQ), generator=torch.Generator().manual_seed(3))
    torch.save(tokens, tmp_path / "tokens.pt")
    state = copy.deepcopy(model.state_dict())
    out = str(tmp_path / "grads.pt")
    mp.spawn(_worker, args=(2, str(tmp_path / "rdzv"), path, state, out), nprocs=2, join=True)
    ddp_grads = torch.load(out)

    reference = parse_model(MODEL).build()
    reference.load_state_dict(state)
    (reference(tokens).sum() / 2).backward()  # DDP averages the two ranks' gradients
    for name, p in reference.named_parameters():
        assert torch.allclose(ddp_grads[name], p.grad, rtol=1e-5, atol=1e-6), name
