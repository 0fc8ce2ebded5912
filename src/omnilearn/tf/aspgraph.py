"""What the TensorFlow ASP chief (:mod:`omnilearn.tf.asp`) places on the cluster, and the two functions it calls.

:class:`Placed` builds the Keras model and optimizer under ``ParameterServerStrategy``'s scope (every variable,
and ``version``, the pushes applied, on the parameter servers), copies the training arrays once into each
worker's memory, and compiles:

- :meth:`Placed.gradient`, called pinned to a worker (``tf.device(worker_device(i))``): it reads ``version``,
  then the weights, and returns the loss, that version, the gradient as one flat tensor and the seconds the
  worker spent (``tf.timestamp`` on the worker: forward with its reads of the weights, and backward);
- :meth:`Placed.apply`: one push, ``flat x scale``, applied by the Keras optimizer under ``strategy.run`` (the
  update runs on the parameter server, where its variables are), then ``version + 1``.

Run: ``python -m pytest -q tests/tf/test_tf_asp.py``
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf


def worker_device(worker: int) -> str:
    return f"/job:worker/replica:0/task:{worker}"


class Placed:
    """The model, optimizer and ``version`` on the parameter servers, the data on the workers; see the module."""

    def __init__(self, strategy: tf.distribute.Strategy, build_model: Callable[[], object],
                 make_optimizer: Callable[[], object], loss: Callable, x: np.ndarray, y: np.ndarray,
                 workers: int) -> None:
        self.strategy, self.loss = strategy, loss
        with strategy.scope():
            self.model = build_model()
            self.optimizer = make_optimizer()
            self.optimizer.build(self.model.trainable_variables)
            self.version = tf.Variable(0, dtype=tf.int64, name="omnilearn_version")
        weights = self.model.trainable_variables
        self.shapes, self.sizes = [w.shape for w in weights], [int(np.prod(w.shape)) for w in weights]
        self.data = []
        for w in range(workers):  # the arrays, once, into each worker's memory
            with tf.device(worker_device(w)):
                self.data.append((tf.identity(tf.constant(x)), tf.identity(tf.constant(y))))
        # the indices of any length: one trace per worker, whatever its batch (each batch change retraced: seconds
        # on a small host, inside the worker's measured cycle)
        x0, y0 = self.data[0]
        self.gradient = tf.function(self._gradient, input_signature=[
            tf.TensorSpec(x0.shape, x0.dtype), tf.TensorSpec(y0.shape, y0.dtype), tf.TensorSpec([None], tf.int32)])
        self.apply = tf.function(self._apply)

    def _gradient(self, x, y, indices):
        """On the worker: the loss, the version read before the weights, the gradient as one flat tensor, and the
        seconds the worker spent on it (the forward, with its reads of the weights, and the backward)."""
        seen = self.version.read_value()
        with tf.control_dependencies([seen]):
            start = tf.timestamp()
        with tf.control_dependencies([start]):
            xb, yb = tf.gather(x, indices), tf.gather(y, indices)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(self.loss(yb, self.model(xb, training=True)))
        grads = tape.gradient(loss, self.model.trainable_variables)
        flat = tf.concat([tf.reshape(g, [-1]) for g in grads], 0)
        with tf.control_dependencies([flat]):
            took = tf.timestamp() - start
        return loss, seen, flat, took

    def _apply(self, flat, scale):
        """On the parameter server (the optimizer's update is placed with its variables), one push."""
        def update(flat, scale):
            parts = tf.split(flat * tf.cast(scale, flat.dtype), self.sizes)
            self.optimizer.apply([tf.reshape(p, s) for p, s in zip(parts, self.shapes)],
                                 self.model.trainable_variables)
            with tf.control_dependencies([tf.identity(self.optimizer.iterations.value)]):
                self.version.assign_add(1)
        self.strategy.run(update, args=(flat, scale))
