"""OmniLearn on TensorFlow: one worker's view of a balanced run on ``tf.distribute`` (the Python API).

    import keras, omnilearn.tf

    ol = omnilearn.tf.setup(global_batch=512, speeds="4,2,1")   # joins the cluster of TF_CONFIG (none: alone)
    with ol.scope():                                            # variables mirrored on every worker
        model = build_keras_model()
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    ol.wrap(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    loader = ol.data(x_train, y_train)                          # numpy arrays: this worker's b_i samples per step
    for epoch in range(ol.epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = ol.step(x, y)                                # timed compute, b_i/B-weighted SUM all-reduce
        ol.log_eval(*ol.evaluate(x_test, y_test), epoch=epoch)
    ol.finish()                                                 # summary on worker 0; the run directory if out=

A compiled Keras model trains with ``history = ol.fit(model, dataset,
epochs=..., callbacks=[...])`` instead (:mod:`omnilearn.tf.fit`); ``data()``
also takes a ``tf.data.Dataset`` of unbatched ``(x, y)`` examples
(:mod:`omnilearn.tf.data`).

The batches are the PyTorch runtime's: epoch ``e`` permutes the samples by
``(seed, e)`` and step ``s`` of it gives worker ``i`` its contiguous slice of
the step's ``B`` samples (:class:`~omnilearn.data.schedule.GlobalPlan`), so a
step's samples depend on neither the worker count nor the split. The step
(:mod:`omnilearn.tf.steps`) is one ``tf.function`` with a ``None`` batch
dimension: its gradient is this worker's mean-loss gradient times ``b_i / B``,
summed over the workers by the Keras optimizer's all-reduce, so the update
is the global batch's. The emulated speed (``speeds``, ``speed_schedule``)
sleeps inside the timed compute, before the all-reduce. Every
``control_interval`` steps (and every third of one, for a clear speed shift)
one SUM all-reduce of a small table gives every worker every worker's
timings, and the same :class:`~omnilearn.balance.loop.ControlLoop` as the
PyTorch runtime's (:mod:`omnilearn.decisions`) decides the next batches on
every worker alike; worker 0 writes the same ``metrics.jsonl`` and
``summary.json`` as the PyTorch runtime, and ``model.weights.h5``.

Checkpoints (:mod:`omnilearn.tf.checkpointing`): :meth:`TFSession.checkpoint_to`
(``setup(checkpoint_every=, resume=)``, ``omnilearn launch``'s flags, or a
``BackupAndRestore`` callback in ``fit``) saves the model, the optimizer
and the session at interval ends and at an agreed stop, and resumes from
the newest once :meth:`~TFSession.wrap` and :meth:`~TFSession.data` are done,
at the same worker count or another; ``range(ol.epoch, ol.epochs)``
continues the epochs.

This version is BSP only. Not here yet (a clear error where asked
for): ASP, gradient accumulation, ``max_batch="auto"``
and out-of-memory recovery, the OS throttles (``emulator`` cgroup, affinity,
docker). Configured ``max_batch`` caps hold (they bound the plan).

Why one file over 300 lines: ``TFSession`` is the TensorFlow runtime's public surface (its docstring is the
guide); the batches, steps, checkpoints and fit live beside it.

Run: ``python -m pytest -q tests/tf``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ContextManager

import numpy as np
import tensorflow as tf

from omnilearn.balance.loop import WINDOW_FIELDS
from omnilearn.config import AUTO, BalanceConfig, ConfigError, api_wording
from omnilearn.data.schedule import BatchSchedule, GlobalPlan
from omnilearn.decisions import (CHECK, HEADER, INTERVAL, MAX_STRETCH, check, check_every, checks_pay, feed,
                                 interval_step_s, make_loop, settled, stop_asked, summarise, table_row,
                                 window_steps)
from omnilearn.emulation.delay import DelayEmulator
from omnilearn.emulation.speeds import slowdown
from omnilearn.observe.recorder import ROW_FIELDS, Telemetry
from omnilearn.runplan import RunPlan, plan_run
from omnilearn.stopping import stop_requested
from omnilearn.tf import rescue
from omnilearn.tf.checkpointing import Checkpoints
from omnilearn.tf.cluster import Cluster
from omnilearn.tf.data import examples
from omnilearn.tf.fit import fit as fit_model
from omnilearn.tf.batches import WorkerBatches, refuse_model_fit, save_weights
from omnilearn.tf.steps import Gather, TrainStep
from omnilearn.tf.timing import StepClock
from omnilearn.clocks.train import TrainClock


def check_supported(cfg: BalanceConfig) -> None:
    """Raise ConfigError for a setting this runtime does not have yet (see the module docstring)."""
    if cfg.accumulation_steps != 1:
        raise ConfigError(f"accumulation_steps={cfg.accumulation_steps}: the TensorFlow runtime has no gradient "
                          "accumulation yet; use accumulation_steps=1 (or the PyTorch runtime)")
    if cfg.emulator not in ("delay", "none"):
        raise ConfigError(f"emulator={cfg.emulator!r}: the TensorFlow runtime emulates speeds by delay only; use "
                          "emulator='delay' (or 'none')")
    if cfg.max_batch == AUTO:
        raise ConfigError("max_batch='auto' probes CUDA memory in the PyTorch runtime only; give the TensorFlow "
                          "runtime a number per worker (or none)")
    if cfg.memory is not None:
        raise ConfigError("memory= plans caps from the bytes a PyTorch step holds, in the PyTorch runtime only; give "
                          "the TensorFlow runtime max_batch=<samples> per worker (or none)")


class TFSession:
    """One worker of a balanced TensorFlow run; see the module docstring."""

    def __init__(self, cfg: BalanceConfig, cluster: Cluster, strategy: tf.distribute.Strategy,
                 run_dir: Path | None = None, total_steps: int | None = None) -> None:
        check_supported(cfg)
        if cfg.workers != cluster.world_size:
            raise ConfigError(f"config has {cfg.workers} workers but TF_CONFIG's cluster has {cluster.world_size}")
        self.cfg, self.cluster, self.strategy = cfg, cluster, strategy
        self.run_dir, self.total_steps = run_dir, total_steps
        self.loop = make_loop(cfg, cluster.world_size, total_steps)
        self.schedule = BatchSchedule(self.loop.batches)
        self.timer = StepClock(single_thread=tf.config.threading.get_intra_op_parallelism_threads() == 1)
        self.emulator = DelayEmulator(self.timer)
        self.check_every = check_every(cfg.control_interval)
        self.checks_on = True  # whether the checks pay at the last interval's step time (decisions.checks_pay)
        self.window_steps = cfg.control_interval  # stretched where intervals are short (as PyTorch's session)
        self.intervals = 0  # interval ends read in this run (the stretch waits for decisions.WARMUP_INTERVALS)
        slots = cfg.control_interval * (MAX_STRETCH if cfg.min_window_s > 0 else 1)
        width = HEADER + WINDOW_FIELDS + 1 + slots * len(ROW_FIELDS)
        self.gather = Gather(strategy, cluster.rank, cluster.world_size, width)
        self.clock = TrainClock()
        self.train_step: TrainStep | None = None
        self.model = self.optimizer = None
        self.run: RunPlan | None = None
        self.plan: GlobalPlan | None = None
        self.telemetry: Telemetry | None = None
        self.rows: list[list[float]] = []  # this window's step rows (ROW_FIELDS)
        self.open_step: int | None = None
        self.steps_done = self.next_step = 0
        self.speeds_applied: tuple[float, ...] | None = None
        self.should_stop = False  # a stop signal reached some worker: every worker sees it after the same step
        self.checkpoints: Checkpoints | None = None
        self.resume = False  # load the newest checkpoint once wrap() and data() are done
        self.restarted = False  # this run continues one in its run directory (resume, a launcher's restart)
        self.rescued: str | None = None  # the line said once a peer was lost (omnilearn.tf.rescue)
        self.epoch_begun: int | None = None  # ol.fit: the epoch whose on_epoch_begin ran last (checkpointed)
        self.iterations_at: tuple[int, int] | None = None  # (steps done, optimizer.iterations) then: the rescue's mark

    rank = property(lambda self: self.cluster.rank)
    world_size = property(lambda self: self.cluster.world_size)
    is_main = property(lambda self: self.cluster.is_main)
    global_batch = property(lambda self: self.cfg.global_batch)

    @property
    def batches(self) -> tuple[int, ...]:
        """Every worker's batch for the next step, as planned so far."""
        return self.schedule.peek(self.next_step)

    @property
    def epochs(self) -> int:
        """The epochs of a run bounded by ``total_steps`` (after :meth:`data`)."""
        if self.run is None:
            raise RuntimeError("epochs is known once data() has planned the run")
        return self.run.epochs

    @property
    def epoch(self) -> int:
        """The epoch of the next step (after a resume, the one to continue): ``for e in range(ol.epoch, ol.epochs)``."""
        if self.run is None:
            raise RuntimeError("epoch is known once data() has planned the run")
        return self.next_step // self.run.steps_per_epoch

    def checkpoint_to(self, directory: str | Path, every: int = 0, keep: int = 3, resume: bool = False) -> None:
        """Checkpoint into ``directory`` every ``every`` steps (at the next interval end; 0: only at an agreed stop),
        keeping ``keep``; ``resume``: first load the newest there (none: start at step 0). Every worker calls it,
        before :meth:`wrap` and :meth:`data` (see :mod:`omnilearn.tf.checkpointing`)."""
        if self.steps_done or self.next_step:
            raise RuntimeError("checkpoint_to() after training started: call it before the first step")
        self.checkpoints, self.resume = Checkpoints(self, directory, every, keep), resume
        self.restarted = self.restarted or resume
        self._maybe_restore()

    def _maybe_restore(self) -> None:
        """Once the model, the optimizer and the plan exist: the newest checkpoint, if a resume was asked for."""
        if self.resume and self.checkpoints is not None and self.train_step is not None and self.plan is not None:
            self.resume = False
            if not self.checkpoints.restore() and self.restarted and self.telemetry is not None:
                self.telemetry.resume({}, 0, self.world_size)  # none saved yet: start over, voiding earlier records

    def scope(self) -> ContextManager:
        """``with ol.scope():`` build the model and optimizer here (their variables are mirrored)."""
        return self.strategy.scope()

    def wrap(self, model, optimizer, loss, step: type[TrainStep] = TrainStep, *,
             model_losses: bool | None = None) -> None:
        """Compile the weighted step for ``model`` (built in :meth:`scope`) with ``optimizer`` and ``loss``.

        ``model_losses``: add ``model.losses`` (``add_loss``, regularisers) to the loss (True), or leave them to
        ``loss`` (False); unset, a model that has some is refused at its first step (:mod:`omnilearn.tf.steps`).
        ``step``: the step's class (:mod:`omnilearn.tf.fit` passes one that also carries the metrics).
        """
        if self.train_step is not None:
            raise RuntimeError("wrap() was already called: one model per session")
        if model_losses not in (None, True, False):
            raise ConfigError(f"ol.wrap(model_losses={model_losses!r}): give True (OmniLearn adds model.losses) or "
                              "False (your loss callable adds them)")
        self.model, self.optimizer = model, optimizer
        chosen = {} if model_losses is None else {"model_losses": model_losses}  # ol.fit's step adds them itself
        self.train_step = step(self.strategy, model, optimizer, loss, self._local_grads_ready, **chosen)
        model.fit = refuse_model_fit  # Keras' own fit fails under this strategy (PerReplica); say what to call
        self._maybe_restore()

    def set_total_steps(self, total_steps: int) -> None:
        """Bound the run at ``total_steps`` before :meth:`data` plans it (``fit`` sets epochs x steps per epoch)."""
        if self.plan is not None:
            raise RuntimeError("the run's length is fixed once data() has planned it")
        self.total_steps = total_steps
        self.loop = make_loop(self.cfg, self.cluster.world_size, total_steps)
        self.schedule = BatchSchedule(self.loop.batches)

    def data(self, x, y: np.ndarray | None = None) -> "WorkerBatches":
        """This worker's share of every global batch of ``(x, y)`` (arrays of the same length, on every worker).

        Or ``data(dataset)``: a ``tf.data.Dataset`` of unbatched ``(x, y)`` examples, read once into arrays
        (:mod:`omnilearn.tf.data`).
        """
        if self.plan is not None:
            raise RuntimeError("data() was already called: one training data source per session")
        if isinstance(x, tf.data.Dataset) or y is None:
            if y is not None:
                raise ConfigError("data(dataset, y): a dataset holds its labels; pass data(dataset) alone")
            x, y = examples(x)
        if len(x) != len(y):
            raise ConfigError(f"data(x, y): x has {len(x)} samples but y has {len(y)}; give one label per sample")
        try:
            self.run = plan_run(self.cfg, len(x), self.total_steps, 0, warn=self.is_main)
        except ConfigError as e:
            raise ConfigError(api_wording(str(e))) from None
        self.plan = GlobalPlan(len(x), self.cfg.global_batch, self.cfg.seed)
        if self.is_main:
            self.telemetry = Telemetry(self.cfg, self.run, self.run_dir)
        batches = WorkerBatches(self, x, y)
        self._maybe_restore()
        return batches

    def fit(self, model, x, y=None, **keras_fit: Any):
        """``model.fit`` on balanced workers: a compiled model, callbacks, a ``History`` (:mod:`omnilearn.tf.fit`)."""
        return fit_model(self, model, x, y, **keras_fit)

    def begin(self, step: int) -> None:
        """``step``'s batch is handed out: its clock starts, under the speeds in force (the loader calls it)."""
        self.clock.start()
        self.open_step = step
        speeds = self.run.speeds.at(step)
        if speeds != self.speeds_applied:
            self.speeds_applied = speeds
            if self.telemetry is not None:
                self.telemetry.speeds(step, speeds)
        self.emulator.set_slowdown(slowdown(speeds, self.rank) if self.cfg.emulator == "delay" else 1.0)
        self.timer.begin()

    def _local_grads_ready(self) -> None:
        """Inside the step, after the gradients, before the all-reduce: a slower machine is emulated here."""
        self.emulator.before_sync()
        self.timer.mark_ready()

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        """Train on this worker's batch of the open step (the one the loader handed out); its mean loss."""
        if self.open_step is None or self.train_step is None:
            raise RuntimeError("step(x, y) needs wrap() first and a batch the loader from data() handed out")
        step, batch = self.open_step, self.schedule.at(self.open_step)[self.rank]
        if len(x) != batch:
            raise ValueError(f"step() got {len(x)} samples but this worker's batch at step {step} is {batch}; "
                             "pass the batch the loader handed out")
        if self.iterations_at is None:
            self.iterations_at = rescue.iterations_mark(self)
        try:
            loss = self.train_step(x, y, batch / self.cfg.global_batch)
        except Exception as e:  # a lost peer: this worker saves the step before (omnilearn.tf.rescue)
            rescue.lost(self, e)
            raise
        times = self.timer.end()
        self.rows.append([step, batch, times.compute_s, times.wait_s, times.step_s, loss, times.delay_s,
                          self.learning_rate()])
        self.open_step, self.steps_done, self.next_step = None, self.steps_done + 1, step + 1
        size = len(self.rows)
        interval = size >= self.window_steps or step + 1 == self.run.total_steps or \
            (size % self.cfg.control_interval == 0 and self.checkpoints is not None and self.checkpoints.due())
        try:
            if interval:
                self._end_window(step, INTERVAL)
            elif self.check_every and self.checks_on and size % self.check_every == 0:
                self._end_window(step, CHECK)
        except Exception as e:  # the step is counted: a lost peer's survivor saves it
            rescue.lost(self, e)
            raise
        self.clock.step_ended()
        if interval and self.checkpoints is not None and self.checkpoints.due():
            with self.paused():
                self.checkpoints.save()
        return loss

    def learning_rate(self) -> float:
        """The optimizer's rate now (a schedule's value at this step; a mirrored variable read locally)."""
        rate = getattr(self.optimizer, "learning_rate", None)
        if rate is None:
            return float("nan")
        return float(tf.convert_to_tensor(getattr(rate, "value", rate)).numpy())

    def _end_window(self, step: int, kind: int) -> None:
        """One gather of every worker's timings (and rows); the loop decides; worker 0 records the window."""
        window = self.rows if kind == INTERVAL else self.rows[-self.check_every:]
        mine, step_s = summarise(self.loop, self.rank, window)
        stop = kind == INTERVAL and stop_requested()
        flat = [v for row in self.rows for v in row]
        row = table_row(kind, self.steps_done, self.schedule.last_read, mine, stop, None, step_s, reset=False, plan=0)
        table = self.gather([*row, len(self.rows), *flat])
        where = {(int(r[0]), int(r[1])) for r in table}
        if len(where) > 1:
            raise RuntimeError(f"workers are out of step at step {step}: {sorted(where)} (kind, steps done); call "
                               "step() on every worker for every batch the loader hands out")
        head = table[:, : HEADER + WINDOW_FIELDS].tolist()
        at = step + 1  # decided as PyTorch's session decides (it reads a meeting a step later): the same decisions
        if kind == INTERVAL:
            decision = feed(self.loop, self.schedule, at, head, read_ahead=1)
            self.should_stop = self.should_stop or stop_asked(head)
            step_s = interval_step_s(head)  # as PyTorch's session
            self.checks_on = checks_pay(step_s, self.check_every)
            self.intervals += 1
            self.window_steps = window_steps(step_s, self.cfg.control_interval, self.cfg.min_window_s,
                                             settled(decision, self.intervals))
        else:
            decision = check(self.loop, self.schedule, at, head, read_ahead=1)
            if decision is None:
                return
        self.rows = []
        if kind == INTERVAL:
            self.iterations_at = rescue.iterations_mark(self)
        if self.telemetry is not None:
            start, fields = HEADER + WINDOW_FIELDS + 1, len(ROW_FIELDS)
            rows = [np.asarray(r[start : start + int(r[start - 1]) * fields]).reshape(-1, fields).tolist()
                    for r in table]
            effective = decision.effective_step
            self.telemetry.interval(rows, decision, at + 1 + self.run.lag if effective is None else effective)

    def evaluate(self, x: np.ndarray, y: np.ndarray, batch_size: int = 1024) -> tuple[float, float | None]:
        """Mean loss and accuracy (classifiers: integer labels, one score per class) of the model on ``(x, y)``.

        Local: every worker holds the same weights and gets the same numbers; no collective.
        """
        if self.train_step is None:
            raise RuntimeError("evaluate() needs the model: call wrap() first")
        loss_fn, total, correct, classifier = self.train_step.loss, 0.0, 0, np.issubdtype(y.dtype, np.integer)
        for lo in range(0, len(x), batch_size):
            out = self.model(x[lo : lo + batch_size], training=False)
            total += float(tf.reduce_sum(loss_fn(y[lo : lo + batch_size], out)))
            classifier = classifier and len(out.shape) == 2
            if classifier:
                correct += int(np.sum(np.argmax(out.numpy(), axis=1) == y[lo : lo + batch_size]))
        return total / len(x), (correct / len(x) if classifier else None)

    def paused(self) -> ContextManager[None]:
        """``with ol.paused():`` time inside (evaluation) is left out of the training time."""
        return self.clock.paused()

    def log_eval(self, loss: float, accuracy: float | None = None, epoch: int | None = None) -> None:
        """Record a test evaluation (worker 0 writes it; call on every worker with the same numbers)."""
        if self.telemetry is not None:
            self.telemetry.evaluation(epoch, self.next_step, self.clock.train_s(), loss, accuracy)

    def finish(self) -> dict[str, Any] | None:
        """Flush the last window; worker 0 writes ``model.weights.h5`` and the summary (its dict; None elsewhere)."""
        if self.rows:
            self._end_window(int(self.rows[-1][0]), INTERVAL)
        if self.telemetry is None or not self.telemetry.steps_recorded:
            return None
        save = None if self.model is None else (lambda run_dir: save_weights(self.model, run_dir / "model.weights.h5"))
        return self.telemetry.finish(self.clock.wall_s(), self.clock.train_s(), save)
