"""Pure batch-allocation arithmetic: splitting a global batch among workers.

Every function here keeps the invariant ``sum(batches) == global_batch`` and
the bounds ``min_batch <= b_i <= max_batch``. No torch, no processes: the
controllers and the sampler build on these. The work is vectorised with numpy
(:func:`water_fill` and :func:`round_shares` take arrays, O(n log n), and
accept per-worker bounds for memory caps); :func:`split_array` is the two in a
row (clamp, re-share, round) and :func:`proportional_split` its list front-end.
The unit tests check them with hypothesis, also against the former
pure-Python loops: ``python -m pytest -q tests/unit/test_allocation.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike


class InfeasibleBounds(ValueError):
    """The bounds cannot hold a split of the global batch."""


@dataclass(frozen=True)
class Bounds:
    """Per-worker batch bounds for ``workers`` workers sharing ``global_batch``.

    ``max_batch``: one cap for every worker, a tuple of one cap per worker
    (memory differs between machines), or None (no cap beyond the global batch).
    """

    global_batch: int
    workers: int
    min_batch: int = 1
    max_batch: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_batch, (list, tuple, np.ndarray)):
            caps = tuple(int(c) for c in self.max_batch)
            if len(caps) != self.workers:
                raise InfeasibleBounds(f"{len(caps)} per-worker max batches for {self.workers} workers; "
                                       f"give one number or one per worker")
            object.__setattr__(self, "max_batch", caps)
        check_feasible(self.global_batch, self.workers, self.min_batch, self.upper)

    @property
    def upper(self) -> int | np.ndarray:
        """The cap: an int for all workers, or an int64 array of one per worker."""
        if self.max_batch is None:
            return self.global_batch
        if isinstance(self.max_batch, tuple):
            return np.asarray(self.max_batch, dtype=np.int64)
        return self.max_batch

    def caps(self) -> np.ndarray:
        """One cap per worker (int64 array), whatever form ``max_batch`` has."""
        return np.broadcast_to(np.asarray(self.upper, dtype=np.int64), (self.workers,)).copy()


def check_feasible(global_batch: int, workers: int, min_batch: int, max_batch: int | np.ndarray) -> None:
    """Raise :class:`InfeasibleBounds` with a message that names the fix (``max_batch``: one cap or one per worker)."""
    if workers < 1:
        raise InfeasibleBounds(f"workers={workers} must be at least 1")
    if global_batch < 1:
        raise InfeasibleBounds(f"global batch {global_batch} must be at least 1")
    if min_batch < 1:
        raise InfeasibleBounds(f"min batch {min_batch} must be at least 1")
    caps = np.broadcast_to(np.asarray(max_batch, dtype=np.int64), (workers,))
    if min_batch > int(caps.min()):
        raise InfeasibleBounds(
            f"min batch {min_batch} is larger than max batch {int(caps.min())}; lower --min-batch or raise --max-batch"
        )
    if workers * min_batch > global_batch:
        raise InfeasibleBounds(
            f"global batch {global_batch} is smaller than workers x min batch = {workers} x {min_batch}; "
            f"raise --global-batch to at least {workers * min_batch} or lower --min-batch"
        )
    if int(caps.sum()) < global_batch:
        said = f"workers x max batch = {workers} x {int(caps[0])}" if np.ndim(max_batch) == 0 else \
            f"the sum of the per-worker max batches, {int(caps.sum())}"
        raise InfeasibleBounds(
            f"global batch {global_batch} is larger than {said}; "
            f"lower --global-batch to at most {int(caps.sum())} or raise --max-batch"
        )


def water_fill(weights: ArrayLike, lo: ArrayLike, hi: ArrayLike, total: float) -> np.ndarray:
    """Shares ``clip(lam * w_i, lo_i, hi_i)`` with the one ``lam`` that makes them sum to ``total``.

    This is clamping plus re-sharing: what a bound takes from (or gives to) a
    worker goes to the unclamped workers in proportion to their weights.
    Negative weights count as 0; zero-weight workers sit at ``lo`` unless the
    others are all at ``hi`` and the rest must go somewhere, then they share
    it equally. ``lo``/``hi`` are scalars or per-worker arrays; the caller
    guarantees ``sum(lo) <= total <= sum(hi)``. O(n log n): the sum is
    piecewise linear in ``lam`` with breaks at ``lo_i/w_i`` and ``hi_i/w_i``.
    """
    w = np.maximum(np.asarray(weights, dtype=float), 0.0)
    lo = np.broadcast_to(np.asarray(lo, dtype=float), w.shape)
    hi = np.broadcast_to(np.asarray(hi, dtype=float), w.shape)
    pos = w > 0
    if hi[pos].sum() + lo[~pos].sum() <= total:  # positives saturate; zero weights share the rest
        out = np.where(pos, hi, lo)
        if not pos.all():
            out[~pos] = water_fill(np.ones(int((~pos).sum())), lo[~pos], hi[~pos], total - hi[pos].sum())
        return out
    out = w * (total / w.sum())
    if pos.all() and (out >= lo).all() and (out <= hi).all():
        return out  # no bound binds: plain proportional shares
    out = lo.copy()
    out[pos] = _fill_positive(w[pos], lo[pos], hi[pos], total - lo[~pos].sum())
    return out


def _fill_positive(w: np.ndarray, lo: np.ndarray, hi: np.ndarray, total: float) -> np.ndarray:
    """:func:`water_fill` for positive weights and ``sum(lo) <= total < sum(hi)``."""
    if lo.sum() >= total:
        return lo.copy()
    a, c = lo / w, hi / w  # below a_i a worker sits at lo_i, from c_i on at hi_i
    ia, ic = np.argsort(a), np.argsort(c)
    a_sorted, c_sorted = a[ia], c[ic]
    cum_lo = np.concatenate(([0.0], np.cumsum(lo[ia])))
    cum_wa = np.concatenate(([0.0], np.cumsum(w[ia])))
    cum_hi = np.concatenate(([0.0], np.cumsum(hi[ic])))
    cum_wc = np.concatenate(([0.0], np.cumsum(w[ic])))
    lam = np.sort(np.concatenate((a, c)))
    ka = np.searchsorted(a_sorted, lam, side="right")  # a_i <= lam: above lo
    kc = np.searchsorted(c_sorted, lam, side="right")  # c_i <= lam: at hi
    f = cum_lo[-1] - cum_lo[ka] + cum_hi[kc] + lam * (cum_wa[ka] - cum_wc[kc])
    j = int(np.searchsorted(f, total, side="left"))  # f[j-1] < total <= f[j]; j >= 1 as f[0] = sum(lo)
    j = min(max(j, 1), lam.size - 1)
    span = f[j] - f[j - 1]
    x = lam[j] if span <= 0 else lam[j - 1] + (total - f[j - 1]) * (lam[j] - lam[j - 1]) / span
    shares = np.clip(x * w, lo, hi)
    free = (x * w > lo) & (x * w < hi)
    if free.any():  # put the float rounding of the sum on the free workers
        rest = total - shares[~free].sum()
        shares[free] = rest * w[free] / w[free].sum()
    return shares


def round_shares(shares: ArrayLike, lo: ArrayLike, hi: ArrayLike, total: int) -> np.ndarray:
    """Largest-remainder rounding of real shares to integers summing to ``total`` within the bounds.

    Floors every share (clamped into the bounds), then hands the missing units
    to the largest fractional parts, ties to the lower rank, one per worker per
    pass and never past ``hi`` (surplus units come back from the smallest
    fractional parts, ties to the higher rank, never below ``lo``). Exactly the
    former pure-Python loop, with the passes counted instead of run.
    """
    s = np.asarray(shares, dtype=float)
    lo_i = np.broadcast_to(np.asarray(lo, dtype=np.int64), s.shape)
    hi_i = np.broadcast_to(np.asarray(hi, dtype=np.int64), s.shape)
    floors = np.clip(np.floor(s + 1e-9), lo_i, hi_i).astype(np.int64)
    missing = int(total - floors.sum())
    if missing == 0:
        return floors
    order = np.argsort(floors - s, kind="stable")  # largest fractional part first, ties to the lower rank
    seq = order if missing > 0 else order[::-1]
    room = (hi_i - floors)[seq] if missing > 0 else (floors - lo_i)[seq]
    units = _round_robin(room, abs(missing))
    floors[seq] += units if missing > 0 else -units
    return floors


def _round_robin(room: np.ndarray, units: int) -> np.ndarray:
    """Deal ``units`` one per worker per pass over ``room`` (in order), each worker at most its room."""
    if int(room.sum()) < units:  # pragma: no cover - excluded by check_feasible
        raise InfeasibleBounds("cannot round the shares inside the bounds")
    full, high = 0, int(room.max(initial=0))
    if int((room > 0).sum()) <= units:  # find the passes every worker with room completes
        while full < high:  # largest k with sum(min(room, k)) <= units
            mid = (full + high + 1) // 2
            if int(np.minimum(room, mid).sum()) <= units:
                full = mid
            else:
                high = mid - 1
    dealt = np.minimum(room, full)
    rest = units - int(dealt.sum())
    more = np.flatnonzero(room > full)[:rest]
    dealt[more] += 1
    return dealt


def split_array(targets: ArrayLike, bounds: Bounds) -> np.ndarray:
    """Clamp, re-share and round real targets: an integer array that sums to B exactly."""
    shares = water_fill(targets, bounds.min_batch, bounds.upper, bounds.global_batch)
    return round_shares(shares, bounds.min_batch, bounds.upper, bounds.global_batch)


def proportional_split(weights: Sequence[float], bounds: Bounds) -> list[int]:
    """Integer split of the global batch proportional to ``weights`` within bounds."""
    w = np.asarray(weights, dtype=float)
    if w.shape != (bounds.workers,):
        raise ValueError(f"{len(weights)} weights for {bounds.workers} workers")
    if not (np.all(np.isfinite(w)) and np.all(w > 0)):
        raise ValueError(f"weights must be positive and finite, got {list(weights)}")
    return split_array(bounds.global_batch * w / w.sum(), bounds).tolist()


def uniform_split(bounds: Bounds) -> list[int]:
    """Equal batches (plain data parallel); the remainder goes to the lowest ranks."""
    return proportional_split([1.0] * bounds.workers, bounds)
