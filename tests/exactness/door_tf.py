"""The TensorFlow doors' shapes in real TensorFlow workers: Keras ``fit`` (``ol.fit``), the custom loop (``ol.step``).

:func:`start` starts one worker per rank of the split (``TF_CONFIG`` each,
one ``MultiWorkerMirroredStrategy`` cluster), forked from one process that
imported TensorFlow once (``omnilearn.experiments.launch.tfforks``), with a
``KERAS_HOME`` whose ``keras.json`` makes Keras float64. Each worker runs
this file and every TF cell in turn, each its own ``omnilearn.tf.setup()``
(the strategy is made once per process), on 64 regression samples
(:func:`arrays`), 4 steps of 16: the model of :func:`build` (Dense 16 tanh,
then the shape's layers), SGD at the matrix's rate. The shapes:

- ``keras_fit``: ``one_output`` (a compiled loss), ``add_loss`` (a layer's
  auxiliary loss, a per-sample mean), ``kernel_regularizer`` (L2),
  ``dict_of_losses`` (2 named outputs, ``compile(loss={...})``),
  ``two_outputs_one_loss`` (2 outputs, ``compile(loss="mse")``, one label
  array); the reference is Keras' own ``train_on_batch`` (``y=[y, y]`` where
  Keras needs a label per output);
- ``tf_loop``: ``loss_object`` (a Keras ``Loss``), ``dict_outputs`` (a
  callable over a dict of 2 outputs), ``add_loss`` (``model_losses`` unset:
  refused), ``add_loss_added`` (``model_losses=True``: OmniLearn adds them),
  ``add_loss_in_callable`` (the callable adds ``model.losses``; ``model_losses=False``), ``control_off_by_1pct`` (worker 0's
  loss 1% too large: must be inexact); the reference is the TensorFlow
  guide's ``GradientTape`` loop (``mean loss + sum(model.losses)``).

Worker ``r`` writes ``out/tf-rank<r>.jsonl`` (per cell: its indices per step,
recorded at ``ol.step``, and ``ol.batches``; or what it raised) and its final
weights, ``out/tf-<n>-rank<r>.npz``; worker 0 also the reference's
(``out/tf-<n>-reference.npz``) and the plan's global batches. The test
process compares them with numpy (:func:`results`): it never imports TensorFlow.

Run: ``python -m pytest -q tests/exactness/test_doors.py -k "keras_fit or tf_loop"``
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

SAMPLES, AUX, L2 = 64, 0.01, 1e-3
STEPS, GLOBAL_BATCH, LR = 4, 16, 0.1  # exactness.matrix's (test_doors checks): it imports torch, not wanted here


def arrays() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.normal(size=(SAMPLES, 6)), rng.normal(size=(SAMPLES, 6))


def build(shape: str):
    """The shape's model, the same weights every call (seeded)."""
    import keras
    import tensorflow as tf

    class Aux(keras.layers.Layer):
        """An auxiliary loss on the features: the per-sample mean of ``h**2``, averaged over the batch."""

        def call(self, h):
            self.add_loss(AUX * tf.reduce_mean(tf.reduce_mean(tf.square(h), axis=1)))
            return h

    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    regularizer = keras.regularizers.L2(L2) if shape == "kernel_regularizer" else None
    h = keras.layers.Dense(16, activation="tanh", kernel_regularizer=regularizer)(x)
    if "add_loss" in shape:
        h = Aux()(h)
    if shape in ("dict_of_losses", "dict_outputs"):
        return keras.Model(x, {"a": keras.layers.Dense(3, name="a")(h), "b": keras.layers.Dense(3, name="b")(h)})
    if shape == "two_outputs_one_loss":
        return keras.Model(x, [keras.layers.Dense(3, name="a")(h), keras.layers.Dense(3, name="b")(h)])
    return keras.Model(x, keras.layers.Dense(6)(h))


def labels(shape: str, y: np.ndarray, for_keras: bool):
    """What the door is given as labels (``for_keras``: what Keras' own ``train_on_batch`` needs)."""
    if shape == "dict_of_losses" and for_keras:
        return {"a": y[:, :3], "b": y[:, 3:]}
    if shape == "two_outputs_one_loss":
        return [y[:, :3], y[:, :3]] if for_keras else y[:, :3]
    return y


