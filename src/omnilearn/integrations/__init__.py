"""Integrations with other training frameworks; each imports its framework only in its own module.

- :mod:`omnilearn.integrations.lightning`: ``OmniLearnStrategy`` for ``lightning.pytorch.Trainer``.
- :mod:`omnilearn.integrations.hf`: ``OmniLearnTrainer``, a drop-in ``transformers.Trainer``.
- :mod:`omnilearn.integrations.ray`: ``omnilearn.setup()`` in Ray Train's ``TorchTrainer``; ``report``/``resume``
  through Ray's checkpoints.

Sharded models (FSDP2, ``fully_shard``) need no integration: ``ol.wrap_model`` takes them
(:mod:`omnilearn.bsp.sharded`).

Run: ``python -m pytest -q tests/examples/test_lightning_example.py tests/examples/test_hf_trainer.py``
"""
