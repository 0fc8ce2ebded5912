"""``ol.fit(model, data, epochs=..., callbacks=[...])``: a compiled Keras model trained on balanced workers, as ``model.fit`` trains it.

    ol = omnilearn.tf.setup(global_batch=256)            # instead of strategy = MultiWorkerMirroredStrategy()
    with ol.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = ol.fit(model, dataset, epochs=3, validation_data=(x_val, y_val),
                     callbacks=[keras.callbacks.EarlyStopping(patience=2), keras.callbacks.CSVLogger("log.csv")])

Why not ``model.fit`` itself: Keras' ``fit`` owns the data (it distributes
a dataset with one fixed batch per replica; OmniLearn's per-worker batch
changes every control interval) and, in Keras 3 under
``MultiWorkerMirroredStrategy`` on TF 2.21, fails with two workers (the
``PerReplica`` conversion error). So this module drives Keras' own
``CallbackList`` (with ``History`` and, on worker 0 only, the progress bar)
around OmniLearn's weighted step (:class:`~omnilearn.tf.reduced.FitStep`:
the session's :class:`~omnilearn.tf.steps.TrainStep` that also carries the
metrics and adds ``model.losses``), with the hooks, ``params`` and ``logs``
``model.fit`` gives: callbacks see what they see under ``model.fit``.

Logs. Each worker updates the loss (a ``Mean`` weighted by its ``b_i``)
and the compiled metrics on its own samples, inside the step's graph; the
table of every worker's metric states (totals and counts, one row each)
rides on the step's gradient all-reduce (:mod:`omnilearn.tf.reduced`), so
a step launches no collective of its own for the metrics, and their float64
sum gives every worker the global batch's values: the metrics are reduced
with the weights ``b_i`` and every worker gets the same logs. So every
worker's callbacks take the same decisions (``EarlyStopping``, ``ReduceLROnPlateau``,
``LearningRateScheduler``: run on every worker); the writers
(``ModelCheckpoint``, ``CSVLogger``, ``TensorBoard``, ``ProgbarLogger``,
``RemoteMonitor``) run on worker 0 only. Metrics must keep additive states
(sums and counts: Keras' means, accuracies, confusion-matrix metrics).
Validation is sharded: worker ``i`` evaluates a contiguous share of the
validation set in proportion to its batch, and the same reduction (one
gather, once per validation) gives ``val_*``.

Surviving failures: a ``keras.callbacks.BackupAndRestore(backup_dir,
save_freq=)`` in ``callbacks`` is done by OmniLearn's checkpoints
(:mod:`omnilearn.tf.checkpointing`: model, optimizer and the session, so the
split and the data position carry on): saved every ``save_freq`` steps or
each epoch (at the next control-interval end) and at an agreed stop, loaded
at the start of ``fit`` if there is one (another worker count too), the
fit then continues at that step of that epoch; removed when ``fit`` ends
unless ``delete_checkpoint=False``, as Keras does. The resumed epoch's
logs cover its steps after the checkpoint; callbacks' own state (the
patience of ``EarlyStopping``...) starts afresh, as under Keras.

Refused by name (one line): ``batch_size``
(the global batch is ``setup(global_batch=)``), ``validation_split``,
``shuffle=False``, ``class_weight``, ``sample_weight``, ``initial_epoch``,
``validation_steps``, multi-output losses, ``steps_per_execution``, models
with metrics other than the compiled ones, and ``fit`` inside ``ol.scope()``.

Run: ``python -m pytest -q tests/tf/test_tf_fit.py``
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import shutil
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from omnilearn.config import ConfigError
from omnilearn.tf.data import examples
from omnilearn.tf.reduced import MULTI_OUTPUT_ROUTE, FitStep, Reduced

WORKER_0_ONLY = (keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger, keras.callbacks.TensorBoard,
                 keras.callbacks.ProgbarLogger, keras.callbacks.RemoteMonitor)
REFUSED_CALLBACKS: dict[type, str] = {}
REFUSED_ARGS = {
    "batch_size": "the global batch is omnilearn.tf.setup(global_batch=...), cut per worker by speed",
    "validation_split": "pass validation_data=(x_val, y_val) (or a dataset)",
    "class_weight": "weight the loss yourself",
    "sample_weight": "weight the loss yourself",
    "initial_epoch": "a resumed fit starts where its checkpoint ends (BackupAndRestore); leave it out",
    "validation_steps": "the whole validation set is evaluated, sharded across workers; leave it out",
    "shuffle": "the global permutation is seeded by setup(seed=...) and always on; leave it out",
}


def fit(session, model: keras.Model, x, y=None, *, epochs: int = 1, verbose: str | int = "auto",
        callbacks: list | None = None, validation_data=None, steps_per_epoch: int | None = None,
        validation_batch_size: int | None = None, validation_freq: int = 1,
        **keras_only: Any) -> keras.callbacks.History:
    """Train the compiled ``model`` on ``x`` (a ``tf.data.Dataset`` of examples, or an array with ``y``)."""
    refuse_args(keras_only)
    if tf.distribute.has_strategy():
        raise ConfigError("ol.fit() inside `with ol.scope():`; build and compile the model there, then call fit "
                          "outside it")
    loss = compiled_loss(model)
    if session.train_step is not None or session.plan is not None:
        raise ConfigError("ol.fit() wraps the model and reads the data itself: call it instead of ol.wrap() and "
                          "ol.data(), once per session")
    if isinstance(x, tf.data.Dataset):
        if y is not None:
            raise ConfigError("fit(dataset, y): a dataset holds its labels; pass fit(model, dataset)")
        x, y = examples(x)
    elif y is None:
        raise ConfigError("fit(model, x): give the labels too, fit(model, x, y), or a dataset of (x, y) examples")
    per_pass = len(x) // session.global_batch
    steps_per_epoch = steps_per_epoch or per_pass
    if type(validation_freq) is not int or validation_freq < 1:
        raise ConfigError(f"fit(validation_freq={validation_freq!r}): give a whole number of epochs, 1 or more")
    if per_pass < 1 or steps_per_epoch < 1 or epochs < 1:
        raise ConfigError(f"fit(epochs={epochs}, steps_per_epoch={steps_per_epoch}) over {len(x)} samples at "
                          f"global batch {session.global_batch}: give at least one step and one epoch")
    total = epochs * steps_per_epoch
    if session.total_steps is not None and session.total_steps != total:
        raise ConfigError(f"setup(total_steps={session.total_steps}) but fit runs epochs x steps_per_epoch = "
                          f"{total}; leave total_steps out of setup() (fit sets the run's length)")
    validation = validation_arrays(validation_data)
    verbose = (1 if verbose == "auto" else verbose) if session.is_main else 0
    backup = backup_and_restore(session, callbacks, steps_per_epoch)
    callbacks = [c for c in callbacks or [] if c is not backup]
    hooks = callback_list(session, model, callbacks, verbose=verbose, epochs=epochs, steps=steps_per_epoch)
    if verbose and not session.cfg.quiet:  # Keras' progress bar replaces OmniLearn's live lines: one summary line
        session.cfg = dataclasses.replace(session.cfg, quiet=True)
    session.set_total_steps(total)
    loader = session.data(x, y)
    metrics = Reduced(session, getattr(model, "_compile_metrics", None))
    session.wrap(model, model.optimizer, loss, step=functools.partial(FitStep, metrics=metrics))
    history = next(c for c in hooks.callbacks if isinstance(c, keras.callbacks.History))
    batches = itertools.chain.from_iterable(loader for _ in itertools.count())  # each pass: the next data epoch
    model.stop_training = False
    hooks.on_train_begin()
    logs: dict[str, float] = {}
    first = session.next_step  # after a resume: the checkpoint's step
    kept = began_rate(session, model.optimizer, first, steps_per_epoch)
    for epoch in range(first // steps_per_epoch, epochs):
        metrics.reset()
        hooks.on_epoch_begin(epoch)
        session.epoch_begun = epoch
        if kept is not None:  # the epoch began before the checkpoint: its callbacks' rate is in it already
            model.optimizer.learning_rate.assign(kept)
            kept = None
        for batch in range(first % steps_per_epoch if epoch == first // steps_per_epoch else 0, steps_per_epoch):
            hooks.on_train_batch_begin(batch)
            xb, yb = next(batches)
            session.step(xb, yb)  # the metrics updated and reduced in the step (one collective)
            logs = metrics.results_of(session.train_step.table)
            hooks.on_train_batch_end(batch, logs)
            if model.stop_training or session.should_stop:
                break
        if validation is not None and (epoch + 1) % validation_freq == 0:
            with session.paused():
                logs = {**logs, **evaluate(session, metrics, *validation, validation_batch_size)}
            accuracy = next((v for k, v in logs.items() if k.startswith("val_") and k.endswith("accuracy")), None)
            session.log_eval(logs["val_loss"], accuracy, epoch)
        hooks.on_epoch_end(epoch, logs)
        if model.stop_training or session.should_stop:
            break
    hooks.on_train_end(logs)
    session.finish()
    if backup is not None and backup.delete_checkpoint and not session.should_stop and session.is_main:
        shutil.rmtree(session.checkpoints.directory, ignore_errors=True)  # done: Keras deletes its backup too
    return history


def began_rate(session, optimizer, first: int, steps_per_epoch: int):
    """The optimizer's learning rate as the checkpoint holds it, when the fit resumes at step ``first`` of an epoch
    that had begun before the checkpoint was saved (a resume inside an epoch, or a survivor's save at its first
    step); else None. The resumed fit calls the epoch's ``on_epoch_begin`` again (its callbacks need it), and a
    callback that sets the rate from the current one (``LearningRateScheduler(lambda epoch, lr: lr * 0.8)``)
    would apply itself twice: 5e-2 off the uninterrupted weights, measured. The rate is put back after it."""
    epoch, begun = first // steps_per_epoch, session.epoch_begun
    if begun is None and first % steps_per_epoch:  # a state from before epoch_begun was saved: inside an epoch
        begun = epoch
    rate = getattr(optimizer, "learning_rate", None)
    if not first or begun != epoch or not hasattr(rate, "assign"):
        return None
    return rate.numpy()


def backup_and_restore(session, callbacks: list | None, steps_per_epoch: int):
    """The ``BackupAndRestore`` among ``callbacks``, made OmniLearn's checkpointing of this session (None: none)."""
    backups = [c for c in callbacks or [] if isinstance(c, keras.callbacks.BackupAndRestore)]
    if not backups:
        return None
    if len(backups) > 1 or session.checkpoints is not None and session.checkpoints.every:
        raise ConfigError("fit(callbacks=[BackupAndRestore]) and another checkpointing of this session "
                          f"({'a second BackupAndRestore' if len(backups) > 1 else 'setup(checkpoint_every=/resume=) or omnilearn launch --checkpoint-every'}); "
                          "keep one")
    backup = backups[0]
    freq = backup.save_freq
    if freq is not False and freq != "epoch" and (type(freq) is not int or freq < 1):
        raise ConfigError(f"BackupAndRestore(save_freq={freq!r}): give 'epoch', a number of steps or False")
    every = steps_per_epoch if freq == "epoch" else 0 if freq is False else freq
    restarted = session.restarted  # a launcher's restart without its own checkpoints: the backup is the resume
    session.checkpoint_to(backup.backup_dir, every, keep=2 if backup.double_checkpoint else 1, resume=True)
    session.restarted = restarted
    return backup


