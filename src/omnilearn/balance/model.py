"""Affine step-time model ``t_i(b) = alpha_i + beta_i * b``: robust fit and equal-finish water-filling. Pure numpy.

The ``model`` controller (:class:`~omnilearn.balance.controllers.ModelController`)
builds on two functions here, both vectorised over workers:

- :func:`fit_affine`: per worker, Theil-Sen on its (batch, median time)
  window pairs: ``beta`` the median of the pairwise slopes between windows
  at distinct batches, ``alpha`` the median of ``t - beta * b``. Up to ~29%
  wild windows move neither. Constraints: ``beta > 0`` and ``alpha >= 0``;
  where the fit breaks one, the worker falls back to a line through the
  origin, ``alpha = 0``, ``beta = median(t / b)``.
- :func:`equal_finish`: the real shares ``clip((T - alpha_i) / beta_i, lo_i, hi_i)``
  with the one finish time ``T`` that makes them sum to ``total``. The sum is
  piecewise linear and nondecreasing in ``T`` with breaks at
  ``alpha_i + beta_i * lo_i`` and ``alpha_i + beta_i * hi_i``: sort the breaks,
  evaluate the sum at all of them with cumulative sums, interpolate. O(n log n).

Run: ``python -m pytest -q tests/unit/test_model_controller.py``
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

MIN_BETA = 1e-12  # a slope at or below this is no slope: the worker falls back to a line through the origin


def distinct_batches(history: np.ndarray) -> np.ndarray:
    """Per worker of ``history`` ((windows, n, 2): batch, time; NaN where empty): how many distinct batches."""
    b = np.where(valid_pairs(history), history[..., 0], np.nan)
    s = np.sort(b, axis=0)  # NaN last
    new = np.isfinite(s) & np.concatenate((np.isfinite(s[:1]), s[1:] != s[:-1]), axis=0)
    return new.sum(axis=0)


def valid_pairs(history: np.ndarray) -> np.ndarray:
    """(windows, n) mask of the usable pairs: finite, positive batch and time."""
    b, t = history[..., 0], history[..., 1]
    with np.errstate(invalid="ignore"):
        return np.isfinite(b) & np.isfinite(t) & (b > 0) & (t > 0)


def column_median(x: np.ndarray) -> np.ndarray:
    """Per column of (k, m) ``x``, the median of its finite entries (NaN for none); faster than ``np.nanmedian``."""
    return row_median(np.ascontiguousarray(x.T))


def row_median(x: np.ndarray) -> np.ndarray:
    """Per row of (m, k) ``x``, the median of its finite entries (NaN for none); sorts along contiguous rows."""
    finite = np.isfinite(x)
    s = np.sort(np.where(finite, x, np.inf), axis=1)  # missing last (numpy sorts inf much faster than NaN)
    k = finite.sum(axis=1)
    rows = np.arange(x.shape[0])
    low, high = s[rows, np.maximum(k - 1, 0) // 2], s[rows, np.maximum(k, 1) // 2 - (k == 0)]
    return np.where(k > 0, 0.5 * (low + high), np.nan)


def fit_affine(history: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Per worker ``(alpha, beta)`` of ``t = alpha + beta * b`` by Theil-Sen over its window pairs.

    ``history``: (windows, n, 2), oldest first, batch and median time per
    window; NaN (or 0) where a window is empty. A worker with fewer than two
    distinct batches gets the line through the origin, as does one whose fit
    has ``beta <= 0`` or ``alpha < 0``; one without any pair gets NaN.
    Works on one contiguous row per worker (sorting along rows is ~3x faster
    than along columns).
    """
    h = np.asarray(history, dtype=float)
    hw = np.ascontiguousarray(np.moveaxis(h, 0, 1))  # (n, windows, 2): one contiguous row per worker
    b, t = hw[..., 0], hw[..., 1]
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(b) & np.isfinite(t) & (b > 0) & (t > 0)
    b, t = np.where(ok, b, np.nan), np.where(ok, t, np.nan)
    i, j = np.triu_indices(h.shape[0], k=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        db, dt = b[:, j] - b[:, i], t[:, j] - t[:, i]
        usable = (db != 0) & np.isfinite(db) & np.isfinite(dt)  # both windows there, at distinct batches
        slopes = np.where(usable, dt / np.where(usable, db, 1.0), np.nan)  # no 0/0: slow, and it warns
        beta = row_median(slopes)
        alpha = row_median(t - beta[:, None] * b)
        origin = ~(np.isfinite(beta) & (beta > MIN_BETA) & (alpha >= 0))
        if origin.any():
            some = origin & ok.any(axis=1)
            alpha[origin], beta[origin] = np.where(some[origin], 0.0, np.nan), np.nan
            if some.any():
                beta[some] = row_median(t[some] / b[some])
    return alpha, beta


def equal_finish(alpha: ArrayLike, beta: ArrayLike, lo: ArrayLike, hi: ArrayLike,
                 total: float) -> tuple[np.ndarray, float]:
    """Real shares ``clip((T - alpha_i) / beta_i, lo_i, hi_i)`` summing to ``total``, and that ``T``.

    Needs ``beta > 0`` and ``sum(lo) <= total <= sum(hi)``; ``lo``/``hi``
    scalars or per-worker arrays. Workers strictly between their bounds all
    finish at ``T``; those at ``lo`` finish no later, those at ``hi`` no earlier.
    """
    a = np.asarray(alpha, dtype=float)
    w = 1.0 / np.asarray(beta, dtype=float)  # samples per second of finish time
    lo = np.broadcast_to(np.asarray(lo, dtype=float), a.shape)
    hi = np.broadcast_to(np.asarray(hi, dtype=float), a.shape)
    start, stop = a + lo / w, a + hi / w  # below start a worker sits at lo, from stop on at hi
    ia, ic = np.argsort(start), np.argsort(stop)
    s_sorted, e_sorted = start[ia], stop[ic]

    def cum(x: np.ndarray) -> np.ndarray:
        return np.concatenate(([0.0], np.cumsum(x)))

    cum_lo, cum_wa, cum_awa = cum(lo[ia]), cum(w[ia]), cum((a * w)[ia])
    cum_hi, cum_wc, cum_awc = cum(hi[ic]), cum(w[ic]), cum((a * w)[ic])
    ts = np.sort(np.concatenate((start, stop)))
    ka = np.searchsorted(s_sorted, ts, side="right")  # start_i <= T: above lo
    kc = np.searchsorted(e_sorted, ts, side="right")  # stop_i <= T: at hi
    f = (cum_lo[-1] - cum_lo[ka]) + cum_hi[kc] + ts * (cum_wa[ka] - cum_wc[kc]) - (cum_awa[ka] - cum_awc[kc])
    j = int(np.searchsorted(f, total, side="left"))  # f[j-1] < total <= f[j]
    j = min(max(j, 1), ts.size - 1)
    span = f[j] - f[j - 1]
    finish = float(ts[j] if span <= 0 else ts[j - 1] + (total - f[j - 1]) * (ts[j] - ts[j - 1]) / span)
    raw = (finish - a) * w
    shares = np.clip(raw, lo, hi)
    free = (raw > lo) & (raw < hi)
    if free.any():  # put the float rounding of the sum on the free workers, by their slopes
        shares[free] += (total - shares.sum()) * w[free] / w[free].sum()
    return shares, finish
