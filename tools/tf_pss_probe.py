"""What Keras 3 does under TensorFlow's ``ParameterServerStrategy`` (issue 35's design note, docs/tensorflow.md).

Starts one parameter server and two workers as separate processes (``tf.distribute.Server``), then from this
process (the coordinator) checks, printing one line each:

1. where a Keras 3 model's and optimizer's variables live (the parameter server?);
2. whether ``optimizer.apply`` works in a scheduled ``tf.function`` without ``strategy.run`` (it does not: Keras
   3's TensorFlow optimizer needs a replica context) and with it;
3. ``ClusterCoordinator.schedule``: which worker runs a closure is the coordinator's choice;
4. a function pinned to one worker with ``tf.device("/job:worker/.../task:i")`` from one Python thread per
   worker: the route that lets each worker get its own batch; the steps of both threads, and the staleness a
   version counter on the parameter server reads (incremented after the update, read before the forward).

A probe, not a test: ``python tools/tf_pss_probe.py`` (about 30 s on the 2-core machine).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SERVER = ("import json, sys, tensorflow as tf; spec = json.loads(sys.argv[1]); "
          "tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=sys.argv[2], task_index=int(sys.argv[3]), "
          "protocol='grpc', start=True).join()")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main() -> None:
    spec = {"worker": [f"localhost:{free_port()}" for _ in range(2)], "ps": [f"localhost:{free_port()}"]}
    servers = [subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(spec), job, str(i)],
                                stderr=subprocess.DEVNULL)
               for job in ("worker", "ps") for i in range(len(spec[job]))]
    try:
        probe(spec)
    finally:
        for p in servers:
            p.kill()


def probe(spec: dict) -> None:
    import numpy as np
    import tensorflow as tf
    import keras

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec), rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(2)])
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        opt.build(model.trainable_variables)
        version = tf.Variable(0, dtype=tf.int64)
    devices = {v.value.device for v in model.weights} | {v.value.device for v in opt.variables}
    print(f"1. Keras {keras.__version__}: model and optimizer variables on {sorted(devices)}")
    x, y = tf.constant(np.random.randn(64, 4).astype("float32")), tf.constant(np.random.randint(0, 2, 64))

    def loss_of(x, y):
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))

    def update(x, y):
        seen = version.read_value()
        with tf.control_dependencies([seen]):
            with tf.GradientTape() as tape:
                loss = loss_of(x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        with tf.control_dependencies([tf.identity(opt.iterations.value)]):  # after the update
            now = version.assign_add(1)
        return loss, now - seen - 1

    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    bare = tf.function(update)
    try:
        coordinator.schedule(bare, args=(x, y)).fetch()
        print("2. optimizer.apply without strategy.run: works")
    except Exception as e:  # noqa: BLE001  (a probe: report whatever it is)
        print(f"2. optimizer.apply without strategy.run: {str(e).strip().splitlines()[-1].strip()}")
    step = tf.function(lambda x, y: strategy.run(update, args=(x, y)))
    print(f"   with strategy.run: loss {float(coordinator.schedule(step, args=(x, y)).fetch()[0]):.3f}")
    start = time.perf_counter()
    results = [coordinator.schedule(step, args=(x, y)) for _ in range(40)]
    coordinator.join()
    stale = [int(r.fetch()[1]) for r in results]
    print(f"3. ClusterCoordinator: 40 closures in {time.perf_counter() - start:.2f} s, the worker of each chosen by "
          f"the coordinator; staleness max {max(stale)}, mean {np.mean(stale):.2f}")
    counts: dict[int, list[int]] = {0: [], 1: []}

    def pinned(worker: int, steps: int) -> None:
        for _ in range(steps):
            with tf.device(f"/job:worker/replica:0/task:{worker}"):
                counts[worker].append(int(step(x, y)[1]))

    pinned(0, 1)
    pinned(1, 1)  # traced once before the threads
    start = time.perf_counter()
    threads = [threading.Thread(target=pinned, args=(w, 20)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"4. pinned with tf.device, one thread per worker: {len(counts[0])} + {len(counts[1])} steps in "
          f"{time.perf_counter() - start:.2f} s; staleness max {max(counts[0] + counts[1])}; "
          f"version {int(version.numpy())}")


if __name__ == "__main__":
    main()
