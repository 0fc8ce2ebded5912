"""``ol.data(dataset)``: a ``tf.data.Dataset`` of examples read into the arrays the global plan indexes; what is refused.

In this process: :func:`omnilearn.tf.data.examples` reads every example once, in order, and refuses a
batched, infinite, empty or non-``(x, y)`` dataset in one line saying what to do. In a process of its own
(TensorFlow's cluster is made once per process): a worker's loader over a dataset serves the very batches
it serves over the same arrays (the global permutation), and ``ol.data``/``ol.fit`` refuse in one line.
Three workers training from a dataset and ending with one worker's weights: ``tests/tf/test_tf_fit.py``.

Run: ``python -m pytest -q tests/tf/test_tf_data.py``
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from needs import needs

from omnilearn.config import ConfigError

pytestmark = needs("tensorflow", "tensorflow")  # imported by the tests that run here (each worker collects all)
ROOT = Path(__file__).resolve().parents[2]
X, Y = np.arange(30, dtype=np.float64).reshape(10, 3), np.arange(10) % 3


def slices():
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((X, Y))


def examples(dataset):
    from omnilearn.tf.data import examples

    return examples(dataset)


@pytest.mark.parametrize("make", [slices, lambda: slices().map(lambda x, y: (x, y)).prefetch(2),
                                  lambda: slices().batch(4).unbatch()], ids=["slices", "map-prefetch", "batch-unbatch"])
def test_a_dataset_of_examples_reads_into_its_arrays_in_order(make):
    x, y = examples(make())
    assert x.dtype == X.dtype and np.array_equal(x, X) and np.array_equal(y, Y)


@pytest.mark.parametrize("make, said", [
    (lambda: slices().batch(4), "batched (Batch); OmniLearn cuts each global batch per worker itself: pass it "
                                "unbatched (add .unbatch(), or take it before .batch())"),
    (lambda: slices().batch(4).prefetch(1), "batched (Batch)"),
    (lambda: slices().padded_batch(4), "batched (PaddedBatch)"),
    (lambda: slices().repeat(), "infinite (.repeat() without a count)"),
    (lambda: slices().take(0), "the dataset is empty"),
    (lambda: slices().map(lambda x, y: x), "elements must be (x, y) pairs"),
    (lambda: slices().map(lambda x, y: ({"features": x}, y)), "elements must be (x, y) pairs"),
    (lambda: X, "give a tf.data.Dataset of (x, y) examples"),
])
def test_what_cannot_be_served_is_refused_in_one_line_saying_what_to_do(make, said):
    dataset = make()
    with pytest.raises(ConfigError) as e:
        examples(dataset)
    assert said in str(e.value) and "\n" not in str(e.value)


API = """
import keras, numpy as np, tensorflow as tf, omnilearn.tf
from omnilearn.config import ConfigError
x, y = np.random.default_rng(1).normal(size=(200, 3)), np.arange(200) % 4
a = omnilearn.tf.setup(global_batch=32, total_steps=12, handle_signals=False)
b = omnilearn.tf.setup(global_batch=32, total_steps=12, handle_signals=False)
arrays, dataset = a.data(x, y), b.data(tf.data.Dataset.from_tensor_slices((x, y)))
for epoch in (0, 1):
    arrays.set_epoch(epoch), dataset.set_epoch(epoch)
    for (xa, ya), (xd, yd) in zip(arrays, dataset, strict=True):
        assert np.array_equal(xa, xd) and np.array_equal(ya, yd)
print("same batches")
def said(call):
    try:
        call()
    except ConfigError as e:
        print("error:", e)
ol = omnilearn.tf.setup(global_batch=32, handle_signals=False)
said(lambda: ol.data(tf.data.Dataset.from_tensor_slices((x, y)).batch(32)))
with ol.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    said(lambda: ol.fit(model, x, y))
said(lambda: ol.fit(model, x, y))
model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
said(lambda: ol.fit(model, x, y, batch_size=32))
said(lambda: ol.fit(model, x, y, colour=1))
said(lambda: ol.fit(model, x, y, validation_freq=0))
said(lambda: ol.fit(model, x, y, callbacks=[keras.callbacks.BackupAndRestore(d) for d in ("/tmp/a", "/tmp/b")]))
said(lambda: ol.fit(model, x))
wrapped = omnilearn.tf.setup(global_batch=32, handle_signals=False)
wrapped.wrap(model, model.optimizer, keras.losses.SparseCategoricalCrossentropy())
said(lambda: model.fit(x, y))
"""


def test_a_workers_loader_serves_the_same_batches_from_a_dataset_and_the_api_refuses_in_one_line():
    done = subprocess.run([sys.executable, "-c", API], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same batches" in done.stdout
    said = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    expected = ["pass it unbatched (add .unbatch()", "ol.fit() inside `with ol.scope():`", "compile it first",
                "fit(batch_size=32): the global batch is omnilearn.tf.setup(global_batch=...)",
                "unknown keyword colour=1", "fit(validation_freq=0): give a whole number of epochs",
                "(a second BackupAndRestore); keep one",
                "give the labels too", "model.fit() on a model OmniLearn balances: call ol.fit(model, data"]
    assert len(said) == len(expected), done.stdout
    for line, words in zip(said, expected):
        assert words in line, line
