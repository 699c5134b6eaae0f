"""python solve.py MODEL BATCH BUDGET_GB MODE SOLVER [options]: MONeT's argument order.

Example: python solve.py "torchvision.models.resnet50()" 184 10 normal HIGHS
"""

import sys

from monet_like.cli import solve_main

if __name__ == "__main__":
    sys.exit(solve_main())
