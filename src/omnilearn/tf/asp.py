"""Asynchronous training on TensorFlow, part one (issue 35): a chief that plays the PyTorch server's part.

Not reachable from ``omnilearn train`` yet (``--framework tensorflow --mode asp`` is still refused); the design
and what was measured are in docs/tensorflow.md, "Asynchronous training". Roles:

- ``ps`` tasks hold every variable (``ParameterServerStrategy``): the Keras model's, the optimizer's, and
  ``version`` (pushes applied);
- ``worker`` tasks only host a ``tf.distribute.Server`` and a copy of the training arrays (sent once);
- the chief (this object, in the coordinator process) runs one thread per worker. Each thread deals its worker
  the next ``b_i`` sample indices of the epoch (:class:`~omnilearn.asp.rules.IndexDealer`, under the chief's
  lock: every sample once per epoch) and calls the gradient function pinned to that worker
  (``tf.device("/job:worker/replica:0/task:i")``): the worker reads ``version``, then the weights, and returns
  its loss, the version it read and its gradient as one flat tensor. The chief applies it, one push at a time
  under its lock, with the Keras optimizer under ``strategy.run`` (the update runs on the parameter server),
  scaled by ``b / b_ref`` (``b`` its samples, ``b_ref = B / n``: the linear learning-rate scaling of the
  PyTorch server, :func:`~omnilearn.asp.rules.push_lr`, entered through the gradient as there), and bumps
  ``version``.
- The batches: the PyTorch server's controller (:class:`~omnilearn.asp.control.PushControl` over
  :func:`~omnilearn.asp.control.push_loop`), fed each worker's cycle (dispatch to gradient in hand, plus its
  emulated delay) at its batch: every ``control_interval x live`` pushes it re-plans, so the workers push at the
  same rate; a dropped worker's share goes to the others. An emulated slower worker (``cfg.speeds``, the delay
  emulator) is the chief waiting ``(slowdown - 1) x`` the worker's own compute time (timed on the worker, the
  call's transport left out) before it applies that push: the gradient ages as a slower worker's would (no
  Python runs on a remote worker to sleep there).

So, as on the PyTorch server: workers send gradients, never weights, and keep no optimizer state; a push is
applied whole or not at all (the chief holds all of it before it applies any); its staleness is the pushes
applied since the version it read (:class:`~omnilearn.asp.rules.Staleness`, exact: the chief is the only writer;
a read that overlaps an apply may see some weights one version newer, so the count errs on the stale side);
``max_staleness`` refuses a push above the bound once per batch and has the worker recompute it
(:func:`~omnilearn.asp.rules.over_bound`). A call that fails: if the worker is gone
(``context.check_alive``), its indices are dealt again, first, to the others and it is dropped; if it is alive
(its call failed only because a peer's died: TensorFlow fails the calls in flight), the same push is sent again.
Nothing is applied twice, nothing lost: :class:`~omnilearn.asp.rules.Coverage` counts every sample of every
epoch.

Not yet: checkpoints and resume, a speed schedule, the launcher's ``chief`` and ``ps`` roles and ``--mode
asp``, ``summary.json``. Run: ``python -m pytest -q tests/tf/test_tf_asp.py``
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from omnilearn.asp.control import PushControl, push_loop
from omnilearn.asp.rules import Coverage, IndexDealer, Staleness, over_bound
from omnilearn.config import BalanceConfig
from omnilearn.emulation.speeds import parse_speeds, slowdown


MAX_RESENDS = 3  # a live worker whose call keeps failing is dropped after this many resends of one push


def worker_device(worker: int) -> str:
    return f"/job:worker/replica:0/task:{worker}"


@dataclass
class PushLog:
    """What the chief saw: per worker its applied pushes and resends; the workers dropped and why; the applied
    pushes in order as ``(worker, epoch, indices, version read, staleness, recomputed after a refusal)`` (kept
    only when ``keep_order``)."""

    workers: int
    pushes: list[int] = field(default_factory=list)
    resent: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)
    order: list[tuple] = field(default_factory=list)
    last_loss: float | None = None

    def __post_init__(self) -> None:
        self.pushes, self.resent = [0] * self.workers, [0] * self.workers


class Chief:
    """One asynchronous run over ``strategy``'s workers (see the module docstring).

    ``cfg``: the run's settings (``workers``, ``global_batch``, ``controller``, ``speeds``, ``control_interval``,
    ``min_batch``, ``max_batch``, ``deadband``, ``seed``, ``emulator``). ``build_model()`` and
    ``make_optimizer()`` are called under the strategy's scope (their variables go to the parameter servers);
    ``loss(y, y_pred)`` is a Keras loss. ``x``, ``y``: the training arrays, copied once to every worker. The run
    ends after ``epochs`` epochs, or ``max_pushes`` applied pushes if that comes first.
    ``kill``: tests only, ``(after_pushes, fn)``: ``fn()`` is called (it kills a worker's server) once the chief
    has applied that many pushes.
    """

    def __init__(self, strategy: tf.distribute.Strategy, cfg: BalanceConfig, build_model: Callable[[], object],
                 loss: Callable, make_optimizer: Callable[[], object], x: np.ndarray, y: np.ndarray, epochs: int,
                 max_pushes: int | None = None, max_staleness: int | None = None, keep_order: bool = False,
                 kill: tuple[int, Callable[[], None]] | None = None) -> None:
        workers = cfg.workers
        self.strategy, self.cfg, self.workers, self.loss, self.epochs = strategy, cfg, workers, loss, epochs
        self.b_ref = cfg.global_batch / workers
        declared = parse_speeds(cfg.speeds, workers, cfg.levels)
        self.slowdown = [slowdown(declared, w) if cfg.emulator == "delay" else 1.0 for w in range(workers)]
        total_pushes = max(1, math.ceil(epochs * len(x) / self.b_ref))
        self.control = PushControl(push_loop(cfg, declared, total_pushes, range(workers)), cfg.control_interval,
                                   lambda live, batches=None: push_loop(cfg, declared, total_pushes, live, batches))
        self.max_pushes, self.max_staleness, self.keep_order, self.kill = max_pushes, max_staleness, keep_order, kill
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
        self.dealer, self.coverage = IndexDealer(len(x), cfg.seed), Coverage(len(x))
        self.staleness, self.log = Staleness(workers), PushLog(workers)
        self.decisions: list[tuple[int, tuple[int, ...]]] = []  # (version, batches) after each change
        self.applied = 0  # pushes applied (the chief is the only writer of ``version``)
        self.in_flight = 0
        self.changed = threading.Condition()  # the chief's lock; notified when a push ends (indices may be back)
        self.gradient = tf.function(self._gradient)
        self.apply = tf.function(self._apply)

    @property
    def batches(self) -> tuple[int, ...]:
        """Every worker's batch now (0 for a dropped one)."""
        return self.control.batches

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

    def run(self) -> dict:
        """Train until every sample of ``epochs`` epochs was applied (or no worker is left); the summary."""
        start = time.perf_counter()
        threads = [threading.Thread(target=self._serve, args=(w,), name=f"omnilearn-asp-worker-{w}")
                   for w in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.summary(time.perf_counter() - start)

    def _deal(self, worker: int) -> tuple[int, list[int]] | None:
        """The next indices for ``worker``; None once the last epoch is dealt and no push is in flight (one in
        flight may still fail and give its indices back: then they are dealt here)."""
        with self.changed:
            while True:
                if self.max_pushes is not None and self.applied + self.in_flight >= self.max_pushes:
                    if self.in_flight == 0:
                        self.changed.notify_all()
                        return None
                    self.changed.wait()
                    continue
                epoch, indices = self.dealer.deal(self.control.batches[worker])
                if epoch < self.epochs:
                    self.in_flight += 1
                    return epoch, indices
                self.dealer.take_back(epoch, indices)  # past the last epoch: not dealt
                if self.in_flight == 0:
                    self.changed.notify_all()
                    return None
                self.changed.wait()

    def _serve(self, worker: int) -> None:
        """One worker's pushes, one after another, until nothing is left to deal or its server is gone."""
        x, y = self.data[worker]
        while (dealt := self._deal(worker)) is not None:
            epoch, indices = dealt
            scale = tf.constant(len(indices) / self.b_ref, dtype=tf.float64)
            retried, resends = False, 0
            while True:
                began = time.perf_counter()
                try:
                    with tf.device(worker_device(worker)):
                        loss, seen, flat, compute_s = self.gradient(x, y, tf.constant(indices, dtype=tf.int32))
                    loss, seen, flat = float(loss), int(seen), flat.numpy()  # all of it here, or an error
                except tf.errors.OpError as e:
                    if resends < MAX_RESENDS and context.context().check_alive(worker_device(worker)):
                        resends += 1  # a peer's death failed this call too: send it again
                        self.log.resent[worker] += 1
                        continue
                    self._drop(worker, epoch, indices, e)
                    return
                if self.slowdown[worker] > 1.0:  # an emulated slower worker: its gradient arrives later, by the
                    time.sleep((self.slowdown[worker] - 1.0) * float(compute_s))  # extra time its compute takes
                cycle_s = time.perf_counter() - began
                if self._push(worker, epoch, indices, loss, seen, flat, scale, retried, cycle_s):
                    break
                retried = True  # refused as too stale: the same samples on fresh weights

    def _push(self, worker: int, epoch: int, indices: list[int], loss: float, seen: int, flat: np.ndarray,
              scale: tf.Tensor, retried: bool, cycle_s: float) -> bool:
        """Apply one push, or refuse it as too stale (False: the worker recomputes it)."""
        kill = None
        with self.changed:
            stale = self.staleness.of(worker, self.applied, seen)
            if over_bound(stale, self.max_staleness, retried):
                self.staleness.refused[worker] += 1
                return False
            self.apply(tf.constant(flat), scale)
            self.applied += 1
            self.staleness.record(worker, self.applied - 1, seen)
            self.coverage.add(epoch, indices)
            self.log.pushes[worker] += 1
            self.log.last_loss = loss
            if self.keep_order:
                self.log.order.append((worker, epoch, list(indices), seen, stale, retried))
            if self.control.record(worker, len(indices), cycle_s, self.slowdown[worker]):
                decision = self.control.decide(self.applied)
                if decision.changed:
                    self.decisions.append((self.applied, self.control.batches))
            self.in_flight -= 1
            self.changed.notify_all()
            if self.kill is not None and self.applied >= self.kill[0]:
                kill, self.kill = self.kill[1], None
        if kill is not None:
            kill()
        return True

    def _drop(self, worker: int, epoch: int, indices: list[int], error: Exception) -> None:
        with self.changed:
            self.dealer.take_back(epoch, indices)
            self.in_flight -= 1
            self.control.drop(worker)  # its share goes to the live others
            self.log.dropped[worker] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
            self.changed.notify_all()

    def summary(self, wall_s: float) -> dict:
        s = self.staleness
        return {"wall_s": wall_s, "pushes": list(self.log.pushes), "resent": list(self.log.resent),
                "applied": self.applied, "version": int(self.version.numpy()),
                "dropped": {str(w): why for w, why in self.log.dropped.items()},
                "staleness": {"p50": [s.quantile(0.5, w) for w in range(self.workers)],
                              "p99": [s.quantile(0.99, w) for w in range(self.workers)],
                              "max": list(s.maxima), "refused": list(s.refused)},
                "coverage": self.coverage.summary(), "last_loss": self.log.last_loss,
                "batches": list(self.control.batches), "decisions": [[v, list(b)] for v, b in self.decisions],
                "order": self.log.order}
