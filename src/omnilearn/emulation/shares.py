"""CPU shares of throttled workers: pure arithmetic and the one error type of the OS-level throttles.

Worker i of a run with relative ``speeds`` runs at ``speeds[i] / max(speeds)``
of full speed; the backends in :mod:`omnilearn.emulation.throttle` (affinity,
docker) and :mod:`omnilearn.emulation.cgroups` turn that into cores, a
``docker update --cpus`` or a CFS quota. No OS calls here, no torch.

Run its tests:  python -m pytest -q tests/unit/test_throttle.py
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Sequence


class ThrottleError(RuntimeError):
    """The OS refused to throttle a worker; the message names the fix."""


def relative_speed(speeds: Sequence[float], i: int) -> float:
    """``speeds[i] / max(speeds)`` in (0, 1]; rejects a short or non-positive list."""
    if not 0 <= i < len(speeds) or min(speeds) <= 0:
        raise ThrottleError(f"speeds {tuple(speeds)} need a positive speed for worker {i}")
    return speeds[i] / max(speeds)


def allocate_cores(speeds: Sequence[float], n_cores: int) -> list[int]:
    """Core counts in proportion to speeds, each >= 1, summing to ``n_cores``.

    Workers whose share is below one core get exactly one and the rest is
    re-shared; then largest remainder (ties: faster first). Exact arithmetic.
    """
    n = len(speeds)
    if n_cores < n:
        raise ThrottleError(
            f"affinity backend needs at least {n} cores for {n} workers; "
            f"this machine has {n_cores}; use --emulator delay or cgroup"
        )
    s = [Fraction(v) for v in speeds]
    fixed: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in fixed]
        budget, total = n_cores - len(fixed), sum(s[i] for i in free)
        quota = {i: budget * s[i] / total for i in free}
        low = {i for i in free if quota[i] < 1}
        if not low:
            break
        fixed |= low
    counts = [1 if i in fixed else math.floor(quota[i]) for i in range(n)]
    order = sorted(free, key=lambda i: (-(quota[i] - counts[i]), -s[i], i))
    for i in order[: budget - sum(counts[j] for j in free)]:
        counts[i] += 1
    return counts


def core_sets(speeds: Sequence[float], cores: Sequence[int]) -> list[tuple[int, ...]]:
    """Disjoint consecutive slices of the sorted ``cores``, one per worker."""
    ordered, out, at = sorted(cores), [], 0
    for c in allocate_cores(speeds, len(ordered)):
        out.append(tuple(ordered[at : at + c]))
        at += c
    return out


def docker_argvs(speeds: Sequence[float], containers: Sequence[str], cpus: float) -> list[list[str]]:
    """One ``docker update --cpus`` argv per container (3 decimals)."""
    if len(containers) != len(speeds):
        raise ThrottleError(
            f"docker backend: {len(containers)} containers for {len(speeds)} workers; give one container per worker"
        )
    return [
        ["docker", "update", "--cpus", f"{relative_speed(speeds, i) * cpus:.3f}", name]
        for i, name in enumerate(containers)
    ]
