"""The parameter server's own settings (the rest is the run's :class:`~omnilearn.config.BalanceConfig`).

Frozen and validated on construction; a bad value is one
:class:`~omnilearn.config.ConfigError` line naming the flag and the fix.

Run its tests: ``python -m pytest -q tests/unit/test_aspmath.py``
"""

from __future__ import annotations

from dataclasses import dataclass

from omnilearn.asp.rules import LR_SCALINGS
from omnilearn.config import ConfigError


@dataclass(frozen=True)
class ASPSettings:
    """How the server applies pushes and when it stops.

    ``lr_scaling``: ``linear`` (a push's rate times ``b_i / (B / n)``) or ``none``;
    ``staleness_lr``: also divide a push's rate by its staleness;
    ``max_time_s``: stop after this much training time (evaluation excluded; None: no limit);
    ``checkpoint_every``: save a checkpoint every this many steps of ``n`` push slots (0: never);
    ``max_staleness``: refuse a push more than this many versions old, once per batch: the worker recomputes
    it on fresh weights (None: no bound; :func:`omnilearn.asp.rules.over_bound`).
    """

    lr_scaling: str = "linear"
    staleness_lr: bool = False
    max_time_s: float | None = None
    checkpoint_every: int = 0
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        if self.lr_scaling not in LR_SCALINGS:
            raise ConfigError(f"unknown lr_scaling {self.lr_scaling!r}; choose one of {', '.join(LR_SCALINGS)}")
        if not isinstance(self.staleness_lr, bool):
            raise ConfigError(f"--staleness-lr must be true or false, got {self.staleness_lr!r}")
        if self.max_time_s is not None and not self.max_time_s > 0:
            raise ConfigError(f"--max-time-s {self.max_time_s:g} must be positive")
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                or self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every {self.checkpoint_every!r} must be 0 (never) or a number of steps")
        if self.max_staleness is not None and (type(self.max_staleness) is not int or self.max_staleness < 1):
            raise ConfigError(f"--max-staleness {self.max_staleness!r} must be a whole number of versions, 1 or "
                              "more (leave it out for no bound)")
