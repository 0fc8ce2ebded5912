"""OmniLearn on TensorFlow: the same balancing for Keras models on ``tf.distribute`` (the ``[tensorflow]`` extra).

    import omnilearn.tf
    ol = omnilearn.tf.setup(global_batch=512)   # the MultiWorkerMirroredStrategy cluster of TF_CONFIG
    with ol.scope():
        model, optimizer = ..., ...             # a Keras model and optimizer
    ol.wrap(model, optimizer, loss)
    loader = ol.data(x_train, y_train)
    for epoch in range(ol.epochs):              # with total_steps=...; or your own epoch count
        loader.set_epoch(epoch)
        for x, y in loader:                     # this worker's share of each global batch
            ol.step(x, y)
    ol.finish()

A compiled Keras model trains with ``history = ol.fit(model, dataset, epochs=..., callbacks=[...])``
instead (:mod:`omnilearn.tf.fit`; ``dataset``: arrays or an unbatched ``tf.data.Dataset``,
:mod:`omnilearn.tf.data`); ``omnilearn launch script.py`` starts a script's local workers.

The whole loop example is in :mod:`omnilearn.tf.session`; ``omnilearn train
--framework tensorflow`` runs the default job on it. TensorFlow is imported
by :func:`setup` (and :mod:`~omnilearn.tf.session`, :mod:`~omnilearn.tf.steps`),
not by ``import omnilearn`` nor by this package; nothing here imports torch.
"""

from __future__ import annotations

__all__ = ["TFSession", "setup"]


def __getattr__(name: str):  # lazy: the pure modules (cluster, timing) import without TensorFlow
    if name == "setup":
        from omnilearn.tf.api import setup

        return setup
    if name == "TFSession":
        from omnilearn.tf.session import TFSession

        return TFSession
    raise AttributeError(f"module 'omnilearn.tf' has no attribute {name!r}")
