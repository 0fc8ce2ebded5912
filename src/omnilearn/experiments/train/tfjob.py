"""``omnilearn train --framework tensorflow``'s worker: the default job as Keras on :mod:`omnilearn.tf`.

One process per worker, started by :mod:`omnilearn.experiments.launch.tfworkers`
(or by hand on each machine with its own ``TF_CONFIG``)::

    python -m omnilearn.experiments.train.tfjob RUN_DIR     # reads RUN_DIR/config.toml; worker 0 writes the run

The workload is the PyTorch job's, rebuilt in Keras: MNIST-1D (the same
normalised arrays, :mod:`omnilearn.experiments.datasets.mnist1d`), the same
1-D CNN (``cnn1d``: convolutions of 64 channels, kernel 5 then 3 at stride
2 twice, a dense head) or MLP, SGD with momentum (or AdamW), a cosine,
multistep or constant rate per step, one evaluation over the test split per
epoch. The loop is what any user of :mod:`omnilearn.tf.session` writes.
SIGTERM/SIGINT stop every worker after the same step (the next control
interval's end) after a checkpoint; ``--checkpoint-every`` saves one every
N steps into ``RUN_DIR/checkpoints`` and ``--resume`` (or a restart of the
launcher's) loads the newest (:mod:`omnilearn.tf.checkpointing`).
``OMNILEARN_FAULT_KILL_AT=<rank>:<step>`` (tests) kills a worker there,
``OMNILEARN_FAULT_HANG_AT`` stops it (:mod:`omnilearn.experiments.train.faultinject`).
Nothing here imports torch.

Exit status: 0 done, 2 a setting this runtime refuses (one ``omnilearn:
error:`` line), 128 + the signal when stopped, 1 anything else (its last
line says what, after the traceback).

Run: ``python -m pytest -q tests/tf``
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

from omnilearn.config import ConfigError
from omnilearn.experiments.train import faultinject
from omnilearn.experiments.config import TrainConfig, build, load_toml, normalise_keys
from omnilearn.experiments.datasets.mnist1d import mnist1d_arrays
from omnilearn.observe.console import startup, took
from omnilearn.stopping import Stopped, install_handlers, reason, signal_number
from omnilearn.tomlfile import loads

JOB_CONFIG_ENV = "OMNILEARN_TFJOB_CONFIG"  # the launcher's settings for this attempt (TOML)


def total_steps(cfg: TrainConfig, samples: int) -> int:
    """``--epochs`` of ``samples``, or ``--max-steps`` if fewer (the PyTorch job's rule)."""
    spe = max(1, samples // cfg.global_batch)
    return spe * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, spe * cfg.epochs)


def build_model(cfg: TrainConfig, length: int, classes: int):
    """The Keras twin of the PyTorch zoo's ``cnn1d`` / ``mlp`` (same layers, same parameter count)."""
    import keras

    layers = keras.layers
    if cfg.model == "mlp":
        body = [layers.Flatten(), layers.Dense(256, activation="relu")]
    else:
        body = [layers.Reshape((length, 1)), layers.Conv1D(64, 5, padding="same", activation="relu"),
                layers.Conv1D(64, 3, strides=2, padding="same", activation="relu"),
                layers.Conv1D(64, 3, strides=2, padding="same", activation="relu"), layers.Flatten()]
    return keras.Sequential([keras.Input((length,)), *body, layers.Dense(classes)], name=cfg.model)


def learning_rate(cfg: TrainConfig, steps: int, steps_per_epoch: int):
    """The rate per step: a Keras schedule (cosine over the run, multistep in epochs) or the constant."""
    import keras

    if cfg.lr_schedule == "cosine":
        return keras.optimizers.schedules.CosineDecay(cfg.lr, decay_steps=steps)
    if cfg.lr_schedule == "multistep":
        bounds = [e * steps_per_epoch for e in cfg.milestone_epochs]
        return keras.optimizers.schedules.PiecewiseConstantDecay(
            bounds, [cfg.lr * cfg.gamma**k for k in range(len(bounds) + 1)])
    return cfg.lr


def make_optimizer(cfg: TrainConfig, steps: int, steps_per_epoch: int):
    """SGD with momentum or AdamW at :func:`learning_rate`."""
    import keras

    rate = learning_rate(cfg, steps, steps_per_epoch)
    if cfg.optimizer == "adamw":
        return keras.optimizers.AdamW(rate, weight_decay=cfg.weight_decay)
    return keras.optimizers.SGD(rate, momentum=cfg.momentum)


def train(cfg: TrainConfig, run_dir: Path) -> dict | None:
    import keras

    import omnilearn.tf as oltf
    from omnilearn.tf.api import check_versions
    from omnilearn.tf.cluster import from_env, make_strategy

    check_versions()
    start = time.perf_counter()
    cluster = from_env()
    strategy = make_strategy(cluster, cfg.timeout_s)
    say = (lambda text: startup(text, cfg.quiet)) if cluster.is_main else (lambda text: None)
    say(f"worker 0: TensorFlow cluster of {cluster.world_size} joined in {took(time.perf_counter() - start)}")
    arrays, _ = mnist1d_arrays()
    x, y = arrays["x"], arrays["y"]
    steps = total_steps(cfg, len(x))
    session = oltf.TFSession(cfg, cluster, strategy, run_dir if cluster.is_main else None, steps)
    if cfg.checkpoint_every or cfg.resume:
        if run_dir is None and cfg.out is None:
            raise ConfigError("checkpoints go to the run directory: give every worker the same --out (storage "
                              "they all see), or --checkpoint-every 0")
        where = Path(cfg.out) if run_dir is None else run_dir
        session.checkpoint_to(where / "checkpoints", cfg.checkpoint_every, cfg.keep_checkpoints, cfg.resume)
    keras.utils.set_random_seed(cfg.seed)  # the same initial weights on every worker
    with session.scope():
        model = build_model(cfg, x.shape[1], 10)
        optimizer = make_optimizer(cfg, steps, max(1, len(x) // cfg.global_batch))
    session.wrap(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    loader = session.data(x, y)
    verb = f"resumes at step {session.next_step} of" if session.next_step else "starts:"
    say(f"training {verb} {steps} steps, {session.run.steps_per_epoch} per epoch; a progress line every "
        f"{cfg.control_interval} steps (the control interval)")
    kill_at = faultinject.kill_step(cluster.rank) if not cfg.resume else None
    hang_at = faultinject.hang_step(cluster.rank) if not cfg.resume else None
    for epoch in range(session.epoch, session.epochs):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            session.step(xb, yb)
            if kill_at is not None and session.next_step >= kill_at:
                faultinject.die()
            if hang_at is not None and session.next_step >= hang_at:
                faultinject.freeze()
            if session.should_stop and not session.rows:
                saved = "after a checkpoint; continue with --resume" if session.checkpoints else "(no checkpoint)"
                raise Stopped(f"{reason() or 'a stop signal'}: stopped at step {session.next_step} {saved}")
        with session.paused():
            loss, accuracy = session.evaluate(arrays["x_test"], arrays["y_test"])
        session.log_eval(loss, accuracy, epoch)
    return session.finish()


def job_settings(run_dir: Path) -> dict:
    """This attempt's settings from the launcher (another ``--workers`` on a resume), else the run's config.toml."""
    text = os.environ.get(JOB_CONFIG_ENV)
    if not text:
        return load_toml(str(run_dir / "config.toml"))
    doc = loads(text)
    return normalise_keys(doc.get("train", doc), JOB_CONFIG_ENV)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m omnilearn.experiments.train.tfjob RUN_DIR", file=sys.stderr)
        return 2
    install_handlers()
    run_dir = Path(args[0])
    rank = "?"
    try:
        from omnilearn.tf.cluster import from_env

        rank = str(from_env().rank)
        cfg = build(job_settings(run_dir), {})
        train(cfg, run_dir)
        return 0
    except ConfigError as e:
        print(f"omnilearn: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"omnilearn: {e}", file=sys.stderr)
        return 128 + (signal_number() or 15)
    except Exception as e:  # the traceback for the log, then one line that says what
        traceback.print_exc()
        print(f"omnilearn: worker {rank} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 1


def exit_now(code: int) -> None:
    """Exit a TensorFlow process with ``code`` once its output is flushed (its run files are closed already):
    TensorFlow's interpreter teardown takes a second or more of CPU."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
