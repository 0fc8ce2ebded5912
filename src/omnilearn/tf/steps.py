"""The TensorFlow graph functions of a worker: the weighted training step and the one gather of timings.

:class:`TrainStep` compiles one ``tf.function`` whose input signature has a
``None`` batch dimension, so a worker's batch may change every control
interval without a retrace. Inside ``strategy.run`` (one replica per
worker) it computes this worker's mean loss over its ``b_i`` samples and
its gradient, multiplies the gradient by ``b_i / B``, calls ``before_sync``
(a ``tf.py_function`` that depends on every gradient: the delay emulator
sleeps there, then the clock marks the local compute done) and applies the
gradients with the user's Keras optimizer, whose ``apply_gradients`` in a
replica context all-reduces them with SUM across workers. The sum of
``(b_i / B) x mean_i`` is the mean over the global batch: every worker
makes the update one worker with the whole batch would make.

As Keras' own step: the loss is scaled by ``optimizer.scale_loss`` before
the gradient (a ``LossScaleOptimizer``, which ``compile`` wraps around the
optimizer under the ``mixed_float16`` policy, unscales, skips non-finite
steps and updates its scale; a ``loss_scale_factor``); with a
``LossScaleOptimizer`` one scalar all-reduce more per step makes every
worker see the same finiteness (:func:`agree_finite`), so all skip the same
steps. A variable the loss does not reach (gradient ``None``) is left out
of the update as Keras leaves it out (its optimizer warns, naming it);
every worker traces the same graph, so the same ones everywhere.

A rider (:meth:`TrainStep.rider`; none here, ``ol.fit``'s metrics' states in
:class:`omnilearn.tf.fit.FitStep`) is SUM all-reduced in a collective the
step makes anyway: the gradients' own (:func:`apply_carrying`: one pack of
one dtype, the gradients at their usual offsets) or, with a
``LossScaleOptimizer``, the finiteness all-reduce. So a step of ``ol.fit``
launches one collective (two with a ``LossScaleOptimizer``), its metrics
included (``tests/tf/test_tf_fit_collectives.py`` counts them).

Keras losses divide by the number of replicas under ``tf.distribute``
(``scale_loss_for_distribution``); a Keras ``Loss`` object is therefore
used per sample (its reduction set to none) and averaged here, so no
replica scaling enters the gradient. A plain callable must return the
per-sample losses or their mean over this worker's batch. The model's own
losses (``model.losses``: ``add_loss``, kernel regularisers) are added when
``model_losses=True`` (as Keras' ``fit`` adds them), left to the loss
callable when ``False``; a model that has some while ``model_losses`` is
unset is refused at its first step, in one line: dropping them silently
trained another model than the Keras guide's loop.

:class:`Gather`: every worker fills its own row of an ``n x k`` float64
table and one SUM all-reduce gives every worker all rows.

Run: ``python -m pytest -q tests/tf``
"""

from __future__ import annotations

from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from omnilearn.config import ConfigError


def per_sample(loss: Callable) -> Callable:
    """A Keras ``Loss`` with its reduction set to none (no replica scaling); any other callable as it is."""
    if isinstance(loss, keras.losses.Loss) and loss.reduction not in (None, "none"):
        return type(loss).from_config({**loss.get_config(), "reduction": None})
    return loss


class TrainStep:
    """``step(x, y, scale)`` -> this worker's mean loss; see the module docstring."""

    def __init__(self, strategy: tf.distribute.Strategy, model: keras.Model, optimizer, loss: Callable,
                 before_sync: Callable[[], None], model_losses: bool | None = None) -> None:
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.model_losses = model_losses
        self.refusal: str | None = None  # what tracing found it cannot weight (raised before the first step)
        self.loss, self.before_sync = per_sample(loss), before_sync
        self.function: Callable | None = None

    def __call__(self, x: np.ndarray, y: np.ndarray, scale: float) -> float:
        if self.function is None:  # the signature from the first batch, any batch size
            self.function = self.traced(x, y)
        out = self.function(x, y, tf.constant(scale, tf.float64))  # b_i/B, exact; cast to each gradient's dtype
        return float(self.strategy.experimental_local_results(out)[0])

    def traced(self, x: np.ndarray, y: np.ndarray):
        """The step's ``tf.function`` for batches like ``(x, y)``, traced; raises what the trace refused (one line,
        before any step ran: an exception raised inside a trace reaches the caller as a multi-line StagingError)."""
        spec = [tf.TensorSpec((None, *x.shape[1:]), tf.as_dtype(x.dtype)),
                tf.TensorSpec((None, *y.shape[1:]), tf.as_dtype(y.dtype)), tf.TensorSpec((), tf.float64)]
        function = tf.function(self._run, input_signature=spec)
        function.get_concrete_function()
        if self.refusal is not None:
            raise ConfigError(self.refusal)
        return function

    @property
    def traces(self) -> int:
        """How many times the step was traced (1 whatever the batch sizes)."""
        return 0 if self.function is None else self.function.experimental_get_tracing_count()

    def _run(self, x, y, scale):
        return self.strategy.run(self._replica, args=(x, y, scale))

    def _model_losses(self):
        """The model's own losses to add (0 where there are none or the loss callable adds them)."""
        extra = self.model.losses
        if not extra or self.model_losses is False:
            return 0.0
        if self.model_losses is None:  # refused once traced (traced())
            self.refusal = (f"the model has {len(extra)} loss(es) of its own (model.losses: add_loss, kernel "
                            "regularizers) that ol.step would not add: ol.wrap(model, optimizer, loss, "
                            "model_losses=True) adds them as Keras' fit does; model_losses=False if your loss "
                            "callable adds them")
            return 0.0
        return tf.add_n(extra)

    def rider(self, y, pred, loss, dtype):
        """A tensor to SUM all-reduce with the step's gradients (``dtype``: theirs), or None: nothing (here).

        ``ol.fit``'s step (:class:`omnilearn.tf.fit.FitStep`) carries the metrics' states on it.
        """
        return None

    def _replica(self, x, y, scale):
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            pred = self.model(x, training=True)
            loss = tf.reduce_mean(self.loss(y, pred)) + self._model_losses()
            scaled = self.optimizer.scale_loss(loss) if hasattr(self.optimizer, "scale_loss") else loss
        grads = [None if g is None else g * tf.cast(scale, g.dtype) for g in tape.gradient(scaled, variables)]
        ready = tf.py_function(self._ready, [g for g in grads if g is not None], tf.float32)  # after every gradient
        with tf.control_dependencies([ready]):
            grads = [None if g is None else tf.identity(g) for g in grads]  # the all-reduce starts after the delay
            rider = self.rider(y, pred, loss, next((g.dtype for g in grads if g is not None), None))
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            grads, carried = agree_finite(grads, rider)
            self.optimizer.apply_gradients(zip(grads, variables))
        else:
            carried = apply_carrying(self.optimizer, grads, variables, rider)
        return loss if rider is None else (loss, carried)

    def _ready(self, *_grads) -> float:
        self.before_sync()
        return 0.0


