"""Units shared by every stage: budgets are given and reported in GB of 2**30 bytes
(MONeT's convention, so its numbers compare directly)."""

GIB = 2**30
