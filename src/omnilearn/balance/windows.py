"""Window statistics of the control loop: one worker's window as 4 numbers, and their robust pooling. Pure numpy.

:func:`window_row` is what each worker sends per control window (batch,
count, median time, robust spread); :func:`window_table` does it for many
workers at once. The loop keeps windows as additive :func:`moments` and
pools them with :func:`robust_pool` / :func:`pooled`.

Run: ``python -m pytest -q tests/unit/test_loop.py``
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

WINDOW_FIELDS = 4  # batch, count, median time, robust spread
MAD_TO_SD = 1.4826  # robust standard deviation = 1.4826 * median absolute deviation (normal noise)
MEDIAN_SE = math.sqrt(math.pi / 2)  # standard error of a median = 1.2533 * sd / sqrt(count)
ROBUST_COUNT = 3  # a window of fewer samples has no robust median: see robust_pool
CLIP_Z = 3.0  # such a window's median counts at most this many standard errors from the worker's center


def window_row(batch: int, times_s: Sequence[float]) -> tuple[float, float, float, float]:
    """One worker's summary of one control window: (batch, count, median time, robust spread).

    ``times_s``: that worker's per-step (BSP ``compute_s``) or per-push (ASP
    ``cycle_s``) times measured at ``batch`` within this window; steps at
    another batch are left out by the caller. Median and spread are 0.0 when
    empty; the spread (1.4826 * MAD) is 0.0 with fewer than 2 times.
    """
    t = [float(v) for v in times_s]  # a window's few numbers: plain floats are faster than an array here
    if not t:
        return float(batch), 0.0, 0.0, 0.0
    median = _median(t)
    spread = MAD_TO_SD * _median([abs(v - median) for v in t]) if len(t) >= 2 else 0.0
    return float(batch), float(len(t)), median, spread


def _median(values: list[float]) -> float:
    """``np.median`` of a short list, the same float: the middle value, or the mean of the middle two."""
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def window_table(batches: ArrayLike, times_s: ArrayLike) -> np.ndarray:
    """:func:`window_row` for all workers at once: ``times_s`` is (n, k), k >= 1 times each; (n, 4) out."""
    t = np.asarray(times_s, dtype=float)
    median = np.median(t, axis=1)
    spread = MAD_TO_SD * np.median(np.abs(t - median[:, None]), axis=1) if t.shape[1] >= 2 else 0.0 * median
    count = np.full(t.shape[0], float(t.shape[1]))
    return np.column_stack((np.asarray(batches, dtype=float), count, median, spread))


def moments(count: np.ndarray, median: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Per-window sums that pool by addition: (count, count * median, count * (spread^2 + median^2))."""
    return np.stack((count, count * median, count * (spread**2 + median**2)))


def weighted_median(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per column of (h, n) ``values``, the lower weighted median (weights >= 0; an all-0 column gives any value)."""
    order = np.argsort(values, axis=0, kind="stable")
    v, cum = np.take_along_axis(values, order, 0), np.cumsum(np.take_along_axis(weights, order, 0), axis=0)
    first = np.argmax(cum >= 0.5 * cum[-1], axis=0)
    return v[first, np.arange(values.shape[1])]


def robust_pool(ring: np.ndarray, use: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pooled` over the windows ``use`` (h, n) of ``ring`` ((3, h, n) moments), small windows capped.

    In a window of under ``ROBUST_COUNT`` samples one wild time (a pause) is
    the median and the spread. So, per worker, such a window's median is
    clipped to ``CLIP_Z`` of its standard errors around the count-weighted
    median of the window medians, and its spread to ``CLIP_Z`` reference
    spreads (count-weighted median over windows of the larger of a window's
    spread and its median's distance from the center as a per-sample spread).
    Windows holding under half of the samples move neither reference; workers
    without small windows (BSP windows of usual length) pool exactly.
    """
    mask = use.astype(float)
    sums = np.einsum("khn,hn->kn", ring, mask)
    cols = np.flatnonzero((use & (ring[0] > 0) & (ring[0] < ROBUST_COUNT)).any(axis=0))
    if cols.size:
        count = ring[0, :, cols].T * mask[:, cols]
        safe = np.where(count > 0, count, 1.0)
        median = ring[1, :, cols].T / safe
        var = np.maximum(ring[2, :, cols].T / safe - median**2, 0.0)
        center = weighted_median(median, count)
        from_center = (MAD_TO_SD / MEDIAN_SE) ** 2 * count * (median - center) ** 2
        ref = weighted_median(np.maximum(var, from_center), count)
        reach = CLIP_Z * MEDIAN_SE * np.sqrt(ref / safe)
        small = count < ROBUST_COUNT
        median = np.where(small, np.clip(median, center - reach, center + reach), median)
        spread = np.sqrt(np.where(small, np.minimum(var, CLIP_Z**2 * ref), var))
        sums[:, cols] = moments(count, median, spread).sum(axis=1)
    return pooled(sums)


def pooled(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From summed :func:`moments`: total count, count-weighted mean of the medians, pooled per-sample spread.

    The spread pools the within-window spreads and the spread of the window
    medians (law of total variance), so windows of one sample still show noise.
    """
    total = sums[0]
    safe = np.where(total > 0, total, 1.0)
    mean = sums[1] / safe
    return total, mean, np.sqrt(np.maximum(sums[2] / safe - mean**2, 0.0))