def compile_loss(shape: str):
    return {"a": "mse", "b": "mse"} if shape == "dict_of_losses" else "mse"


def loop_loss(shape: str, model, rank: int = -1):
    """The custom loop's loss: per-sample losses (the session averages them)."""
    import keras
    import tensorflow as tf

    mse = keras.losses.mean_squared_error
    if shape == "dict_outputs":
        return lambda y, p: mse(y[:, :3], p["a"]) + mse(y[:, 3:], p["b"])
    if shape == "add_loss_in_callable":
        return lambda y, p: mse(y, p) + tf.add_n(model.losses)
    if shape == "control_off_by_1pct":  # worker 0's loss 1% too large (the reference: rank -1, not scaled)
        return lambda y, p: mse(y, p) * (1.01 if rank == 0 else 1.0)
    return keras.losses.MeanSquaredError()


def reference(door: str, shape: str, x, y, plan: list[list[int]]) -> list[np.ndarray]:
    """One process, plain Keras: ``train_on_batch`` (fit), or the guide's ``GradientTape`` loop (the custom loop)."""
    import keras
    import tensorflow as tf

    model, optimizer = build(shape), keras.optimizers.SGD(LR)
    if door == "keras_fit":
        model.compile(optimizer=optimizer, loss=compile_loss(shape))
    loss = loop_loss(shape, model)
    for idx in plan:
        if door == "keras_fit":
            model.train_on_batch(x[idx], labels(shape, y[idx], for_keras=True))
            continue
        with tf.GradientTape() as tape:
            batch_loss = tf.reduce_mean(loss(y[idx], model(x[idx], training=True)))
            if shape != "add_loss_in_callable" and model.losses:  # that loss adds them itself
                batch_loss += tf.add_n(model.losses)
        grads = tape.gradient(batch_loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights()


def run_cell(door: str, shape: str, split: list[int], x, y, index: dict) -> tuple[dict, list | None]:
    """One cell on this worker: (its record, its final weights or None)."""
    import keras

    import omnilearn.tf

    ol = omnilearn.tf.setup(global_batch=GLOBAL_BATCH, controller="static", emulator="none", total_steps=STEPS,
                            speeds=",".join(map(str, split)), handle_signals=False, quiet=True, timeout_s=60)
    seen, step = [], ol.step

    def recorded(xb, yb):
        seen.append([index[row.tobytes()] for row in xb])
        return step(xb, yb)

    ol.step = recorded  # ol.fit calls session.step: this worker's indices of each step
    try:
        with ol.scope():
            model, optimizer = build(shape), keras.optimizers.SGD(LR)
            if door == "keras_fit":
                model.compile(optimizer=optimizer, loss=compile_loss(shape))
        if door == "keras_fit":
            ol.fit(model, x, labels(shape, y, for_keras=False), epochs=1, verbose=0)
        else:
            ol.wrap(model, optimizer, loop_loss(shape, model, ol.rank), model_losses=MODEL_LOSSES.get(shape))
            for xb, yb in ol.data(x, y):
                ol.step(xb, yb)
            ol.finish()
    except Exception as e:
        return {"raised": f"{type(e).__name__}: {e}"}, None
    return {"seen": seen, "batches": list(ol.batches), "seed": ol.cfg.seed}, model.get_weights()


# ol.wrap's model_losses per shape (unset elsewhere: a model with losses of its own is refused)
MODEL_LOSSES = {"add_loss_added": True, "add_loss_in_callable": False, "add_loss_flag_typo": "yes"}


def worker(out: Path, cells: list[list]) -> None:
    """Every cell in turn (the module docstring)."""
    from omnilearn.data.schedule import GlobalPlan
    from omnilearn.tf.cluster import from_env

    rank = from_env().rank
    x, y = arrays()
    index = {row.tobytes(): i for i, row in enumerate(x)}
    with open(out / f"tf-rank{rank}.jsonl", "w") as lines:
        for n, (door, shape, split, cell_id) in enumerate(cells):
            start_s = time.perf_counter()
            record, got = run_cell(door, shape, split, x, y, index)
            if got is not None:
                np.savez(out / f"tf-{n}-rank{rank}.npz", *got)
                if rank == 0:
                    plan = GlobalPlan(SAMPLES, sum(split), seed=record["seed"])
                    record["plan"] = [plan.step_indices(s).tolist() for s in range(len(record["seen"]))]
                    np.savez(out / f"tf-{n}-reference.npz", *reference(door, shape, x, y, record["plan"]))
            record.update(id=cell_id, rank=rank, s=time.perf_counter() - start_s)
            lines.write(json.dumps(record) + "\n")
            lines.flush()


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its models.py, runner.py... would shadow any such top-level name
    worker(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
    sys.exit(0)


def start(cells: list, tmp: Path) -> tuple:
    """Start the workers of ``cells`` (one world size): ``(the fork server, the workers, tmp)``; :func:`join` waits."""
    from omnilearn.experiments.launch.tfforks import ForkServer
    from omnilearn.tf.cluster import free_ports, local_config

    home = tmp / "keras-float64"
    home.mkdir(exist_ok=True)
    (home / "keras.json").write_text(json.dumps({"floatx": "float64", "epsilon": 1e-07, "backend": "tensorflow",
                                                 "image_data_format": "channels_last"}))
    todo = tmp / "tf-cells.json"
    todo.write_text(json.dumps([[c.door, c.shape, list(c.split), c.id] for c in cells]))
    env = {**os.environ, "KERAS_HOME": str(home), "TF_CPP_MIN_LOG_LEVEL": "2"}
    world, ports = cells[0].world, free_ports(cells[0].world)
    server = ForkServer(env, tmp / "tf-server.log", [sys.executable, __file__])
    workers = [server.start(rank, [__file__, str(tmp), str(todo)], {**env, "TF_CONFIG": local_config(ports, rank)},
                            tmp / f"tf-worker{rank}.log", console=False) for rank in range(world)]
    return server, workers, tmp


def join(started: tuple, deadline_s: float) -> None:
    """Wait for the workers until ``deadline_s`` (monotonic), then end them; close the fork server. A worker that
    failed or was ended has the end of its log printed."""
    server, workers, tmp = started
    try:
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline_s:
            server.pump(wait_s=0.05)
        for w in workers:
            if w.poll() is None:
                w.kill()
            if w.returncode != 0:
                log = (tmp / f"tf-worker{w.rank}.log").read_text(errors="replace")[-3000:]
                print(f"exactness TF worker {w.rank}: exit {w.returncode} (None: ended at the deadline)\n{log}")
    finally:
        server.close()


def results(tmp: Path) -> dict[str, list[dict]]:
    """Each TF cell's records, one per worker, with ``rel``: its weights against the reference (worker 0's plan)."""
    out: dict[str, list[dict]] = {}
    for path in sorted(tmp.glob("tf-rank*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines()):
            row = json.loads(line)
            ours, ref = tmp / f"tf-{n}-rank{row['rank']}.npz", tmp / f"tf-{n}-reference.npz"
            if "raised" not in row and ours.exists() and ref.exists():
                with np.load(ours) as a, np.load(ref) as b:
                    row["rel"] = max(float(np.linalg.norm(a[k] - b[k]) / np.linalg.norm(b[k])) for k in b.files)
                    row["dtypes"] = sorted({str(a[k].dtype) for k in a.files})
            out.setdefault(row["id"], []).append(row)
    for rows in out.values():
        rows.sort(key=lambda r: r["rank"])
        plan = next((r["plan"] for r in rows if "plan" in r), None)
        steps = len(rows[0].get("seen", []))
        whole = all(len(r.get("seen", [])) == steps for r in rows)
        for r in rows:  # every worker's indices per step, in rank order: the global batch, and the split
            r["plan"] = plan
            r["global"] = [[i for o in rows for i in o["seen"][s]] for s in range(steps)] if whole else None
            r["sizes"] = [[len(o["seen"][s]) for o in rows] for s in range(steps)] if whole else None
    return out
