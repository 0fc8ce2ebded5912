"""Plots of finished runs and benches (``omnilearn report DIR``), layered without import cycles.

``records`` (read ``metrics.jsonl`` / ``bench.json``, pure) and ``aspruns``
(the same for ASP pushes) at the bottom; ``plots`` and ``aspplots`` draw;
``asp`` renders ASP runs and benches; ``runs.render`` dispatches. Each layer
imports only the ones below it. Tests: ``python -m pytest -q tests/unit/test_report.py``.
"""
