"""The one recorder of run-directory events, for BSP and ASP alike (rank 0 only).

:class:`EventRecorder` writes ``metrics.jsonl`` (one JSON object per line
with an ``event`` field; flushed once per control interval by its owner, not
per line), keeps the last evaluation and the emulated speed changes, and at
the end writes ``summary.json`` and ``model.pt`` atomically. It owns the
run's :class:`~omnilearn.observe.console.Console`. What a mode summarises on
top lives beside it: :mod:`omnilearn.observe.recorder` (BSP's ``Telemetry``)
and :mod:`omnilearn.observe.asplog` (the parameter server's ``ASPLog``).
Without a run directory nothing is written, and the console still speaks.

Run its tests: ``python -m pytest -q tests/unit/test_recorder.py``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from omnilearn.observe.console import Console
from omnilearn.observe.rundir import MetricsLog, write_json


class EventRecorder:
    def __init__(self, run_dir: Path | None, quiet: bool = False, console: Console | None = None) -> None:
        self.run_dir = run_dir
        self.log = MetricsLog(run_dir) if run_dir is not None else None
        self.console = console or Console(quiet=quiet)
        self.speed_changes: list[tuple[int, tuple[float, ...]]] = []  # (step or version, speeds) per change
        self.last_eval: dict[str, Any] = {}
        self.rebalances = 0

    def write(self, event: str, **fields: Any) -> None:
        """One line of ``metrics.jsonl``: ``{"event": event, **fields}``."""
        if self.log is not None:
            self.log.write({"event": event, **fields})

    def flush(self) -> None:
        if self.log is not None:
            self.log.flush()

    def speeds(self, at: int, speeds: Sequence[float], **where: Any) -> bool:
        """Record the emulated speeds in force from ``at`` on; False (nothing written) when they did not change."""
        speeds = tuple(speeds)
        if self.speed_changes and speeds == self.speed_changes[-1][1]:
            return False
        self.speed_changes.append((at, speeds))
        self.write("speeds", **where, speeds=list(speeds))
        return True

    def decision(self, decision, effective_step: int | None, applied: bool) -> None:
        """A ``decision`` event: ``new`` is what runs from ``effective_step`` (the old batches when not applied).

        ``proposed`` is the controller's proposal; ``predicted_s`` (the predicted
        step time before and after it) appears when the decision carries one.
        """
        predicted = getattr(decision, "predicted_s", None)
        self.write("decision", step=decision.step, effective_step=effective_step if applied else None,
                   old=list(decision.old), new=list(decision.new if applied else decision.old),
                   proposed=list(decision.new), times_s=list(decision.times_s), changed=applied,
                   reason=decision.reason, predicted_s=list(predicted) if predicted is not None else None)
        if applied:
            self.rebalances += 1

    def evaluation(self, **fields: Any) -> None:
        """An ``eval`` event (``test_loss``, ``test_accuracy``, where and when); the last one goes in the summary."""
        self.last_eval = dict(fields)
        self.write("eval", **fields)

    def declared_speeds(self, from_at: int) -> list[float] | None:
        """The speeds in force since ``from_at``, or None when they changed after it."""
        if not self.speed_changes or self.speed_changes[-1][0] > from_at:
            return None
        return list(self.speed_changes[-1][1])

    def finish(self, summary: dict[str, Any], save: Callable[[Path], None] | None = None) -> None:
        """Write ``summary.json`` (atomically), then the model by ``save(run_dir)``; close ``metrics.jsonl``."""
        if self.log is not None:
            self.log.close()
            self.log = None
        if self.run_dir is not None:
            write_json(self.run_dir / "summary.json", summary)
            if save is not None:
                save(self.run_dir)

    def report_run_dir(self, quiet: bool) -> None:
        if self.run_dir is not None and not quiet:
            self.console.info(f"run directory: {self.run_dir}")
