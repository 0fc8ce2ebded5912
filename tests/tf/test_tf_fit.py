"""``ol.fit``: a compiled Keras model trained by Keras idioms (callbacks, ``History``, ``tf.data``) on real TensorFlow workers.

Two runs of the same script (this file run as ``python tests/tf/test_tf_fit.py OUT INPUT``: one worker process
each, started with ``TF_CONFIG`` as ``tests/tf/test_tf_train.py`` starts them), made once for the module, in
float64 (a ``keras.json`` under ``KERAS_HOME``):

- ``three``: 3 workers at speeds 4,2,1 (delay emulation) fed scripted timings in that ratio
  (``OMNILEARN_TEST_S_PER_SAMPLE``), the training data a ``tf.data.Dataset`` of examples;
- ``one``: one worker, the same arrays.

With ``ModelCheckpoint``, ``EarlyStopping`` (restoring the best weights), ``CSVLogger``,
``ReduceLROnPlateau`` and a validation set. Then: batches moved to the fast worker; the ``History``,
the CSV log, the epoch early stopping ended at and the final weights of the three workers equal one
worker's (1e-12 relative: about 4e-16 and 7e-16 measured); only worker 0 prints (the progress bar) and
writes. So the metrics are reduced with the weights ``b_i``, validation sharded by batch share gives the
unsharded numbers, and ``tf.data`` input serves the same global permutation as arrays.

Run: ``python -m pytest -q tests/tf/test_tf_fit.py``
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

EPOCHS, SPEEDS = 8, "4,2,1"


def worker(out: Path, source: str) -> None:
    """One worker of a run (the module docstring): writes ``out`` on worker 0."""
    import keras
    import tensorflow as tf

    import omnilearn.tf

    rng = np.random.default_rng(0)
    teacher = rng.normal(size=(12, 4))
    x = rng.normal(size=(1024, 12))
    y = np.argmax(x @ teacher + rng.normal(size=(1024, 4)), axis=1)
    x_val, y_val = x[:200] + 0.1, y[:200]
    ol = omnilearn.tf.setup(global_batch=128, speeds=os.environ.get("SPEEDS"), control_interval=4, seed=3)
    keras.utils.set_random_seed(0)
    with ol.scope():
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((x, y)) if source == "dataset" else x
    callbacks = [keras.callbacks.ModelCheckpoint(str(out / "best.weights.h5"), save_weights_only=True,
                                                 save_best_only=True),
                 keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0.01, patience=1,
                                               restore_best_weights=True),
                 keras.callbacks.CSVLogger(str(out / "log.csv")),
                 keras.callbacks.ReduceLROnPlateau(monitor="loss", min_delta=0.1, patience=0, factor=0.5)]
    history = ol.fit(model, data, y if source == "arrays" else None, epochs=EPOCHS,
                     validation_data=(x_val, y_val), callbacks=callbacks)
    if ol.is_main:
        (out / "history.json").write_text(json.dumps({"history": history.history, "epoch": history.epoch,
                                                      "params": history.params, "batches": ol.batches}))
        np.savez(out / "weights.npz", *model.get_weights())


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2])
    sys.exit(0)

from needs import needs  # noqa: E402  (in tests/: not importable where this file runs as a worker)
from omnilearn.decisions import SCRIPTED_ENV  # noqa: E402
from omnilearn.tf.cluster import free_ports, local_config  # noqa: E402
from test_tf_train import float64_keras_home  # noqa: E402
import tfpool  # noqa: E402

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]


def run(out: Path, workers: int, source: str, env: dict[str, str]) -> list[tuple[str, str]]:
    """``workers`` processes of this file with their ``TF_CONFIG``; their (stdout, stderr)."""
    out.mkdir()
    ports = free_ports(workers)
    envs = [{**os.environ, **env, "TF_CPP_MIN_LOG_LEVEL": "2",
             "TF_CONFIG": local_config(ports, rank) if workers > 1 else ""} for rank in range(workers)]
    done = tfpool.run_scripts([[__file__, str(out), source]] * workers, envs, out / "logs", timeout=240)
    for p in done:
        assert p.returncode == 0, f"stdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-4000:]}"
    return [(p.stdout, p.stderr) for p in done]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("fit")
    home = {"KERAS_HOME": str(float64_keras_home(base))}
    three = run(base / "three", 3, "dataset", {**home, "SPEEDS": SPEEDS, SCRIPTED_ENV: "0.0001,0.0002,0.0004"})
    run(base / "one", 1, "arrays", home)
    return {"base": base, "three": three}


def logged(out: Path) -> dict:
    return json.loads((out / "history.json").read_text())


def test_batches_move_to_the_fast_worker_and_only_worker_0_speaks(runs):
    three = logged(runs["base"] / "three")
    batches = three["batches"]
    assert sum(batches) == 128 and batches[0] > batches[1] > batches[2], batches
    (out0, _), *others = runs["three"]
    assert "Epoch 1/8" in out0 and "val_loss" in out0 and all(out == "" for out, _ in others)
    assert three["params"] == {"verbose": 1, "epochs": EPOCHS, "steps": 8}


def test_three_workers_log_and_learn_what_one_worker_does(runs):
    one, three = (logged(runs["base"] / name) for name in ("one", "three"))
    assert three["epoch"] == one["epoch"] and len(one["epoch"]) < EPOCHS  # EarlyStopping ended both alike
    assert set(three["history"]) == {"loss", "accuracy", "val_loss", "val_accuracy", "learning_rate"}
    assert len(set(one["history"]["learning_rate"])) >= 2  # ReduceLROnPlateau cut the rate
    for key, values in one["history"].items():
        assert three["history"][key] == pytest.approx(values, rel=1e-12, abs=0), key
    with np.load(runs["base"] / "one" / "weights.npz") as a, np.load(runs["base"] / "three" / "weights.npz") as b:
        for name in a.files:
            assert a[name].dtype == np.float64
            relative = np.linalg.norm(b[name] - a[name]) / np.linalg.norm(a[name])
            assert relative < 1e-12, f"{name}: relative difference {relative:.2e}"


def test_the_csv_log_and_checkpoint_are_worker_0s_and_match_one_worker(runs):
    def rows(name: str) -> list[dict]:
        with open(runs["base"] / name / "log.csv") as f:
            return list(csv.DictReader(f))

    one, three = rows("one"), rows("three")
    assert [r["epoch"] for r in three] == [r["epoch"] for r in one]
    assert len(one) == len(logged(runs["base"] / "one")["epoch"])
    for a, b in zip(one, three):
        assert {k: float(v) for k, v in b.items()} == pytest.approx({k: float(v) for k, v in a.items()}, rel=1e-12)
    assert (runs["base"] / "three" / "best.weights.h5").exists()


RESUME_SCRIPT = Path(__file__).with_name("fit_resume_script.py")


@pytest.mark.parametrize("interval", [3, 1], ids=["every-interval-end", "every-step"])
def test_a_fit_stopped_at_every_interval_end_and_resumed_ends_on_the_uninterrupted_weights(runs, interval):
    """``fit`` with ``BackupAndRestore`` and a rate scheduler (tests/tf/fit_resume_script.py), one worker: run after
    run, each stopped one interval after it resumed (interval 3: at steps 3, 6, 9, inside every epoch, the last one
    included; interval 1 with the static controller: at every step 1 to 11, the epoch boundaries 4 and 8 and the
    steps either side included), until one completes: the same weights as the run never stopped (float64; 1.7e-1
    off when the resumed epoch's scheduler scaled the rate a second time: issue 50). Every worker count resumes
    through the same code (tests/tf/test_tf_launch.py resumes 2 launched workers inside an epoch)."""
    home = {"KERAS_HOME": str(runs["base"] / "keras-float64")}
    env = {**os.environ, **home, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": ""}
    whole, stopped = runs["base"] / f"resume-whole-{interval}", runs["base"] / f"resume-stopped-{interval}"
    for out, stop in ((whole, "0"), *((stopped, "1"),) * (12 // interval + 1)):
        if stop == "1" and (stopped / "weights.npz").exists():
            break
        out.mkdir(exist_ok=True)
        [done] = tfpool.run_scripts([[str(RESUME_SCRIPT), str(out), stop, str(interval)]], [env], out / "logs",
                                    timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    chain = [json.loads(line) for line in (stopped / "runs.jsonl").read_text().splitlines()]
    stops = list(range(interval, 12, interval))
    assert [(r["start"], r["end"]) for r in chain if not r["done"]][:len(stops)] == \
        [(s - interval, s) for s in stops], chain
    assert chain[-1]["done"] and chain[-1]["end"] == 12, chain
    with np.load(whole / "weights.npz") as a, np.load(stopped / "weights.npz") as b:
        for name in a.files:
            relative = np.linalg.norm(b[name] - a[name]) / np.linalg.norm(a[name])
            assert relative < 1e-12, f"{name}: relative difference {relative:.2e}"
