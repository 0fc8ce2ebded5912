"""The BSP data path: :mod:`~omnilearn.data.plan` (global permutation, batch schedule, sampler) and
:mod:`~omnilearn.data.loader` (the loader a session hands out).

Run: ``python -m pytest -q tests/unit/test_sampler.py``
"""
