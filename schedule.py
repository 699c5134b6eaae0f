"""python schedule.py MODEL BATCH BUDGET_GB MODE SOLVER --solution_file F [--run_bs]
[--check_runtime] [--check_diff] [--json]: replay a schedule and check it (MONeT's checks).
"""

import sys

from monet_like.cli import check_main

if __name__ == "__main__":
    sys.exit(check_main())
