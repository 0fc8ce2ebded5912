"""The harness's datasets, all offline; load them with ``core.load(name_or_spec)``.

``base`` holds the shared types (``DataError``, ``TensorData``, ``Splits``);
``images`` and ``text`` build on it; ``core`` generates MNIST-1D and synthetic
data and dispatches to the others. Tests: ``python -m pytest -q tests/unit/test_data.py``.
"""
