"""A Keras model trained on OmniLearn's TensorFlow runtime (``omnilearn.tf``), one process per worker.

Each worker is a process of one ``tf.distribute.MultiWorkerMirroredStrategy``
cluster, set up by ``TF_CONFIG`` as usual; here two on this machine::

    W='"worker": ["localhost:23456", "localhost:23457"]'
    TF_CONFIG="{\"cluster\": {$W}, \"task\": {\"type\": \"worker\", \"index\": 0}}" \
        python examples/keras_tf.py --speeds 2,1 --out runs/keras &
    TF_CONFIG="{\"cluster\": {$W}, \"task\": {\"type\": \"worker\", \"index\": 1}}" \
        python examples/keras_tf.py --speeds 2,1 --out runs/keras

Without ``TF_CONFIG`` it trains alone. ``--speeds 2,1`` emulates worker 1 at
half speed; OmniLearn moves samples to worker 0, and every step still makes
the update of the whole global batch. Needs ``pip install 'omnilearn-hetero[tensorflow]'``.

Tested by: ``python -m pytest -q tests/examples/test_keras_tf.py``
"""

import argparse

import keras
import numpy as np

import omnilearn.tf

parser = argparse.ArgumentParser()
parser.add_argument("--speeds", default=None, help="relative worker speeds, e.g. 2,1 (emulated)")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--out", default=None, help="run directory (written by worker 0)")
args = parser.parse_args()

rng = np.random.default_rng(0)  # a toy task: 20 features, the label is the largest of 8 random projections
teacher = rng.normal(size=(20, 8))
x = rng.normal(size=(4096, 20)).astype(np.float32)
y = np.argmax(x @ teacher, axis=1)
x_test = rng.normal(size=(1024, 20)).astype(np.float32)
y_test = np.argmax(x_test @ teacher, axis=1)

ol = omnilearn.tf.setup(global_batch=256, speeds=args.speeds, out=args.out, total_steps=args.epochs * 16)
keras.utils.set_random_seed(0)  # every worker builds the same initial weights
with ol.scope():
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(8)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
ol.wrap(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
loader = ol.data(x, y)
for epoch in range(ol.epochs):
    loader.set_epoch(epoch)
    for xb, yb in loader:  # this worker's share of each global batch of 256
        ol.step(xb, yb)
    with ol.paused():
        loss, accuracy = ol.evaluate(x_test, y_test)
    ol.log_eval(loss, accuracy, epoch)
    if ol.is_main:
        print(f"epoch {epoch}: test loss {loss:.3f}, accuracy {accuracy:.1%}, batches {ol.batches}")
ol.finish()
