"""A user's ``ol.fit`` with ``BackupAndRestore`` for tests/tf/test_tf_fit.py: stopped and resumed, run after run.

    python tests/tf/fit_resume_script.py OUT STOP [INTERVAL]

float64 under the test's ``KERAS_HOME``; 3 epochs of 4 steps, a control interval of 3 steps (a stop and a
backup land on interval ends: steps 3, 6 and 9, inside each epoch, the last one included) or, with ``INTERVAL``
1, of 1 step with the ``static`` controller (the adaptive ones need 3): a stop and a backup at every step; a
``LearningRateScheduler`` that scales the current rate (the callback a resumed epoch must not apply twice).
``STOP`` 1: ask to stop as this run's first step begins (``omnilearn.stopping.request_stop``: the workers
stop at the next interval end after a checkpoint), 0: never. Each run appends where it started and ended to
``OUT/runs.jsonl``; the run that completes the fit writes ``OUT/weights.npz``.
"""

import json
import sys
from pathlib import Path

import keras
import numpy as np

import omnilearn.tf
from omnilearn import stopping

out, stop = Path(sys.argv[1]), int(sys.argv[2])
interval = int(sys.argv[3]) if len(sys.argv) > 3 else 3
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 6))
y = np.argmax(x @ rng.normal(size=(6, 3)), axis=1)
ol = omnilearn.tf.setup(global_batch=64, control_interval=interval, seed=3, quiet=True,
                        **({"controller": "static"} if interval < 3 else {}))
keras.utils.set_random_seed(0)
with ol.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
start = {}


class StopSoon(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        start.setdefault("step", ol.next_step)
        if stop:  # during this run's first step: the workers stop at the interval end it reaches
            stopping.request_stop()


ol.fit(model, x, y, epochs=3, verbose=0, callbacks=[
    keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.7 if epoch else rate),
    keras.callbacks.BackupAndRestore(str(out / "backup"), save_freq=interval), StopSoon()])
done = not ol.should_stop
with open(out / "runs.jsonl", "a") as f:
    f.write(json.dumps({"start": start.get("step"), "end": ol.next_step, "done": done}) + "\n")
if done:
    np.savez(out / "weights.npz", *model.get_weights())
