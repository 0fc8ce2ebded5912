"""Integrations with other training frameworks; each imports its framework only in its own module.

- :mod:`omnilearn.integrations.lightning`: ``OmniLearnStrategy`` for ``lightning.pytorch.Trainer``.

Run: ``python -m pytest -q tests/examples/test_lightning_example.py``
"""
