"""Asynchronous training on TensorFlow (issue 35): a chief that plays the PyTorch parameter server's part.

``omnilearn train --framework tensorflow --mode asp`` runs it (:mod:`omnilearn.experiments.train.tfasp`); the
design, and what was checked and measured, are in docs/tensorflow.md, "Asynchronous training". In brief:
``ps`` tasks hold every variable (``ParameterServerStrategy``: the model's, the optimizer's, ``version``);
``worker`` tasks host a ``tf.distribute.Server`` and a copy of the training arrays; the chief (this object)
runs one thread per worker, deals it the next ``b_i`` indices of the epoch
(:class:`~omnilearn.asp.rules.IndexDealer`: every sample once per epoch) and calls the gradient function pinned
to it (``tf.device``), which returns the loss, the ``version`` read before the weights and the flat gradient.
The chief applies each push whole, one at a time under its lock, with the Keras optimizer under
``strategy.run`` (on the parameter server) at the PyTorch server's rate
(:func:`~omnilearn.asp.rules.push_lr`, entered through the gradient): gradients pushed, never weights.
Staleness is exact per push (:class:`~omnilearn.asp.rules.Staleness`); ``max_staleness`` refuses a push above
the bound once (:func:`~omnilearn.asp.rules.over_bound`). The batches: the PyTorch server's controller
(:class:`~omnilearn.asp.control.PushControl`) on each worker's cycle, so the workers push at the same rate; an
emulated slower worker is the chief waiting ``(slowdown - 1) x`` its compute time (timed on the worker) before
it applies the push. A worker that is gone (``context.check_alive``), or hung (a call late: :mod:`.aspwatch`),
is dropped and its indices dealt again to the others; a live one whose call failed with a peer's death sends
it again. The record is the PyTorch server's (:class:`~omnilearn.observe.asplog.ASPLog`); ``evaluate(model)``
runs after each epoch dealt and at the end, under the lock, the training clock paused; ``max_time_s`` stops
the run. An error in a worker's thread (a non-finite gradient) stops the others and is raised by ``run()``.
Not yet: checkpoints and resume, a speed schedule, several machines.

Run: ``python -m pytest -q tests/tf/test_tf_asp.py``
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from omnilearn.asp.control import PushControl, push_loop
from omnilearn.asp.rules import Coverage, IndexDealer, Staleness, over_bound, push_lr
from omnilearn.asp.settings import ASPSettings
from omnilearn.clocks.train import TrainClock
from omnilearn.config import BalanceConfig, dump_toml
from omnilearn.observe.asplog import ASPLog
from omnilearn.observe.rundir import prepare
from omnilearn.emulation.speeds import parse_speeds, slowdown
from omnilearn.tf.aspgraph import Placed, worker_device
from omnilearn.tf.asptally import PushLog, tally
from omnilearn.tf.aspwatch import CallWatch
from omnilearn.tf.batches import save_weights


MAX_RESENDS = 3  # a live worker whose call keeps failing is dropped after this many resends of one push
WATCH_S = 0.5  # how often run() looks for a call older than its allowance (a hung worker)


class WorkerHung(RuntimeError):
    """A worker's call did not come back within its allowance (:meth:`Chief._watch`)."""


