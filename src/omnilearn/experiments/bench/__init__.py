"""``omnilearn bench``: the balancing benchmark (BSP and ASP arms, plain DDP, faults) and its statistics."""
