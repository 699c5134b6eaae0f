"""Build the solution zoo: MONeT's five configurations at 10 to 5 GB, in two modes.

    python scripts/build_zoo.py [--models resnet50,...] [--modes normal,...]
                                [--budgets 10,9,8,7,6,5] [--solver HIGHS] [--time_limit 300]

Resumable: an entry whose file is in solutions/ with the index's sha256 and this
graph's fingerprint is kept; budgets found infeasible are recorded and not tried again.
Profiles come from the cache (solve.py's) and are copied to solutions/profiles/, so a
user can solve another budget of a zoo model without profiling. Every schedule is
simulated on fake tensors (its peak within the budget) before it is written.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import time
from pathlib import Path

import torch

from monet_like.graph import capture
from monet_like.models import parse_model
from monet_like.pipeline import compile_schedule
from monet_like.profile import cache_path
from monet_like.solution import load
from monet_like.solver import InfeasibleBudget
from monet_like.units import GIB
from monet_like.variants import apply as apply_variants
from monet_like.zoo import (
    MONET_CONFIGS,
    ZOO_DIR,
    ZooEntry,
    entry_for,
    entry_name,
    load_index,
    load_infeasible,
    readme_table,
    sha256_of,
    with_readme_table,
    write_index,
)

CONFIGS = MONET_CONFIGS
FULL = "inplace_conv_multiway_newnode"
README = Path(__file__).resolve().parent.parent / "README.md"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(CONFIGS))
    p.add_argument("--modes", default=f"normal,{FULL}")
    p.add_argument("--budgets", default="10,9,8,7,6,5")
    p.add_argument("--solver", default="HIGHS")
    p.add_argument("--time_limit", type=float, default=300.0)
    p.add_argument("--folder", default=str(ZOO_DIR))
    args = p.parse_args(argv)
    folder = Path(args.folder)
    (folder / "profiles").mkdir(parents=True, exist_ok=True)
    entries = {e.name: e for e in load_index(folder)}
    infeasible = {r["name"]: r for r in load_infeasible(folder)}
    for key in args.models.split(","):
        expression, batch, shape = CONFIGS[key]
        spec = parse_model(expression)
        torch.manual_seed(0)
        model = spec.build("cpu")
        captured = capture(model, shape, batch, model_name=expression)

        @functools.cache
        def fingerprint_with(variants: tuple[str, ...], captured=captured) -> str:
            return apply_variants(captured, variants).fingerprint

        for mode in args.modes.split(","):
            for budget_gb in (float(b) for b in args.budgets.split(",")):
                name = entry_name(spec.name, batch, mode, budget_gb)
                old = entries.get(name)
                if old is not None and _current(old, folder, fingerprint_with):
                    print(f"{name}: kept", flush=True)
                    continue
                if name in infeasible and infeasible[name]["torch_version"] == torch.__version__:
                    print(f"{name}: infeasible (recorded)", flush=True)
                    continue
                started = time.perf_counter()
                print(f"{name}: solving", flush=True)
                try:
                    compiled = compile_schedule(
                        model, shape, batch, int(budget_gb * GIB), mode, args.solver,
                        model_name=expression, time_limit=args.time_limit,
                        output=folder / f"{name}.json",
                        progress=lambda line: print(f"    {line}", flush=True),
                    )  # fmt: skip
                except InfeasibleBudget as exc:
                    infeasible[name] = {
                        "name": name,
                        "model": expression,
                        "batch": batch,
                        "mode": mode,
                        "budget_gb": budget_gb,
                        "min_feasible_budget_bytes": exc.min_budget_bytes,
                        "torch_version": torch.__version__,
                    }
                    write_index(list(entries.values()), folder, list(infeasible.values()))
                    print(f"{name}: infeasible ({exc})", flush=True)
                    continue
                sol = compiled.solution
                profiles = _ship_profiles(compiled, captured, folder)
                entries[name] = entry_for(folder / f"{name}.json", name, budget_gb, profiles)
                infeasible.pop(name, None)
                write_index(list(entries.values()), folder, list(infeasible.values()))
                print(
                    f"{name}: {sol.status}, peak {sol.predicted_peak_bytes / GIB:.3f} GB,"
                    f" overhead {sol.overhead:+.2%}, {time.perf_counter() - started:.0f} s",
                    flush=True,
                )
    print(f"{len(entries)} entries, {len(infeasible)} budgets infeasible, in {folder}")
    if folder.resolve() == ZOO_DIR.resolve():
        table = readme_table(folder)
        README.write_text(with_readme_table(README.read_text(), table))
        print(f"the zoo's table written to {README}")
    return 0


def _current(entry: ZooEntry, folder: Path, fingerprint_with) -> bool:
    """The entry's file is there, unaltered, solved with this torch, and its graph (the
    captured one with the schedule's variants, as the wrapper rebuilds it) is today's."""
    path = folder / entry.file
    if entry.torch_version != torch.__version__ or not path.exists():
        return False
    if sha256_of(path) != entry.sha256:
        return False
    return fingerprint_with(tuple(load(path).variants or ())) == entry.fingerprint


def _ship_profiles(compiled, captured, folder: Path) -> tuple[str, ...]:
    """Copy the cached profiles a solve used (its graph's and the captured graph's, at
    the batch they were taken) into folder/profiles; their file names."""
    shipped = []
    graph, batch = compiled.graph, compiled.profile.profile_batch
    device = torch.device(graph.device)
    for g in {graph.fingerprint: graph, captured.fingerprint: captured}.values():
        source = cache_path(g, batch, device)
        if source.exists():
            shutil.copyfile(source, folder / "profiles" / source.name)
            shipped.append(source.name)
    return tuple(shipped)


if __name__ == "__main__":
    sys.exit(main())
