"""Command line: `python -m monet_like COMMAND ...`.

  profile MODEL BATCH   capture the graph, predict the store-all peak, profile every node
  memory  MODEL BATCH   capture and predict only (nothing allocated: any batch size)
  frontier MODEL BATCH  budgets from store-all down, measured beside PyTorch's own tools
  zoo list|verify|download   the solution zoo

Bad input gets one line on stderr and exit code 2; with --json the last line of
standard output is one JSON object.
"""

from monet_like.cli.check import build_check_parser, check_main
from monet_like.cli.commands import build_parser, main
from monet_like.cli.common import (
    DEFAULT_TIME_LIMIT,
    default_solution_name,
    parse_dtype,
    positive_int,
)
from monet_like.cli.solve import build_solve_parser, solve_main

__all__ = [
    "DEFAULT_TIME_LIMIT",
    "build_check_parser",
    "build_parser",
    "build_solve_parser",
    "check_main",
    "default_solution_name",
    "main",
    "parse_dtype",
    "positive_int",
    "solve_main",
]