def refuse_args(given: dict[str, Any]) -> None:
    for name, value in given.items():
        if name == "initial_epoch" and value == 0 or name == "shuffle" and value is True:
            continue
        why = REFUSED_ARGS.get(name)
        raise ConfigError(f"fit({name}={value!r}): {why}" if why else
                          f"fit() got an unknown keyword {name}={value!r}; see omnilearn.tf.fit for what it takes")


def compiled_loss(model: keras.Model) -> Callable:
    """The loss ``model.compile`` was given, as a callable (refusing what OmniLearn's step cannot weight)."""
    if not getattr(model, "compiled", False) or getattr(model, "loss", None) is None or model.optimizer is None:
        raise ConfigError("ol.fit(model): compile it first, in ol.scope(): model.compile(optimizer=..., loss=...)")
    if isinstance(model.loss, (list, tuple, dict)):
        raise ConfigError(f"ol.fit(model): a loss per output ({len(model.loss)} given to model.compile) is not "
                          f"supported by ol.fit yet; {MULTI_OUTPUT_ROUTE}")
    outputs = getattr(model, "outputs", None)  # a functional or built Sequential model's
    if outputs is not None and len(outputs) > 1:
        raise ConfigError(f"ol.fit(model): the model has {len(outputs)} outputs and model.compile one loss, which "
                          f"Keras applies per output (one label each, the losses summed); {MULTI_OUTPUT_ROUTE}")
    if getattr(model, "steps_per_execution", 1) != 1:
        raise ConfigError(f"model.compile(steps_per_execution={model.steps_per_execution}): ol.fit runs one step "
                          "per call; leave it at 1")
    known = {id(getattr(model, "_loss_tracker", None)), id(getattr(model, "_compile_metrics", None))}
    other = [m.name for m in model.metrics if id(m) not in known]
    if other:
        raise ConfigError(f"ol.fit(model): metrics outside compile() ({', '.join(other)}) are not reduced across "
                          "workers; pass them to model.compile(metrics=[...])")
    return keras.losses.get(model.loss) if isinstance(model.loss, str) else model.loss


