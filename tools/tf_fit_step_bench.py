"""Per-step time of ``ol.fit`` before and after issue 33's fold of the metrics into the step's all-reduce.

Two TensorFlow workers (this script starts them, with ``TF_CONFIG``) fit a small classifier in alternating blocks:
``before`` (``ol.fit`` of the ``fit.py`` given by ``--before``, e.g. ``git show b137d1e:src/omnilearn/tf/fit.py``,
loaded beside the package: its own SUM all-reduce of the metrics after each step) and ``after`` (the package's
``ol.fit``: the metrics ride on the gradients' all-reduce), the order swapped every block, each block a fresh
session, model and fit of ``--epochs`` x ``--steps`` steps. A step's time is the interval between two
``on_train_batch_end`` of one epoch (the first ``--skip`` of each fit left out: tracing); a block's figure the
median over its steps, on worker 0. It prints each block's two figures and their ratio, and the median ratio
over the blocks. ``--metric-object``: the compiled metrics are ``accuracy`` and a ``SparseTopKCategoricalAccuracy``
built in ``ol.scope()`` (sync-on-read variables); otherwise ``accuracy`` alone.

A benchmark, not a test: run it alone on the machine.

    git show b137d1e:src/omnilearn/tf/fit.py > /tmp/fit_before.py
    python tools/tf_fit_step_bench.py --before /tmp/fit_before.py --blocks 8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time


def args_of(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the fit.py of before the change")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--metric-object", action="store_true")
    return p.parse_args(argv)


def one_fit(fit_function, a: argparse.Namespace) -> float:
    """A fresh session, model and fit; the median step time in seconds (worker 0's)."""
    import keras
    import numpy as np

    import omnilearn.tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 32)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(32, 10)), axis=1)
    ol = omnilearn.tf.setup(global_batch=64, control_interval=10, seed=1, quiet=True)
    keras.utils.set_random_seed(0)
    with ol.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        metrics = ["accuracy", *([keras.metrics.SparseTopKCategoricalAccuracy(k=3)] if a.metric_object else [])]
        model.compile(optimizer=keras.optimizers.SGD(0.05), metrics=metrics,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ends: list[tuple[int, float]] = []
    clock = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: ends.append(
        (batch, time.perf_counter())))
    fit_function(ol, model, x, y, epochs=a.epochs, steps_per_epoch=a.steps, verbose=0, callbacks=[clock])
    steps = [t1 - t0 for (b0, t0), (b1, t1) in zip(ends, ends[1:]) if b1 == b0 + 1 and b1 >= a.skip]
    return statistics.median(steps)


def worker(a: argparse.Namespace, out: str) -> None:
    spec = importlib.util.spec_from_file_location("omnilearn.tf._fit_before", a.before)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    variants = {"before": lambda ol, *args, **kw: before.fit(ol, *args, **kw),
                "after": lambda ol, *args, **kw: ol.fit(*args, **kw)}
    rows = []
    for block in range(a.blocks):
        order = ["before", "after"] if block % 2 == 0 else ["after", "before"]
        rows.append({name: one_fit(variants[name], a) for name in order})
    if out:
        with open(out, "w") as f:
            json.dump(rows, f)


def main(argv: list[str]) -> None:
    a = args_of(argv)
    if os.environ.get("TF_CONFIG"):
        worker(a, os.environ.get("BENCH_OUT", ""))
        return
    from omnilearn.tf.cluster import free_ports, local_config

    ports, out = free_ports(2), f"/tmp/tf_fit_step_bench.{os.getpid()}.json"
    procs = [subprocess.Popen([sys.executable, __file__, *argv],
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": local_config(ports, rank),
                                   "BENCH_OUT": out if rank == 0 else ""}) for rank in range(2)]
    if any(p.wait() for p in procs):
        sys.exit("a worker failed")
    with open(out) as f:
        rows = json.load(f)
    os.unlink(out)
    for i, r in enumerate(rows):
        print(f"block {i}: before {r['before'] * 1e3:.3f} ms/step, after {r['after'] * 1e3:.3f} ms/step, "
              f"after/before {r['after'] / r['before']:.3f}")
    ratios = [r["after"] / r["before"] for r in rows]
    saved = [r["before"] - r["after"] for r in rows]
    print(f"median over {len(rows)} blocks: before {statistics.median(r['before'] for r in rows) * 1e3:.3f} ms/step,"
          f" after {statistics.median(r['after'] for r in rows) * 1e3:.3f} ms/step, after/before "
          f"{statistics.median(ratios):.3f}, saved {statistics.median(saved) * 1e3:.3f} ms/step")


if __name__ == "__main__":
    main(sys.argv[1:])
