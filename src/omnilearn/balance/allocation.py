"""Pure batch-allocation arithmetic: splitting a global batch among workers.

Every function here keeps the invariant ``sum(batches) == global_batch`` and
the bounds ``min_batch <= b_i <= max_batch``. No torch, no processes: the
controllers and the sampler build on these, and the unit tests exercise them
with hypothesis in microseconds (``pytest tests/unit/test_allocation.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


class InfeasibleBounds(ValueError):
    """The bounds cannot hold a split of the global batch."""


@dataclass(frozen=True)
class Bounds:
    """Per-worker batch bounds for ``workers`` workers sharing ``global_batch``."""

    global_batch: int
    workers: int
    min_batch: int = 1
    max_batch: int | None = None  # None: no upper bound beyond the global batch

    def __post_init__(self) -> None:
        check_feasible(self.global_batch, self.workers, self.min_batch, self.upper)

    @property
    def upper(self) -> int:
        return self.global_batch if self.max_batch is None else self.max_batch


def check_feasible(global_batch: int, workers: int, min_batch: int, max_batch: int) -> None:
    """Raise :class:`InfeasibleBounds` with a message that names the fix."""
    if workers < 1:
        raise InfeasibleBounds(f"workers={workers} must be at least 1")
    if global_batch < 1:
        raise InfeasibleBounds(f"global batch {global_batch} must be at least 1")
    if min_batch < 1:
        raise InfeasibleBounds(f"min batch {min_batch} must be at least 1")
    if min_batch > max_batch:
        raise InfeasibleBounds(
            f"min batch {min_batch} is larger than max batch {max_batch}; lower --min-batch or raise --max-batch"
        )
    if workers * min_batch > global_batch:
        raise InfeasibleBounds(
            f"global batch {global_batch} is smaller than workers x min batch = {workers} x {min_batch}; "
            f"raise --global-batch to at least {workers * min_batch} or lower --min-batch"
        )
    if workers * max_batch < global_batch:
        raise InfeasibleBounds(
            f"global batch {global_batch} is larger than workers x max batch = {workers} x {max_batch}; "
            f"lower --global-batch to at most {workers * max_batch} or raise --max-batch"
        )


def clamp_reshare(targets: Sequence[float], bounds: Bounds) -> list[float]:
    """Clamp real-valued shares into the bounds and re-share what clamping moved.

    What clamping takes from (or gives to) a worker is spread over the workers
    still inside the bounds, in proportion to their targets, until no bound is
    violated (water-filling). The result sums to ``bounds.global_batch``.
    """
    lo, hi, total = float(bounds.min_batch), float(bounds.upper), float(bounds.global_batch)
    shares = [max(float(t), 0.0) for t in targets]
    fixed: dict[int, float] = {}
    for _ in range(len(shares) + 1):
        free = [i for i in range(len(shares)) if i not in fixed]
        remaining = total - sum(fixed.values())
        weight = sum(shares[i] for i in free)
        for i in free:
            shares[i] = remaining * shares[i] / weight if weight > 0 else remaining / len(free)
        over = [i for i in free if shares[i] > hi]
        under = [i for i in free if shares[i] < lo]
        if not over and not under:
            break
        # Fix the side that violates most; the other side may resolve itself.
        excess = sum(shares[i] - hi for i in over)
        deficit = sum(lo - shares[i] for i in under)
        for i in over if excess >= deficit else under:
            fixed[i] = hi if excess >= deficit else lo
    return [fixed.get(i, shares[i]) for i in range(len(shares))]


def largest_remainder(shares: Sequence[float], bounds: Bounds) -> list[int]:
    """Round real shares (already inside the bounds, summing to B) to integers.

    Floors every share, then hands the missing units to the largest fractional
    parts (ties to the lower rank), never pushing a worker past ``max_batch``.
    """
    floors = [min(max(math.floor(s + 1e-9), bounds.min_batch), bounds.upper) for s in shares]
    missing = bounds.global_batch - sum(floors)
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    step = 1 if missing > 0 else -1
    while missing != 0:
        moved = False
        for i in order if step > 0 else reversed(order):
            if missing == 0:
                break
            nxt = floors[i] + step
            if bounds.min_batch <= nxt <= bounds.upper:
                floors[i] = nxt
                missing -= step
                moved = True
        if not moved:  # pragma: no cover - excluded by check_feasible
            raise InfeasibleBounds("cannot round the shares inside the bounds")
    return floors


def proportional_split(weights: Sequence[float], bounds: Bounds) -> list[int]:
    """Integer split of the global batch proportional to ``weights`` within bounds."""
    if len(weights) != bounds.workers:
        raise ValueError(f"{len(weights)} weights for {bounds.workers} workers")
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"weights must be positive and finite, got {list(weights)}")
    total = sum(weights)
    targets = [bounds.global_batch * w / total for w in weights]
    return largest_remainder(clamp_reshare(targets, bounds), bounds)


def uniform_split(bounds: Bounds) -> list[int]:
    """Equal batches (plain data parallel); the remainder goes to the lowest ranks."""
    return proportional_split([1.0] * bounds.workers, bounds)
