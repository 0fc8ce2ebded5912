"""balance: the pure batch-size policy of OmniLearn (numpy, never torch).

- ``allocation``: splitting the global batch (bounds, water-filling, exact rounding);
- ``controllers``: batch-size controllers (the paper's proportional rule, fixed plans);
- ``loop``: the ControlLoop that BSP and ASP both run (windows, history, gates);
- ``efficiency``: ideal step time and balance efficiency from per-step metrics.

Run its tests: ``python -m pytest -q tests/unit/test_allocation.py tests/unit/test_controller.py
tests/unit/test_loop.py tests/unit/test_efficiency.py``
"""
