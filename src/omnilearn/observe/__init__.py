"""What a run leaves behind, for BSP and ASP alike (rank 0 only).

- :mod:`omnilearn.observe.events`: :class:`~omnilearn.observe.events.EventRecorder`, the one writer of
  ``metrics.jsonl`` events, ``summary.json`` and ``model.pt``, owner of the console.
- :mod:`omnilearn.observe.recorder`: BSP's :class:`~omnilearn.observe.recorder.Telemetry` (summary on top).
- :mod:`omnilearn.observe.asplog`: the parameter server's :class:`~omnilearn.observe.asplog.ASPLog`.
- :mod:`omnilearn.observe.suffix`: bounded, exact "last half" statistics over a long stream.
- :mod:`omnilearn.observe.console`: human output; :mod:`omnilearn.observe.rundir`: the run directory.

Run the tests: ``python -m pytest -q tests/unit/test_recorder.py``
"""
