"""``omnilearn train --framework tensorflow --mode asp``: a local ``ParameterServerStrategy`` cluster and its chief.

Who does what. The launcher (:func:`run_local`, in the command's own process: it imports no TensorFlow) starts
one parameter server and ``--workers`` workers on localhost, each a process that only hosts a
``tf.distribute.Server`` (:mod:`omnilearn.tf.servers`; its messages in ``RUN_DIR/tf-<job><index>.log``), then
the chief (``... chief RUN_DIR SPEC``), all forked from one process that imported TensorFlow once
(:func:`run_forked`; ``OMNILEARN_START_METHOD=spawn``: each a fresh interpreter), which
trains: :class:`omnilearn.tf.asp.Chief` over the default job's data and Keras model (MNIST-1D, ``cnn1d`` or
``mlp``, :mod:`omnilearn.experiments.train.tfjob`) with its optimizer and rate schedule (per push; the PyTorch
ASP defaults: SGD, no momentum), for ``--epochs``, or ``--max-steps`` steps of ``--workers`` pushes each (the
PyTorch ASP server's count) if fewer, or ``--max-time-s`` of training; it evaluates the model on the test split
after each epoch of data and at the end, and writes the PyTorch server's record (``metrics.jsonl``,
``summary.json``: staleness p50/p99/max per worker among its fields, ``model.weights.h5``). When the chief
exits, the servers are stopped; a chief that fails is named in one line with its log's last line.
``--lr-scaling``, ``--staleness-lr`` and ``--max-staleness`` mean what they mean on PyTorch. ``omnilearn bench
--mode asp --framework tensorflow`` runs its arms through :func:`run_local` too.

Refused in one line (``TrainConfig``'s TensorFlow check): what the chief does not do yet (``--resume``,
``--max-restarts``, a speed schedule), and ``TF_CONFIG`` (several machines). It writes no checkpoints yet,
whatever ``--checkpoint-every`` says: the start line says so. A worker whose call is not back within
``--heartbeat-s`` (its first: ``--timeout-s``) is dropped as a dead one is (``drop`` event, ``summary.json``).

Run: ``python -m pytest -q tests/tf/test_tf_asp.py``
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from omnilearn.experiments.config import TrainConfig, build, load_toml
from omnilearn.experiments.launch.supervise import (
    START_METHOD_ENV,
    Interrupted,
    SignalTrap,
    WorkerFailed,
    signal_name,
    start_method,
)
from omnilearn.experiments.launch.netns import private_tmp, say_exposed
from omnilearn.experiments.launch.tfforks import POLL_S, Forked, ForkServer, die_with_parent

TF_PRELOAD = ("tensorflow", "keras", "omnilearn.tf.asp")  # what the servers and the chief import

STOP_GRACE_S = 10.0  # a chief told to stop by the launcher gets this long before SIGKILL (it writes no checkpoint)
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt|Exit)\b.*:")  # a traceback's last line


def run_local(cfg: TrainConfig, run_dir: Path) -> None:
    with private_tmp():  # the servers' and chief's TMPDIR (TensorFlow's autograph files), removed with the run
        _run_local(cfg, run_dir)


def _run_local(cfg: TrainConfig, run_dir: Path) -> None:
    if start_method() == "spawn":
        from omnilearn.tf.servers import local_cluster

        say_exposed(f"{START_METHOD_ENV}=spawn starts each process on its own, outside a private network")
        chief_log = run_dir / "tf-chief.log"
        with local_cluster(cfg.workers, logs=run_dir, preexec_fn=die_with_parent) as spec, open(chief_log, "w") as log:
            chief = subprocess.Popen([sys.executable, "-m", __name__, "chief", str(run_dir), json.dumps(spec)],
                                     stderr=log, preexec_fn=die_with_parent)
            code = chief_exit(chief, run_dir)
    else:
        code = run_forked(cfg.workers, run_dir)
    if code:
        raise WorkerFailed(f"the TensorFlow ASP chief failed (exit {code}): {last_line(run_dir / 'tf-chief.log')} "
                           f"(log: {run_dir / 'tf-chief.log'})")


def chief_exit(chief: subprocess.Popen | Forked, run_dir: Path) -> int:
    """The chief's exit code. SIGINT/SIGTERM to the launcher meanwhile: the chief is stopped (SIGTERM, then SIGKILL
    after :data:`STOP_GRACE_S`), the caller stops the servers, and :class:`Interrupted` says so (128 + signal)."""
    with SignalTrap() as trap:
        while chief.poll() is None and not trap.received:
            time.sleep(POLL_S)
    if not trap.received:
        return chief.returncode
    chief.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while chief.poll() is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    killed = ""
    if chief.poll() is None:
        chief.kill()
        killed = f"; SIGKILLed after {STOP_GRACE_S:g} s"
    signum = trap.received[0]
    raise Interrupted(signum, f"interrupted by {signal_name(signum)}: the TensorFlow ASP chief and its servers were "
                              f"stopped{killed}; this mode writes no checkpoint yet (the records so far are in "
                              f"{run_dir})")


def run_forked(workers: int, run_dir: Path) -> int:
    """The servers and the chief forked from one process that imported TensorFlow once
    (:class:`~omnilearn.experiments.launch.tfforks.ForkServer`: 6 s of CPU an import on a 2-core machine, paid once
    instead of ``workers + 2`` times), in a network namespace of loopback only; the chief's exit code. They die
    with the fork server, and it with this process."""
    from omnilearn.tf.servers import SERVER_START_S, local_spec, tasks

    spec, env = local_spec(workers), {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    chief_log = run_dir / "tf-chief.log"
    chief_log.write_text("")
    with ForkServer(env, chief_log, [sys.executable, "-m", __name__], preload=TF_PRELOAD, isolate=True) as server:
        if server.exposed:
            say_exposed(f"a private network could not be made: {server.exposed}")
        servers = [server.start(rank, ["-m", "omnilearn.tf.servers", json.dumps(spec), job, str(index)], env,
                                run_dir / f"tf-{job}{index}.log", console=False)
                   for rank, (job, index) in enumerate(tasks(spec))]
        try:
            time.sleep(SERVER_START_S)
            return chief_exit(server.start(len(servers), ["-m", __name__, "chief", str(run_dir), json.dumps(spec)],
                                           env, chief_log, console=True), run_dir)
        finally:
            for proc in servers:
                proc.kill()
            for proc in servers:
                proc.wait()


def last_line(path: Path) -> str:
    """The log's Python error line if it has one (TensorFlow's own logging can print after it), else its last."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.match(line)]
    return (errors or lines or ["no output"])[-1][:300]


