"""What every command shares: argument types, the model and device set-up, default
file names, and `_run`, which turns errors into one line and an exit code."""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import signal
import sys

import torch

from monet_like.errors import UserError

DEFAULT_TIME_LIMIT = 600.0  # seconds: "solved in minutes"; the start is kept if nothing better


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


_MAX_BUDGET_GB = 2.0**20  # a PiB: beyond any machine, so a typo rather than a budget


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, as for every other bad input
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_dtype(text: str) -> torch.dtype:
    dtype = _DTYPES.get(text.lower().removeprefix("torch."))
    if dtype is None:
        raise UserError(
            f"dtype {text!r} is not one a model can train in: use float32, bfloat16, "
            "float16 or float64"
        )
    return dtype


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def batch_or_auto(text: str) -> int | str:
    """A batch size, or "auto" (solve.py: the largest batch whose schedule fits)."""
    return "auto" if text.strip().lower() == "auto" else positive_int(text)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help='"torchvision.models.NAME(...)", unet, gpt, or pkg.module:factory')
    p.add_argument("batch", type=positive_int, help="batch size")
    p.add_argument("--input_shape", help="per-sample input shape without batch, e.g. 3,224,224")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")


def _numbers(text: str, option: str, low: float, high: float) -> tuple[float, ...]:
    """Comma-separated numbers within [low, high], or one line saying which is not."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{option} takes comma-separated numbers, got {text!r}") from None
    bad = [v for v in values if not (math.isfinite(v) and low <= v <= high)]
    if not values or bad:
        raise UserError(f"{option}: every value must be within [{low:g}, {high:g}], got {text!r}")
    return values


def _setup(args):
    from monet_like.models import parse_input_shape, parse_model

    spec = parse_model(args.model)
    if args.input_shape:
        shape = parse_input_shape(args.input_shape)
    else:
        shape = spec.default_input_shape()
        if shape is None:
            raise UserError(f"{args.model}: give the per-sample input shape with --input_shape")
    dtype = parse_dtype(args.dtype)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {args.device!r}: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {args.device!r} is not supported: use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA device is available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} GPUs")
    return spec, shape, dtype, device


def default_solution_name(spec, batch: int, mode: str, budget_gb: float, **config) -> str:
    """MONeT's file name, `solution_<model>_<batch>_<mode>_<budget>.json`, with what else
    makes a schedule different appended where it is not the default: a short hash of the
    model's arguments, the input shape, the dtype, and the options in `config` (name ->
    value; a value that is False, None or the default is left out)."""
    import hashlib

    parts = [spec.name, str(batch), mode, f"{budget_gb:g}"]
    if spec.args or spec.kwargs:
        parts.append(hashlib.sha256(repr((spec.args, spec.kwargs)).encode()).hexdigest()[:8])
    shape = config.pop("input_shape", None)
    if shape is not None and tuple(shape) != spec.default_input_shape():
        parts.append("x".join(str(d) for d in shape))
    dtype = config.pop("dtype", "float32")
    if dtype != "float32":
        parts.append(dtype)
    for name, value in config.items():
        if value is True:
            parts.append(name)
        elif value not in (None, False):
            parts.append(f"{name}{value}")
    return "solution_" + "_".join(parts) + ".json"


def _naming(args) -> dict:
    """The options that make a schedule different, for its default file name."""
    return dict(
        input_shape=getattr(args, "shape", None),
        dtype=str(args.torch_dtype).removeprefix("torch."),
        full=args.formulation == "full" if hasattr(args, "formulation") else False,
        depth=getattr(args, "depth", None),
        frees=getattr(args, "frees", None) is True,
        nofrees=getattr(args, "frees", None) is False,  # the default tries them
        ablation=getattr(args, "ablation", False),
        inputgrad=getattr(args, "input_grad", False),
        outputsfreed=getattr(args, "outputs_freed", False),
        autocast=getattr(args, "autocast", None),
    )


class CheckFailed(Exception):
    """schedule.py's check found the peak over budget or the gradients off: exit 1."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, taken like Ctrl-C: every `finally` runs (the solver's racing processes
    are stopped, no file is left half written)."""


def _terminate(signum, frame):
    raise Terminated()


def _run(prog: str, args, command) -> int:
    """Run a command: one line on stderr and exit 2 for the user's errors, 1 for a check
    that failed, the JSON report as the last line of stdout with --json."""
    from monet_like.solver import InfeasibleBudget

    previous = signal.signal(signal.SIGTERM, _terminate)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` prints where a long run is, and goes on
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (AttributeError, ValueError, OSError):  # stderr has no file descriptor
            pass
    try:
        report = command(args)
    except InfeasibleBudget as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        if args.json:
            print(
                json.dumps(
                    {
                        "status": "infeasible",
                        "min_feasible_budget_bytes": exc.min_budget_bytes,
                        "fixed_bytes": exc.fixed_bytes,
                    }
                )
            )
        return 2
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except CheckFailed as exc:
        print(f"{prog}: check failed: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps(getattr(args, "failed_report", {})))
        return 1
    except Terminated:
        print(f"{prog}: terminated; nothing written", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; nothing written", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        print(json.dumps(report))
    return 0
