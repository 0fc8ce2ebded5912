"""A TensorFlow ASP run for tests/tf/test_tf_asp.py: one ps and ``workers`` worker servers as processes, the chief here.

``python asp_chief_script.py OUT WORKERS BATCHES EPOCHS MAX_STALENESS [KILL_WORKER KILL_AFTER]``: trains a small
float64 MLP on a seeded synthetic set (256 samples, 8 features, 3 classes) with plain SGD, writes
``OUT/summary.json`` (the chief's summary with the applied pushes in order) and ``OUT/weights.npz`` (the initial
and final weights). ``MAX_STALENESS``: ``none`` or the bound. ``KILL_WORKER KILL_AFTER``: that worker's server
gets SIGKILL once the chief has applied ``KILL_AFTER`` pushes. ``ASP_B_REF`` (environment): the chief's ``b_ref``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
SERVER = ("import json, sys, tensorflow as tf; spec = json.loads(sys.argv[1]); "
          "tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=sys.argv[2], task_index=int(sys.argv[3]), "
          "protocol='grpc', start=True).join()")
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


def main() -> None:
    out, workers, batches, epochs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    bound = None if sys.argv[5] == "none" else int(sys.argv[5])
    kill = (int(sys.argv[6]), int(sys.argv[7])) if len(sys.argv) > 7 else None
    from omnilearn.tf.cluster import free_ports
    ports = free_ports(workers + 1)
    spec = {"worker": [f"localhost:{p}" for p in ports[:workers]], "ps": [f"localhost:{ports[-1]}"]}
    servers = {(job, i): subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(spec), job, str(i)],
                                          stderr=subprocess.DEVNULL)
               for job in ("worker", "ps") for i in range(len(spec[job]))}
    try:
        import keras
        import numpy as np
        import tensorflow as tf
        from omnilearn.tf.asp import Chief
        strategy = tf.distribute.ParameterServerStrategy(
            tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec), rpc_layer="grpc"))
        x, y = data()
        killer = None if kill is None else (kill[1], lambda: servers[("worker", kill[0])].send_signal(signal.SIGKILL))
        chief = Chief(strategy, workers, build, loss, lambda: keras.optimizers.SGD(LR), x, y,
                      [int(b) for b in batches.split(",")], epochs, seed=5, max_staleness=bound, keep_order=True,
                      b_ref=float(os.environ["ASP_B_REF"]) if "ASP_B_REF" in os.environ else None,
                      kill=killer)
        initial = [v.numpy() for v in chief.model.weights]
        devices = sorted({v.value.device for v in chief.model.weights + chief.optimizer.variables})
        summary = {**chief.run(), "variable_devices": devices}
        (out / "summary.json").write_text(json.dumps(summary))
        np.savez(out / "weights.npz", **{f"initial{i}": w for i, w in enumerate(initial)},
                 **{f"final{i}": v.numpy() for i, v in enumerate(chief.model.weights)})
    finally:
        for p in servers.values():
            p.kill()


if __name__ == "__main__":
    main()
