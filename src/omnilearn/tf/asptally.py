"""The TensorFlow ASP chief's own tally (:class:`PushLog`, :func:`tally`): what its tests read besides the record.

The run's record (``metrics.jsonl``, ``summary.json``) is the PyTorch server's
(:class:`~omnilearn.observe.asplog.ASPLog`); this is the chief's view: pushes and resends per worker, the
workers dropped and why, the version on the parameter server against the pushes applied, each epoch's
coverage, the batches and their changes, the gradient function's traces, and (``keep_order``) every applied
push in order.

Run: ``python -m pytest -q tests/tf/test_tf_asp.py``
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PushLog:
    """What the chief saw: per worker its applied pushes and resends; the workers dropped and why; the applied
    pushes in order as ``(worker, epoch, indices, version read, staleness, recomputed after a refusal)`` (kept
    only when ``keep_order``)."""

    workers: int
    pushes: list[int] = field(default_factory=list)
    resent: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)
    order: list[tuple] = field(default_factory=list)
    last_loss: float | None = None

    def __post_init__(self) -> None:
        self.pushes, self.resent = [0] * self.workers, [0] * self.workers


def tally(chief, wall_s: float) -> dict:
    """``chief``'s tally after a run of ``wall_s`` seconds."""
    s = chief.staleness
    return {"wall_s": wall_s, "pushes": list(chief.log.pushes), "resent": list(chief.log.resent),
            "applied": chief.applied, "version": int(chief.version.numpy()),
            "dropped": {str(w): why for w, why in chief.log.dropped.items()},
            "staleness": {"p50": [s.quantile(0.5, w) for w in range(chief.workers)],
                          "p99": [s.quantile(0.99, w) for w in range(chief.workers)],
                          "max": list(s.maxima), "refused": list(s.refused)},
            "coverage": chief.coverage.summary(), "last_loss": chief.log.last_loss,
            "batches": list(chief.control.batches), "decisions": [[v, list(b)] for v, b in chief.decisions],
            "order": chief.log.order, "traces": chief.placed.gradient.experimental_get_tracing_count()}