class Chief:
    """One asynchronous run over ``strategy``'s workers (see the module docstring).

    ``cfg``: the run's settings (``workers``, ``global_batch``, ``controller``, ``speeds``, ``control_interval``,
    ``min_batch``, ``max_batch``, ``deadband``, ``seed``, ``emulator``, ``quiet``); ``settings``: the server's
    own (``lr_scaling``, ``staleness_lr``, ``max_time_s``, ``max_staleness``; checkpoints are not written).
    ``build_model()`` and ``make_optimizer()`` are called under the strategy's scope (their variables go to the
    parameter servers); ``loss(y, y_pred)`` is a Keras loss. ``x``, ``y``: the training arrays, copied once to
    every worker. The run ends after ``epochs`` epochs, or ``max_pushes`` applied pushes if that comes first,
    or ``settings.max_time_s`` of training. ``evaluate(model) -> (loss, accuracy)``: after each epoch dealt and
    at the end (None: never). ``lr_at(version)``: the optimizer's base rate at that many pushes, for the record
    (None: its rate read once at the start). ``run_dir``: a prepared directory for ``metrics.jsonl``,
    ``summary.json`` and ``model.weights.h5`` (None: ``cfg.out``, checked and prepared as ``omnilearn.setup`` does,
    with ``config.toml``; neither: nowhere). ``kill``: tests only, ``(after_pushes, fn)``: ``fn()`` is called (it
    kills a worker's server) once the chief has applied that many pushes.
    """

    def __init__(self, strategy: tf.distribute.Strategy, cfg: BalanceConfig, build_model: Callable[[], object],
                 loss: Callable, make_optimizer: Callable[[], object], x: np.ndarray, y: np.ndarray, epochs: int,
                 max_pushes: int | None = None, settings: ASPSettings | None = None,
                 evaluate: Callable[[object], tuple[float, float]] | None = None,
                 lr_at: Callable[[int], float] | None = None, run_dir: Path | None = None,
                 keep_order: bool = False, kill: tuple[int, Callable[[], None]] | None = None) -> None:
        workers = cfg.workers
        self.strategy, self.cfg, self.workers, self.epochs = strategy, cfg, workers, epochs
        self.settings = ASPSettings() if settings is None else settings
        self.b_ref = cfg.global_batch / workers
        self.declared = parse_speeds(cfg.speeds, workers, cfg.levels)
        self.slowdown = [slowdown(self.declared, w) if cfg.emulator == "delay" else 1.0 for w in range(workers)]
        total_pushes = max(1, math.ceil(epochs * len(x) / self.b_ref))
        if max_pushes is not None:
            total_pushes = min(total_pushes, max_pushes)
        self.control = PushControl(push_loop(cfg, self.declared, total_pushes, range(workers)), cfg.control_interval,
                                   lambda live, batches=None: push_loop(cfg, self.declared, total_pushes, live,
                                                                        batches))
        self.max_pushes, self.keep_order, self.kill = max_pushes, keep_order, kill
        if run_dir is None and cfg.out is not None:
            run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg))
        self.evaluate, self.run_dir = evaluate, run_dir
        self.placed = Placed(strategy, build_model, make_optimizer, loss, x, y, workers)
        self.model, self.optimizer, self.version = self.placed.model, self.placed.optimizer, self.placed.version
        self.lr_at = lr_at
        self.lr0 = None if lr_at is not None else float(np.asarray(self.optimizer.learning_rate))
        self.dealer, self.coverage = IndexDealer(len(x), cfg.seed), Coverage(len(x))
        self.staleness, self.log = Staleness(workers), PushLog(workers)
        self.record = ASPLog(cfg, self.settings, total_pushes, run_dir)
        self.clock = TrainClock()
        self.decisions: list[tuple[int, tuple[int, ...]]] = []  # (version, batches) after each change
        self.applied = 0  # pushes applied (the chief is the only writer of ``version``)
        self.in_flight = 0
        self.evaluated_epoch = 0  # epochs of data evaluated after
        self.error: BaseException | None = None  # a worker thread's: the others stop, run() raises it
        self.watch = CallWatch(workers, cfg.heartbeat_s, cfg.timeout_s)  # calls in flight: which worker is hung
        self.changed = threading.Condition()  # the chief's lock; notified when a push ends (indices may be back)

    @property
    def batches(self) -> tuple[int, ...]:
        """Every worker's batch now (0 for a dropped one)."""
        return self.control.batches

    def run(self) -> dict:
        """Train until every sample of ``epochs`` epochs was applied, the time budget is spent or no worker is left;
        evaluate, write the record (``run_dir``) and return the chief's summary (:meth:`summary`)."""
        self.clock.start()
        self.record.speeds(0, self.declared)
        threads = [threading.Thread(target=self._serve, args=(w,), name=f"omnilearn-asp-worker-{w}", daemon=True)
                   for w in range(self.workers)]
        for t in threads:
            t.start()
        with self.changed:  # the watchdog: a call that does not come back in time drops its worker
            while any(t.is_alive() for w, t in enumerate(threads) if w not in self.watch.hung):
                self._watch()
                self.changed.wait(timeout=WATCH_S)
        if self.error is not None:
            raise self.error
        wall_s = self.clock.wall_s()
        train_s = wall_s - self.clock.paused_s
        if self.evaluate is not None:
            self.record.evaluation(self.dealer.epoch, self.applied, train_s, *self.evaluate(self.model))
        save = None if self.run_dir is None else (lambda d: save_weights(self.model, d / "model.weights.h5"))
        self.result = self.record.finish(wall_s, train_s, self.staleness, save, self.dealer.dealt,
                                         self.coverage.summary(), extra={"framework": "tensorflow",
                                                                         "pushes": list(self.log.pushes),
                                                                         "resent": list(self.log.resent)})
        return self.summary(wall_s)

    def _watch(self) -> None:
        """Under the lock: drop every worker whose call is late (:class:`CallWatch`) as a dead one is dropped: its
        samples are dealt again to the others, its thread is left (TensorFlow cannot cancel a call) and what it may
        still bring back is discarded. With no worker left the run stops: :class:`WorkerHung`."""
        cfg = self.cfg
        for worker, waited, epoch, indices in self.watch.late(time.perf_counter()):
            self._drop(worker, epoch, indices, f"no answer for {waited:.0f} s (hung; --heartbeat-s "
                                               f"{cfg.heartbeat_s:g}, a first call --timeout-s {cfg.timeout_s:g})")
        if self.watch.hung and not self.control.live and self.error is None:
            self.error = WorkerHung("every worker was dropped, the last as hung: "
                                    + "; ".join(f"worker {w}: {why}" for w, why in self.log.dropped.items()))

    def _spent(self) -> bool:
        """The training-time budget (``settings.max_time_s``) is spent."""
        budget_s = self.settings.max_time_s
        return budget_s is not None and self.clock.train_s() >= budget_s

    def _evaluate_after(self, epoch: int) -> None:
        """Under the lock: evaluate the weights once epoch ``epoch``'s data is all dealt; the clock stops meanwhile."""
        self.evaluated_epoch = epoch + 1
        if self.evaluate is None:
            return
        self.clock.pause()
        try:
            train_s = self.clock.train_s()
            self.record.evaluation(epoch, self.applied, train_s, *self.evaluate(self.model))
        finally:
            self.clock.resume()

    def _deal(self, worker: int) -> tuple[int, list[int]] | None:
        """The next indices for ``worker``; None once the last epoch is dealt and no push is in flight (one in
        flight may still fail and give its indices back: then they are dealt here)."""
        with self.changed:
            while True:
                if self.error is not None or self._spent():
                    self.changed.notify_all()
                    return None
                if self.max_pushes is not None and self.applied + self.in_flight >= self.max_pushes:
                    if self.in_flight == 0:
                        self.changed.notify_all()
                        return None
                    self.changed.wait()
                    continue
                epoch, indices = self.dealer.deal(self.control.batches[worker])
                if epoch > self.evaluated_epoch and epoch <= self.epochs:
                    self._evaluate_after(epoch - 1)
                if epoch < self.epochs:
                    self.in_flight += 1
                    return epoch, indices
                self.dealer.take_back(epoch, indices)  # past the last epoch: not dealt
                if self.in_flight == 0:
                    self.changed.notify_all()
                    return None
                self.changed.wait()

    def _serve(self, worker: int) -> None:
        """One worker's pushes (:meth:`_pushes`); an error stops the others and is kept for :meth:`run`."""
        try:
            self._pushes(worker)
        except BaseException as e:  # noqa: BLE001  (raised again by run(), in the caller's thread)
            with self.changed:
                if self.error is None:
                    self.error = e
                self.changed.notify_all()

    def _pushes(self, worker: int) -> None:
        """One worker's pushes, one after another, until nothing is left to deal or its server is gone."""
        x, y = self.placed.data[worker]
        while (dealt := self._deal(worker)) is not None:
            epoch, indices = dealt
            retried, resends = False, 0
            while True:
                began = time.perf_counter()
                self.watch.begin(worker, began, epoch, indices)  # watched by run() until it is back
                dealt_here = tf.constant(indices, dtype=tf.int32)  # on the chief: made on a stopped worker's
                try:  # device it would block holding the GIL, and no thread of the chief could run
                    with tf.device(worker_device(worker)):
                        loss, seen, flat, compute_s = self.placed.gradient(x, y, dealt_here)
                    loss, seen, flat, compute_s = float(loss), int(seen), flat.numpy(), float(compute_s)
                except tf.errors.OpError as e:
                    if self._abandoned(worker):
                        return
                    if resends < MAX_RESENDS and context.context().check_alive(worker_device(worker)):
                        resends += 1  # a peer's death failed this call too: send it again
                        self.log.resent[worker] += 1
                        continue
                    self._drop(worker, epoch, indices, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}")
                    return
                if self._abandoned(worker):
                    return
                if self.slowdown[worker] > 1.0:  # an emulated slower worker: its gradient arrives later, by the
                    time.sleep((self.slowdown[worker] - 1.0) * compute_s)  # extra time its compute takes
                if not np.isfinite(flat).all():
                    raise RuntimeError(f"worker {worker} pushed non-finite gradients (loss {loss:g}); lower --lr")
                push = SimpleNamespace(batch=len(indices), pulled_version=seen, cycle_s=time.perf_counter() - began,
                                       compute_s=compute_s, loss=loss)
                if self._push(worker, epoch, indices, push, flat, retried):
                    break
                retried = True  # refused as too stale: the same samples on fresh weights

    def _push(self, worker: int, epoch: int, indices: list[int], push: SimpleNamespace, flat: np.ndarray,
              retried: bool) -> bool:
        """Apply one push, or refuse it as too stale (False: the worker recomputes it). ``push``: its batch,
        pulled version, cycle and compute seconds and loss (what a PyTorch worker's request carries)."""
        kill = None
        with self.changed:
            if worker in self.watch.hung:  # dropped while this was computed: its samples were dealt again
                return True
            if self._spent():  # the budget ran out while it was computed: not applied, nothing more dealt
                self.dealer.take_back(epoch, indices)
                self.in_flight -= 1
                self.changed.notify_all()
                return True
            stale = self.staleness.of(worker, self.applied, push.pulled_version)
            if over_bound(stale, self.settings.max_staleness, retried):
                self.staleness.refused[worker] += 1
                self.record.refused(self.applied, worker, stale)
                return False
            scale = push_lr(1.0, push.batch, self.b_ref, stale, self.settings.lr_scaling, self.settings.staleness_lr)
            self.placed.apply(tf.constant(flat), tf.constant(scale, dtype=tf.float64))
            base = self.lr0 if self.lr_at is None else self.lr_at(self.applied)
            self.applied += 1
            self.watch.answered[worker] = True
            self.staleness.record(worker, self.applied - 1, push.pulled_version)
            self.coverage.add(epoch, indices)
            self.log.pushes[worker] += 1
            self.log.last_loss = push.loss
            self.record.push(self.applied, worker, push, stale, base * scale, self.clock.train_s(),
                             self.dealer.epochs_done, epoch)
            if self.keep_order:
                self.log.order.append((worker, epoch, list(indices), push.pulled_version, stale, retried))
            if self.control.record(worker, push.batch, push.cycle_s, self.slowdown[worker]):
                decision = self.control.decide(self.applied)
                self.record.decision(decision)
                if decision.changed:
                    self.decisions.append((self.applied, self.control.batches))
            self.in_flight -= 1
            self.changed.notify_all()
            if self.kill is not None and self.applied >= self.kill[0] and all(self.watch.answered):
                kill, self.kill = self.kill[1], None
        if kill is not None:
            kill()
        return True

    def _abandoned(self, worker: int) -> bool:
        """The worker's call came back (or failed): whether it was dropped as hung meanwhile (its thread ends)."""
        self.watch.back(worker)  # before the lock: an evaluation holding it does not make the call late
        with self.changed:
            return worker in self.watch.hung

    def _drop(self, worker: int, epoch: int, indices: list[int], why: str) -> None:
        with self.changed:
            self.dealer.take_back(epoch, indices)
            self.in_flight -= 1
            self.control.drop(worker)  # its share goes to the live others
            self.log.dropped[worker] = why
            self.record.drop(self.applied, worker, why, len(indices), self.control.live, self.control.batches, epoch)
            self.changed.notify_all()

    def summary(self, wall_s: float) -> dict:
        """The chief's own tally (tests read it; the run's record is ``summary.json``)."""
        return tally(self, wall_s)
