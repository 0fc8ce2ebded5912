"""``ol.fit``'s metrics reduced across workers (:class:`Reduced`) and its step (:class:`FitStep`), which carries them.

Each worker updates the loss (a ``Mean`` of each step's mean loss weighted by its ``b_i``) and the compiled
metrics on its own samples, inside the step's graph, and writes their states (totals and counts) into its row
of a ``workers x states`` table, zeros elsewhere; the table rides on the step's gradient all-reduce
(:meth:`omnilearn.tf.steps.TrainStep.rider`), so every worker gets every worker's row, exactly (each cell has one
nonzero addend), with no collective of its own. The sum of the rows, in float64 in worker order, is the global
batch's states; the logs are the metrics' results from them (:meth:`Reduced.results_of`), this worker's own
states kept. Validation fills the same metrics and reduces them with one :class:`~omnilearn.tf.steps.Gather`.

The table's dtype is the gradients' where it holds every state exactly (float32 states in a float32 table; see
:data:`EXACT_IN`), else float64 and an all-reduce of its own. Everything runs in this worker's replica
context: a metric built in ``ol.scope()`` has sync-on-read variables, which a read outside it would all-reduce.

Run: ``python -m pytest -q tests/tf/test_tf_fit_collectives.py tests/tf/test_tf_fit.py``
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from omnilearn.tf.steps import Gather, TrainStep


MULTI_OUTPUT_ROUTE = ("for a model with several outputs use the custom loop: ol.wrap(model, optimizer, loss=a "
                      "callable of (y, outputs) returning per-sample losses or their mean) and ol.step(x, y)")


class FitStep(TrainStep):
    """The weighted step that adds ``model.losses`` and carries the metrics (:class:`Reduced`) on its all-reduce.

    After a call, :attr:`table` is every worker's metric states of this step (one row each, the same on every
    worker): :meth:`Reduced.results_of` makes the logs of it, without another collective.
    """

    def __init__(self, *args: Any, metrics: "Reduced") -> None:
        super().__init__(*args, model_losses=False)  # added here, as Keras' compute_loss adds them
        self.per_sample_loss, self.loss = self.loss, self._loss
        self.metrics, self.table = metrics, None

    def _loss(self, y, y_pred):
        """Per-sample loss plus the model's regularisation losses (as Keras' ``compute_loss`` adds them)."""
        if isinstance(y_pred, (list, tuple, dict)):  # a subclassed model with several outputs (seen when traced)
            self.refusal = (f"ol.fit(model): the model returned {len(y_pred)} outputs and model.compile has one "
                            f"loss; {MULTI_OUTPUT_ROUTE}")  # raised once traced (TrainStep.traced)
            y_pred = tf.nest.flatten(y_pred)[0]
        losses = self.per_sample_loss(y, y_pred)
        extra = self.model.losses
        return losses + tf.cast(tf.add_n(extra), losses.dtype) if extra else losses

    def __call__(self, x: np.ndarray, y: np.ndarray, scale: float) -> float:
        if self.function is None:
            self.metrics.build_for(self.model, x, y)
            self.function = self.traced(x, y)
        loss, table = self.function(x, y, tf.constant(scale, tf.float64))
        local = self.strategy.experimental_local_results
        self.table = local(table)[0].numpy()
        return float(local(loss)[0])

    def rider(self, y, pred, loss, dtype):
        """This worker's samples into the metrics; their states as this worker's row of the table."""
        self.metrics.update_here(y, pred, loss, tf.shape(y)[0])
        return self.metrics.table_here(dtype)


EXACT_IN = {"float16": {"float16"}, "bfloat16": {"bfloat16"}, "float32": {"float16", "bfloat16", "float32"},
            "float64": {"float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "uint8", "uint16",
                        "uint32", "bool"}}  # the state dtypes each table dtype holds exactly


class Reduced:
    """The loss and the compiled metrics, each worker filling them with its own samples; the global batch's results
    from the sum of every worker's states (see the module docstring)."""

    def __init__(self, session, compiled) -> None:
        self.session, self.tracker, self.compiled = session, keras.metrics.Mean(name="loss"), compiled
        self.metrics = [self.tracker, *([compiled] if compiled is not None else [])]
        self.gather: Gather | None = None
        self.graphs: tuple[Callable, Callable] | None = None  # validation's update and row, once built
        self._reset: Callable | None = None
        self.from_sums = tf.function(lambda total: self._here(self._from_sums, total))

    @property
    def variables(self) -> list:
        return [v for m in self.metrics for v in m.variables]

    def _here(self, function: Callable, *args):
        """``function(*args)`` in this worker's replica context; its own results."""
        s = self.session.strategy
        return tf.nest.map_structure(lambda t: s.experimental_local_results(t)[0], s.run(function, args=args))

    def reset(self) -> None:
        """Every state to its start, this worker's own (no all-reduce of sync-on-read variables)."""
        if self.compiled is not None and not self.compiled.built:
            self.tracker.reset_state()  # the compiled metrics hold nothing yet; a graph now would miss them
        else:
            self._reset = self._reset or tf.function(lambda: self._here(self._reset_here))
            self._reset()

    def _reset_here(self) -> None:
        for m in self.metrics:
            m.reset_state()

    def build(self, y, y_pred) -> None:
        """The compiled metrics' variables (made on their first update under Keras), outside any scope: local."""
        if self.compiled is not None and not self.compiled.built:
            self.compiled.build(y, y_pred)

    def build_for(self, model, x, y) -> None:
        """:meth:`build` before the step's graph (which cannot make variables): from one sample's prediction."""
        if self.compiled is not None and not self.compiled.built:
            with self.session.strategy.scope():  # an unbuilt model builds here as in the step: mirrored
                pred = model(x[:1], training=False)
            self.build(y[:1], pred)

    def update(self, y, y_pred, losses, weight=None) -> None:
        """This worker's samples: per-sample ``losses``, or a batch's mean loss with its ``weight`` (its size)."""
        if self.graphs is None:
            self.build(y, y_pred)
            self.graphs = (tf.function(lambda *a: self._here(self.update_here, *a), reduce_retracing=True),
                           tf.function(lambda: self._here(self._row)))
        self.graphs[0](y, y_pred, losses, weight)

    def update_here(self, y, y_pred, losses, weight) -> None:
        """:meth:`update` in the replica context."""
        dtype = self.tracker.dtype  # a Python float would enter Keras as float32
        self.tracker.update_state(tf.cast(losses, dtype), None if weight is None else tf.cast(weight, dtype))
        for m in self.metrics[1:]:
            m.update_state(y, y_pred)

    def table_here(self, dtype) -> tf.Tensor:
        """The ``workers x states`` table, this worker's row its states, zeros elsewhere, in ``dtype`` where it holds
        every state exactly (else float64): summed across workers, each cell is one worker's value, exactly."""
        variables = self.variables
        if dtype is None or not all(v.dtype in EXACT_IN.get(tf.as_dtype(dtype).name, ()) for v in variables):
            dtype = tf.float64
        row = tf.concat([tf.reshape(tf.cast(v.value, dtype), [-1]) for v in variables], 0)
        s = self.session
        return tf.pad(row[None, :], [[s.rank, s.world_size - 1 - s.rank], [0, 0]])

    def results_of(self, table: np.ndarray, prefix: str = "") -> dict[str, float]:
        """The logs from every worker's states (``table``: one row each), summed in float64 in worker order."""
        logs = self.from_sums(tf.constant(np.asarray(table, np.float64).sum(axis=0)))
        return {f"{prefix}{k}": float(v) for k, v in logs.items()}

    def results(self, prefix: str = "") -> dict[str, float]:
        """The logs of the states :meth:`update` filled: one gather of every worker's states."""
        local = self.graphs[1]().numpy()
        if self.gather is None:  # the same width on every worker: the same compiled metrics
            s = self.session
            self.gather = Gather(s.strategy, s.rank, s.world_size, local.size)
        return self.results_of(self.gather(local.tolist()), prefix)

    def _row(self):
        return tf.concat([tf.reshape(tf.cast(v.value, tf.float64), [-1]) for v in self.variables], 0)

    def _from_sums(self, total):
        """The results of the summed states ``total`` (this worker's own states kept)."""
        variables = self.variables
        saved = [tf.identity(v.value) for v in variables]
        at = 0
        for v in variables:
            size = int(np.prod(v.shape))
            v.assign(tf.cast(tf.reshape(total[at : at + size], v.shape), v.dtype))
            at += size
        logs = {}
        for m in self.metrics:
            result = m.result()
            logs.update(result if isinstance(result, dict) else {m.name: result})
        with tf.control_dependencies(list(logs.values())):
            for v, value in zip(variables, saved):
                v.assign(value)
        return logs
