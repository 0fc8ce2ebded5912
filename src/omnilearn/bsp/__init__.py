"""Synchronous (BSP) training on the balanced data path: the public :class:`~omnilearn.bsp.session.Session`.

``setup.py`` (``omnilearn.setup``), ``session.py`` (the API), ``steps.py``
(step ledger, training clock), ``micro.py`` (accumulation and loss
weighting), ``interval.py`` (where ranks meet: control intervals, settings
check), ``wrap.py`` (DDP and the hook), ``emulate.py`` (emulated speeds),
``rng.py`` (per-rank random streams).

Run: ``python -m pytest -q tests/unit/test_session_state.py tests/dist/test_api.py tests/dist/test_accumulation.py``
"""