def chief(run_dir: Path, spec: dict) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    from omnilearn.asp.settings import ASPSettings
    from omnilearn.experiments.datasets.mnist1d import mnist1d_arrays
    from omnilearn.experiments.train.tfjob import build_model, learning_rate, make_optimizer
    from omnilearn.tf.asp import Chief

    cfg = build(load_toml(str(run_dir / "config.toml")), {})
    arrays, _ = mnist1d_arrays()
    x, y = arrays["x"], arrays["y"].astype("int32")
    x_test, y_test = arrays["x_test"], arrays["y_test"].astype("int32")
    per_epoch = max(1, math.ceil(len(x) * cfg.workers / cfg.global_batch))  # pushes of B / n samples an epoch
    rate = learning_rate(cfg, per_epoch * cfg.epochs, per_epoch)
    strategy = tf.distribute.ParameterServerStrategy(
        tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec), rpc_layer="grpc"))
    keras.utils.set_random_seed(cfg.seed)

    def evaluate(model) -> tuple[float, float]:
        logits = np.asarray(model(x_test, training=False))
        loss = keras.losses.sparse_categorical_crossentropy(y_test, logits, from_logits=True)
        return float(np.mean(np.asarray(loss))), float(np.mean(np.argmax(logits, axis=1) == y_test))

    settings = ASPSettings(cfg.lr_scaling, cfg.staleness_lr, cfg.max_time_s, 0, cfg.max_staleness)
    run = Chief(strategy, cfg, lambda: build_model(cfg, x.shape[1], int(y.max()) + 1),
                lambda t, p: keras.losses.sparse_categorical_crossentropy(t, p, from_logits=True),
                lambda: make_optimizer(cfg, per_epoch * cfg.epochs, per_epoch), x, y, cfg.epochs,
                max_pushes=cfg.max_steps * cfg.workers if cfg.max_steps else None, settings=settings,
                evaluate=evaluate, lr_at=lambda k: float(rate(k)) if callable(rate) else float(rate), run_dir=run_dir)
    run.run()
    return run.result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "chief":
        chief(Path(args[1]), json.loads(args[2]))
        return 0
    print("usage: python -m omnilearn.experiments.train.tfasp chief RUN_DIR SPEC", file=sys.stderr)
    return 2


if __name__ == "__main__":
    import traceback

    from omnilearn.experiments.train.tfjob import exit_now

    try:
        code = main()
    except BaseException:  # noqa: BLE001  (a hung worker's thread stays in TensorFlow: report, then leave at once)
        traceback.print_exc()
        code = 1
    exit_now(code)