def validation_arrays(data) -> tuple[np.ndarray, np.ndarray] | None:
    """``validation_data`` as two arrays: ``(x_val, y_val)``, or a dataset of examples (read once)."""
    if data is None:
        return None
    if isinstance(data, tf.data.Dataset):
        return examples(data)
    if isinstance(data, (tuple, list)) and len(data) == 2 and len(data[0]) == len(data[1]):
        return np.asarray(data[0]), np.asarray(data[1])
    raise ConfigError(f"fit(validation_data={type(data).__name__}): give (x_val, y_val) of the same length, or a "
                      "tf.data.Dataset of (x, y) examples (no sample weights)")


def callback_list(session, model, callbacks: list | None, **params: Any) -> keras.callbacks.CallbackList:
    """Keras' own list (``History``; the progress bar if ``verbose``): writers on worker 0 only; refusals by name."""
    kept = []
    for c in callbacks or []:
        refused = next((why for kind, why in REFUSED_CALLBACKS.items() if isinstance(c, kind)), None)
        if refused:
            raise ConfigError(f"fit(callbacks=[{type(c).__name__}]): {refused}")
        if session.is_main or not isinstance(c, WORKER_0_ONLY):
            kept.append(c)
    return keras.callbacks.CallbackList(kept, add_history=True, add_progbar=params["verbose"] != 0, model=model,
                                        **params)


def shares(count: int, batches: tuple[int, ...]) -> list[int]:
    """``count`` cut in proportion to ``batches`` (largest remainder): worker i's share of the validation set."""
    total = sum(batches)
    exact = [count * b / total for b in batches]
    cut = [int(e) for e in exact]
    for i in sorted(range(len(cut)), key=lambda i: cut[i] - exact[i])[: count - sum(cut)]:
        cut[i] += 1
    return cut


def evaluate(session, metrics: Reduced, x: np.ndarray, y: np.ndarray, batch_size: int | None) -> dict[str, float]:
    """``val_*`` logs: this worker's share of ``(x, y)`` evaluated locally, the states reduced across workers."""
    cut = shares(len(x), session.batches)
    lo = sum(cut[: session.rank])
    hi, size = lo + cut[session.rank], batch_size or session.global_batch
    metrics.reset()
    for start in range(lo, hi, size):
        xb, yb = x[start : min(hi, start + size)], y[start : min(hi, start + size)]
        pred = session.model(xb, training=False)
        metrics.update(yb, pred, session.train_step.loss(yb, pred))
    logs = metrics.results("val_")
    metrics.reset()
    return logs
