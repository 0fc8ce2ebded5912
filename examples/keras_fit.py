"""TensorFlow's "multi-worker training with Keras" tutorial, on OmniLearn: ``fit``, callbacks and ``tf.data`` kept.

The tutorial's script with its ``MultiWorkerMirroredStrategy`` replaced by
``omnilearn.tf.setup()``, its dataset left unbatched (OmniLearn cuts each
global batch per worker, by speed) and ``model.fit`` by ``ol.fit``. Two
workers on this machine, worker 1 emulated at half speed::

    omnilearn launch --workers 2 --speeds 2,1 --out runs/kf examples/keras_fit.py --checkpoint runs/kf/best.weights.h5

Each worker is a process with its ``TF_CONFIG``, as in the tutorial; on
several machines start one per machine by hand (here, by hand on one)::

    W='"worker": ["localhost:23456", "localhost:23457"]'
    TF_CONFIG="{\"cluster\": {$W}, \"task\": {\"type\": \"worker\", \"index\": 0}}" \
        python examples/keras_fit.py --speeds 2,1 --out runs/keras-fit &
    TF_CONFIG="{\"cluster\": {$W}, \"task\": {\"type\": \"worker\", \"index\": 1}}" \
        python examples/keras_fit.py --speeds 2,1 --out runs/keras-fit

With ``--max-restarts 1`` the launcher restarts the workers after a failure
and ``BackupAndRestore`` resumes the fit at its last epoch's checkpoint.
Without ``TF_CONFIG`` it trains alone. The data is a toy task (no download):
20 features, the label the largest of 8 random projections. Worker 0 shows
the progress bar and writes the checkpoint; every worker gets the same
``History``. Needs ``pip install 'omnilearn-hetero[tensorflow]'``.

OmniLearn lines: 5

Tested by: ``python -m pytest -q tests/examples/test_keras_fit.py``
"""

import argparse
import os

import keras
import numpy as np
import tensorflow as tf

import omnilearn.tf  # OmniLearn

parser = argparse.ArgumentParser()
parser.add_argument("--speeds", default=None, help="relative worker speeds, e.g. 2,1 (emulated)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--out", default=None, help="run directory (written by worker 0; omnilearn launch gives it)")
parser.add_argument("--checkpoint", default=None, help="the best weights' file (default: OUT/best.weights.h5)")
args = parser.parse_args()

rng = np.random.default_rng(0)
teacher = rng.normal(size=(20, 8))


def toy_dataset(size):
    x = rng.normal(size=(size, 20)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1)
    return x, y


def train_dataset():
    x, y = toy_dataset(4096)
    return tf.data.Dataset.from_tensor_slices((x, y))  # OmniLearn: unbatched (no .shuffle().repeat().batch())


def build_and_compile_model():
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(8)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(learning_rate=0.1, momentum=0.9), metrics=["accuracy"])
    return model


per_worker_batch_size = 64
ol = omnilearn.tf.setup(local_batch=per_worker_batch_size, speeds=args.speeds, out=args.out)  # OmniLearn
with ol.scope():  # OmniLearn
    model = build_and_compile_model()

checkpoint = args.checkpoint or os.path.join(args.out or ".", "best.weights.h5")
callbacks = [keras.callbacks.ModelCheckpoint(checkpoint, save_weights_only=True, save_best_only=True),
             keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.8 if epoch else rate),
             keras.callbacks.BackupAndRestore(os.path.join(args.out or ".", "backup"))]  # resumes after a failure
history = ol.fit(model, train_dataset(), epochs=args.epochs, steps_per_epoch=16,  # OmniLearn
                 validation_data=toy_dataset(1024), callbacks=callbacks)
print("val_accuracy by epoch:", ", ".join(f"{a:.1%}" for a in history.history["val_accuracy"]))
