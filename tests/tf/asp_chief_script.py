"""A TensorFlow ASP run for tests/tf/test_tf_asp.py: one ps and ``workers`` worker servers as processes, the chief here.

``python asp_chief_script.py OUT WORKERS GLOBAL_BATCH SPEEDS CONTROLLER EPOCHS MAX_STALENESS [KILL_WORKER
KILL_AFTER]``: trains a small float64 MLP on a seeded synthetic set (256 samples, 8 features, 3 classes) with
plain SGD, writes ``OUT/summary.json`` (the chief's summary with the applied pushes in order) and
``OUT/weights.npz`` (the initial and final weights). ``MAX_STALENESS``: ``none`` or the bound. ``KILL_WORKER
KILL_AFTER``: that worker's server gets SIGKILL once the chief has applied ``KILL_AFTER`` pushes.
``ASP_MAX_BATCH`` (environment): ``max_batch``; ``ASP_INTERVAL``: ``control_interval`` (default 4);
``ASP_LR_SCALING``: ``lr_scaling`` (default ``linear``); ``ASP_SIGNAL``: the signal sent instead of SIGKILL
(``STOP``: the worker hangs, alive); ``ASP_HEARTBEAT_S``: ``heartbeat_s``. The script leaves at once when done
(``os._exit``: a hung worker's thread stays in TensorFlow); a run that fails prints its error and exits 3.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
N, FEATURES, CLASSES, LR = 256, 8, 3, 0.1


def data():
    import numpy as np
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, FEATURES))
    y = (x[:, :CLASSES] @ rng.normal(size=(CLASSES, CLASSES))).argmax(axis=1).astype("int32")
    return x, y


def build():
    import keras
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((FEATURES,), dtype="float64"),
                             keras.layers.Dense(16, activation="tanh", dtype="float64"),
                             keras.layers.Dense(CLASSES, dtype="float64")])


def loss(y, logits):
    import keras
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def fork_server(spec: dict, job: str, index: int) -> int:
    """A ``tf.distribute.Server`` for task ``index`` of ``job`` in a child of this process; its pid. Forked before
    this process runs a TensorFlow op (importing TensorFlow starts no runtime: omnilearn.experiments.launch.tfforks),
    so a chief forked from the test's preloaded server (or that imported TensorFlow) starts its servers without
    importing anything; the child dies with this process."""
    import tensorflow  # noqa: F401  (before the fork: the servers share this import)
    from omnilearn.experiments.launch.tfforks import die_with_parent
    from omnilearn.tf.servers import serve

    pid = os.fork()
    if pid:
        return pid
    try:
        die_with_parent()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        serve(spec, job, index)
    finally:
        os._exit(0)


def main() -> None:
    out, workers, global_batch, speeds, controller, epochs = (Path(sys.argv[1]), int(sys.argv[2]),
                                                              int(sys.argv[3]), sys.argv[4], sys.argv[5],
                                                              int(sys.argv[6]))
    bound = None if sys.argv[7] == "none" else int(sys.argv[7])
    kill = (int(sys.argv[8]), int(sys.argv[9])) if len(sys.argv) > 9 else None
    from omnilearn.tf.servers import local_spec, tasks
    spec = local_spec(workers)
    servers = {task: fork_server(spec, *task) for task in tasks(spec)}
    try:
        import keras
        import numpy as np
        import tensorflow as tf
        from omnilearn.tf.asp import Chief
        strategy = tf.distribute.ParameterServerStrategy(
            tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec), rpc_layer="grpc"))
        x, y = data()
        from omnilearn.config import BalanceConfig
        cfg = BalanceConfig(workers=workers, global_batch=global_batch, speeds=speeds, controller=controller, seed=5,
                            control_interval=int(os.environ.get("ASP_INTERVAL", "4")),
                            max_batch=int(os.environ["ASP_MAX_BATCH"]) if "ASP_MAX_BATCH" in os.environ else None,
                            heartbeat_s=float(os.environ.get("ASP_HEARTBEAT_S", "60")), timeout_s=120.0)
        sent = getattr(signal, "SIG" + os.environ.get("ASP_SIGNAL", "KILL"))
        killer = None if kill is None else (kill[1], lambda: os.kill(servers[("worker", kill[0])], sent))
        from omnilearn.asp.settings import ASPSettings
        chief = Chief(strategy, cfg, build, loss, lambda: keras.optimizers.SGD(LR), x, y, epochs,
                      settings=ASPSettings(os.environ.get("ASP_LR_SCALING", "linear"), max_staleness=bound),
                      keep_order=True, kill=killer)
        initial = [v.numpy() for v in chief.model.weights]
        devices = sorted({v.value.device for v in chief.model.weights + chief.optimizer.variables})
        summary = {**chief.run(), "variable_devices": devices}
        (out / "summary.json").write_text(json.dumps(summary))
        np.savez(out / "weights.npz", **{f"initial{i}": w for i, w in enumerate(initial)},
                 **{f"final{i}": v.numpy() for i, v in enumerate(chief.model.weights)})
    finally:
        for pid in servers.values():
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    try:
        main()
        code = 0
    except Exception:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a hung worker's thread may still be in TensorFlow
