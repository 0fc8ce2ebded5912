"""``ol.fit`` runs one collective per training step: the metrics ride on the step's gradient all-reduce.

Two real TensorFlow workers (this file run as ``python tests/tf/test_tf_fit_collectives.py OUT``, as
``tests/tf/test_tf_fit.py`` runs itself) fit a small classifier (``accuracy`` and a top-k accuracy compiled,
a validation set, ``control_interval=4``) for 2 epochs of 8 steps. Each worker counts every collective it
launches: the collective ops (``Collective*``) in the graph of each ``tf.function`` it calls, plus any
collective run eagerly; a callback cuts the count at each batch's begin and end. Then, on both workers: every
training step launches exactly one collective besides the session's own gather of timings at a control
interval's end (before issue 33: two, the second a SUM all-reduce of the metrics' states); between steps only
the validation's reduction (one per epoch); and the logs are the same on both workers.

Run: ``python -m pytest -q tests/tf/test_tf_fit_collectives.py``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EPOCHS, STEPS, INTERVAL = 2, 8, 4


def collective_ops(function) -> int:
    """The collective ops in the graph of ``function`` (a ``tf.function``), nested functions included."""
    graphs = [c.graph.as_graph_def() for c in function._list_all_concrete_functions()]
    counts = {sum(n.op.startswith("Collective") for n in [*g.node, *(d for f in g.library.function
                                                                      for d in f.node_def)]) for g in graphs}
    assert len(counts) <= 1, f"concrete functions of {function} with different collectives: {counts}"
    return counts.pop() if counts else 0


def count_collectives(session_gather) -> list[tuple[str, int]]:
    """Patch TensorFlow so every collective launched appends ``(kind, ops)``; the list."""
    import tensorflow as tf
    from tensorflow.python.eager.polymorphic_function import polymorphic_function
    from tensorflow.python.ops import collective_ops as ops

    launched: list[tuple[str, int]] = []
    call = polymorphic_function.Function.__call__

    def counting_call(self, *args, **kwargs):
        out = call(self, *args, **kwargs)
        ops_run = collective_ops(self)
        if ops_run:
            launched.append(("window" if self is session_gather().function else "graph", ops_run))
        return out

    polymorphic_function.Function.__call__ = counting_call
    for name in [n for n in dir(ops) if n.startswith(("all_", "broadcast_", "reduce_scatter"))]:
        def eager(*args, _original=getattr(ops, name), **kwargs):
            if tf.executing_eagerly():
                launched.append(("eager", 1))
            return _original(*args, **kwargs)
        setattr(ops, name, eager)
    return launched


def worker(out: Path) -> None:
    """One worker: fit with a callback cutting the collectives launched per batch; writes ``out/<rank>.json``."""
    import keras
    import tensorflow as tf

    import omnilearn.tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 6)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(6, 3)) + rng.normal(size=(512, 3)), axis=1)
    ol = omnilearn.tf.setup(global_batch=64, control_interval=INTERVAL, seed=1, quiet=True)
    keras.utils.set_random_seed(0)
    with ol.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(True),
                      metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)])
    launched = count_collectives(lambda: ol.gather)  # fit's: the model's variables were broadcast when made
    steps, between, seen, mark = [], [], [], [0]

    def cut(into: list) -> None:
        into.append(launched[mark[0]:])
        mark[0] = len(launched)

    cutter = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: cut(between),
                                            on_train_batch_end=lambda batch, logs: (cut(steps), seen.append(logs)))
    history = ol.fit(model, x, y, epochs=EPOCHS, verbose=0, validation_data=(x[:100], y[:100]),
                     callbacks=[cutter])
    cut(between)
    (out / f"{ol.rank}.json").write_text(json.dumps({"steps": steps, "between": between, "logs": seen,
                                                     "history": history.history}))
    del tf


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
    sys.exit(0)

from needs import needs  # noqa: E402  (in tests/: not importable where this file runs as a worker)
from omnilearn.tf.cluster import free_ports, local_config  # noqa: E402

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("collectives")
    ports = free_ports(2)
    procs = [subprocess.Popen([sys.executable, __file__, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                                              "TF_CONFIG": local_config(ports, rank)})
             for rank in range(2)]
    for p, (stdout, stderr) in zip(procs, [p.communicate(timeout=240) for p in procs]):
        assert p.returncode == 0, f"stdout:\n{stdout[-2000:]}\nstderr:\n{stderr[-4000:]}"
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


def test_every_training_step_launches_one_collective(workers):
    for rank, run in enumerate(workers):
        assert len(run["steps"]) == EPOCHS * STEPS
        for step, launched in enumerate(run["steps"]):
            others = sum(ops for kind, ops in launched if kind != "window")
            assert others == 1, f"worker {rank}, step {step}: {launched} (one collective a step, besides the gather)"
            windows = [kind for kind, _ in launched if kind == "window"]
            assert windows == (["window"] if (step + 1) % INTERVAL == 0 else []), (rank, step, launched)


def test_between_steps_only_the_validation_reduces(workers):
    for run in workers:  # before the first batch: nothing; after each epoch's last: the validation's one gather
        assert [sum(ops for _, ops in launched) for launched in run["between"]] == (
            [0] + [0] * (STEPS - 1) + [1] + [0] * (STEPS - 1) + [1]), run["between"]


def test_every_worker_logs_the_same(workers):
    zero, one = workers
    assert zero["logs"] == one["logs"] and zero["history"] == one["history"]
    assert set(zero["logs"][0]) == {"loss", "accuracy", "sparse_top_k_categorical_accuracy"}
