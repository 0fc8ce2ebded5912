"""The modelled cluster of ``omnilearn simulate``: workers, noise, speed changes, sync cost, the ideal step. Pure numpy.

Worker i at batch b computes for ``(alpha_i + beta_i * b) * m_i(step) * noise``
seconds: an affine time (fixed part plus per-sample part), a time multiplier
``m_i`` that speed changes set from some step on (2.0: twice as slow), and a
multiplicative per-step noise. The step lasts as long as the slowest worker
plus the sync: a ring all-reduce of the model's bytes,
``latency + 2 (n - 1) / n * bytes / bandwidth``. Noise is either parametric
(``max(0.05, 1 + noise * N(0, 1))``, a ``spike_p`` share of the draws
``spike`` times longer) or resampled from a measured bench: whole steps of
per-worker relative residuals with that step's sync (:mod:`whatif_bench`), so
a shared host's correlated slowdowns stay correlated.

The ideal step (:func:`balanced`) is the equal-finish split of the true
current speeds within the bounds (water-filling over ``alpha_i + beta_i b_i =
T``, real-valued batches), run under the same noise draws, plus the sync.

Run: ``python -m pytest -q tests/unit/test_simulate.py``
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omnilearn.balance.allocation import Bounds, InfeasibleBounds
from omnilearn.config import ConfigError

# Rough relative training throughput per GPU generation (T4 = 1; mixed-precision CNN training,
# order of magnitude only): pass --speeds for measured figures.
GPU_SPEEDS = {"h100": 9.0, "a100": 4.5, "a10": 2.0, "l4": 1.8, "v100": 2.5, "p100": 1.2, "t4": 1.0, "k80": 0.4}
NOISE_FLOOR = 0.05  # a noise factor never shrinks a step below this share of its mean


@dataclass(frozen=True)
class Change:
    """From ``step`` on, the workers ``first..last`` (inclusive) take ``factor`` times as long."""

    step: int
    first: int
    last: int
    factor: float


@dataclass(frozen=True)
class Scenario:
    """Everything one what-if run needs; every controller runs it with the same random draws (``seed``)."""

    alpha_s: np.ndarray  # (n,) fixed seconds per step at the start speeds
    beta_s: np.ndarray  # (n,) seconds per sample at the start speeds
    global_batch: int
    steps: int
    declared: tuple[float, ...]  # the speeds the static arm is told
    segments: tuple[tuple[int, np.ndarray], ...] = ()  # (first step, (n,) time multipliers); before the first: 1.0
    noise: float = 0.0
    spike_p: float = 0.0
    spike: float = 3.0
    sync_s: float = 0.0  # per step, inside the step (the slowest worker's wait)
    gap_s: float = 0.0  # per step, outside it (data loading, control work): wall step = step + gap
    residuals: np.ndarray | None = None  # (m, n) measured relative noise per step; replaces ``noise``
    sync_samples: np.ndarray | None = None  # (m,) measured sync seconds of those steps
    min_batch: int = 1
    max_batch: int | tuple[int, ...] | None = None
    interval: int = 15
    lag: int = 0
    deadband: float = 0.05
    history: int = 10
    checks: bool = True  # mid-interval looks for a speed shift, as the BSP runtime does
    seed: int = 0
    change_steps: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        n = np.asarray(self.alpha_s).size
        if n < 1 or np.asarray(self.beta_s).size != n or len(self.declared) != n:
            raise ConfigError(f"alpha, beta and declared speeds must have one entry per worker ({n})")
        if not (np.asarray(self.beta_s) > 0).all() or (np.asarray(self.alpha_s) < 0).any():
            raise ConfigError("per-sample times must be positive and fixed times non-negative")
        if self.steps < 1 or self.interval < 1:
            raise ConfigError(f"--steps {self.steps} and --control-interval {self.interval} must be at least 1")
        if self.noise < 0 or not 0 <= self.spike_p <= 1 or self.spike <= 0:
            raise ConfigError(f"--noise {self.noise} must be >= 0 and --spikes P:F needs 0 <= P <= 1, F > 0")
        if not 0 <= self.deadband < 1 or self.lag < 0 or self.history < 1:
            raise ConfigError(f"need 0 <= --deadband < 1, --lag >= 0, --history >= 1; got {self.deadband}, "
                              f"{self.lag}, {self.history}")
        try:
            self.bounds()
        except InfeasibleBounds as e:
            raise ConfigError(str(e)) from None
        segments = tuple((int(s), np.asarray(m, dtype=float)) for s, m in sorted(self.segments, key=lambda x: x[0]))
        if not segments or segments[0][0] != 0:
            segments = ((0, np.ones(n)), *segments)
        if any(m.shape != (n,) or not (m > 0).all() for _, m in segments):
            raise ConfigError(f"speed multipliers must be positive, one per worker ({n})")
        object.__setattr__(self, "segments", segments)
        object.__setattr__(self, "change_steps", tuple(s for s, _ in segments if 0 < s < self.steps))

    @property
    def workers(self) -> int:
        return int(np.asarray(self.alpha_s).size)

    def bounds(self) -> Bounds:
        return Bounds(self.global_batch, self.workers, self.min_batch, self.max_batch)

    def segment(self, step: int) -> int:
        """Index into ``segments`` of the one in force at ``step``."""
        return max(k for k, (start, _) in enumerate(self.segments) if start <= step)

    def multiplier(self, step: int) -> np.ndarray:
        """(n,) time multipliers in force at ``step``."""
        return self.segments[self.segment(step)][1]


def with_changes(n: int, changes: list[Change], base: tuple[tuple[int, np.ndarray], ...] = ()
                 ) -> tuple[tuple[int, np.ndarray], ...]:
    """Segments of time multipliers: ``base`` segments (e.g. the paper routine) times the cumulative ``changes``."""
    starts = sorted({0, *(s for s, _ in base), *(c.step for c in changes)})
    out = []
    for start in starts:
        mult = np.ones(n)
        for s, m in base:
            if s <= start:
                mult = np.asarray(m, dtype=float).copy()
        for c in changes:
            if c.step <= start:
                mult[c.first:c.last + 1] *= c.factor
        if not out or not np.array_equal(mult, out[-1][1]):  # HL8 -> HL8 is no change
            out.append((start, mult))
    return tuple(out)


def ring_allreduce_s(workers: int, model_bytes: float, bandwidth_gbps: float, latency_s: float) -> float:
    """Seconds of one ring all-reduce: ``latency + 2 (n - 1) / n * bytes / bandwidth`` (0 for one worker)."""
    if workers < 2 or model_bytes <= 0:
        return latency_s if workers >= 2 else 0.0
    return latency_s + 2 * (workers - 1) / workers * model_bytes * 8 / (bandwidth_gbps * 1e9)


def balanced(alpha: np.ndarray, beta: np.ndarray, lo: np.ndarray, hi: np.ndarray, total: float
             ) -> tuple[np.ndarray, float]:
    """Real shares ``clip((T - alpha_i) / beta_i, lo_i, hi_i)`` summing to ``total``, and the step time they give.

    Bisection on ``T`` (the sum is monotone in it); the step time is the
    slowest worker's finish, ``T`` unless a bound keeps someone later.
    """
    lo_t, hi_t = float(np.min(alpha + beta * lo)), float(np.max(alpha + beta * hi))
    for _ in range(100):
        mid = 0.5 * (lo_t + hi_t)
        if np.clip((mid - alpha) / beta, lo, hi).sum() < total:
            lo_t = mid
        else:
            hi_t = mid
    shares = np.clip((hi_t - alpha) / beta, lo, hi)
    shares *= total / shares.sum()  # the last rounding of the bisection
    return shares, float(np.max(alpha + beta * shares))


class NoiseStream:
    """Per-step draws: (n,) noise factors and the step's sync seconds. Same seed, same draws, whoever asks."""

    def __init__(self, sc: Scenario) -> None:
        self.sc, self.rng = sc, np.random.default_rng(sc.seed)

    def draw(self) -> tuple[np.ndarray, float]:
        sc = self.sc
        if sc.residuals is not None:
            k = int(self.rng.integers(sc.residuals.shape[0]))
            sync = float(sc.sync_samples[k]) if sc.sync_samples is not None else sc.sync_s
            return sc.residuals[k], sync
        factor = np.maximum(1.0 + sc.noise * self.rng.standard_normal(sc.workers), NOISE_FLOOR)
        if sc.spike_p:
            factor = np.where(self.rng.random(sc.workers) < sc.spike_p, sc.spike * factor, factor)
        return factor, sc.sync_s