def agree_finite(grads: list, rider=None) -> tuple[list, object]:
    """Every worker's gradients non-finite if any worker's are (one SUM all-reduce), None kept as None; ``rider``
    (None: nothing) SUM all-reduced in the same collective: ``(grads, reduced rider)``.

    ``LossScaleOptimizer`` checks its replica's own gradients before the all-reduce and skips the step (halving
    its scale) where one is not finite: without this, one worker would skip while the others wait in its
    all-reduce. Poisoned alike, every worker skips the same steps and keeps the same scale.
    """
    present = [g for g in grads if g is not None]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in present])
    context = tf.distribute.get_replica_context()
    if rider is None:
        bad, carried = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(~finite, tf.float32)), None
    else:  # one dtype, one pack: one collective
        bad, carried = context.all_reduce(tf.distribute.ReduceOp.SUM, [tf.cast(~finite, rider.dtype), rider])
    poison = bad > 0
    return [None if g is None else tf.where(poison, tf.constant(float("nan"), g.dtype), g) for g in grads], carried


def apply_carrying(optimizer, grads: list, variables: list, rider):
    """``optimizer.apply_gradients``, with ``rider`` (None: nothing) SUM all-reduced in the gradients' own
    all-reduce (one collective): the reduced rider.

    The Keras optimizer all-reduces the gradients in ``_all_reduce_sum_gradients`` (one pack of one dtype:
    one collective); for this call only, the rider goes first in its list, so after TensorFlow's reversal the
    packed buffer holds every gradient at its usual offset and the rider after them. Where that is not called
    in this graph (another optimizer, gradient accumulation's ``cond``) or the dtypes differ, the rider gets an
    all-reduce of its own.
    """
    if rider is None:
        optimizer.apply_gradients(zip(grads, variables))
        return None
    carried = []
    original = getattr(optimizer, "_all_reduce_sum_gradients", None)
    same = {g.dtype for g in grads if g is not None} == {rider.dtype}

    def carrying(grads_and_vars):
        if carried:
            return original(grads_and_vars)
        (reduced, _), *pairs = original([(rider, None), *grads_and_vars])
        carried.append(reduced)
        return pairs

    if original is not None and same and not getattr(optimizer, "gradient_accumulation_steps", None):
        optimizer.__dict__["_all_reduce_sum_gradients"] = carrying  # this instance, this trace only; no tracking
        try:
            optimizer.apply_gradients(zip(grads, variables))
        finally:
            optimizer.__dict__.pop("_all_reduce_sum_gradients", None)
    else:
        optimizer.apply_gradients(zip(grads, variables))
    if carried and carried[0].graph is rider.graph:
        return carried[0]
    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, rider)


class Gather:
    """``gather(row)`` -> the ``n x k`` table of every worker's row (one SUM all-reduce)."""

    def __init__(self, strategy: tf.distribute.Strategy, rank: int, workers: int, width: int) -> None:
        self.strategy, self.rank, self.shape = strategy, rank, (workers, width)
        self.function = tf.function(self._run, input_signature=[tf.TensorSpec(self.shape, tf.float64)])

    def __call__(self, row: list[float]) -> np.ndarray:
        if len(row) > self.shape[1]:
            raise ValueError(f"a row of {len(row)} values does not fit a table {self.shape[1]} wide")
        table = np.zeros(self.shape)
        table[self.rank, : len(row)] = row
        out = self.function(tf.constant(table))
        return self.strategy.experimental_local_results(out)[0].numpy()

    def _run(self, table):
        def reduce(t):  # identity: an all-reduce of a bare function input has no device to reduce to
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(t))
        return self.strategy.run(reduce, args=(table,))
