"""Units shared by every stage: budgets are given and reported in GB of 2**30 bytes
(MONeT's convention, so its numbers compare directly)."""

import math

GIB = 2**30


def gb_at_least(n_bytes: int, decimals: int = 4) -> str:
    """`n_bytes` in GB, rounded up at `decimals`: a budget printed so and typed back is
    not below it (0.0563 GB printed as 0.056 would be)."""
    step = 10.0**-decimals
    gb = math.ceil(n_bytes / GIB / step) * step
    while int(gb * GIB) < n_bytes:  # the float's own rounding, at an exact step
        gb += step
    return f"{gb:.{decimals}f}"
