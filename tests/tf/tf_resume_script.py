"""A user's custom TensorFlow loop (``ol.step``) for tests/tf/test_tf_resume_every_step.py: runs and resumes, in turn.

    python tests/tf/tf_resume_script.py JOBS.json

Each job of ``JOBS.json`` (a list) is one session of the loop in this process (TensorFlow joins one cluster per
process; a second ``omnilearn.tf.setup()`` reuses it): ``{"name", "out", "every", "speeds", "resume": null or
[RUN_DIR, K]}``. A job with ``resume`` first makes ``out`` a run directory holding ``RUN_DIR``'s ``config.toml``
and only its checkpoint of step ``K`` (the newest there, so the one loaded), then resumes it with
``resume=True``. Every job trains to the end; worker 0 writes ``RESULTS/NAME.npz`` (the final weights) and a
line of ``RESULTS/runs.jsonl`` (the step and the optimizer's iteration count it started at, and ended at, the split
of its first step).

The loop (docs/tensorflow.md's): float64 (``keras.config.set_floatx``), a Dense 6-8-2 tanh regression,
Adam (moments and an iteration count) on an ``ExponentialDecay`` rate that changes every step, 3 epochs of
4 steps of 16 samples, each epoch permuted by ``(seed, epoch)``. A checkpoint is taken at control-interval
ends only, so the interval is 1 step, which the ``static`` controller allows (the adaptive ones need 3 steps
per decision: ``omnilearn.runplan``); with ``checkpoint_every=1`` every step ends with a checkpoint.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

EPOCHS, PER_EPOCH, GLOBAL_BATCH = 3, 4, 16
STEPS = EPOCHS * PER_EPOCH


def arrays() -> tuple[np.ndarray, np.ndarray]:
    """64 float64 samples: 6 features, 2 targets (one epoch is 4 steps of 16)."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(PER_EPOCH * GLOBAL_BATCH, 6))
    return x, np.tanh(x @ rng.normal(size=(6, 2))) + 0.1 * rng.normal(size=(len(x), 2))


def train(out: Path, every: int, speeds: str, resume: bool) -> dict:
    """The loop, in ``out`` (checkpoints every ``every`` steps, 0: none); what worker 0 reports (None elsewhere)."""
    import keras

    import omnilearn.tf

    keras.config.set_floatx("float64")
    ol = omnilearn.tf.setup(global_batch=GLOBAL_BATCH, total_steps=STEPS, control_interval=1, seed=5,
                            speeds=speeds, controller="static", emulator="none", out=str(out), checkpoint_every=every,
                            keep_checkpoints=STEPS, resume=resume, handle_signals=False, quiet=True, timeout_s=120)
    keras.utils.set_random_seed(0)  # the same initial weights in every session (a resume overwrites them)
    with ol.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
        rate = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.85)
        optimizer = keras.optimizers.Adam(rate)
    ol.wrap(model, optimizer, keras.losses.MeanSquaredError())
    loader = ol.data(*arrays())
    start, first, resumed_iterations = ol.next_step, list(ol.batches), int(optimizer.iterations.numpy())
    for epoch in range(ol.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            ol.step(x, y)
    ol.finish()
    if not ol.is_main:
        return None
    return {"start": start, "start_iterations": resumed_iterations, "end": ol.next_step, "split": first,
            "iterations": int(optimizer.iterations.numpy()), "weights": model.get_weights()}


def resumable(out: Path, run_dir: Path, step: int) -> None:
    """``out``: a run directory with ``run_dir``'s configuration and its checkpoint of ``step`` alone."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copy2(run_dir / "config.toml", out / "config.toml")
    name = f"step-{step:09d}"
    shutil.copytree(run_dir / "checkpoints" / name, out / "checkpoints" / name)


def main(jobs_path: Path) -> None:
    results = jobs_path.parent / "results"
    results.mkdir(exist_ok=True)
    for job in json.loads(jobs_path.read_text()):
        out = Path(job["out"])
        if job["resume"] is not None:
            resumable(out, Path(job["resume"][0]), int(job["resume"][1]))
        got = train(out, job["every"], job["speeds"], job["resume"] is not None)
        if got is None:
            continue
        np.savez(results / f"{job['name']}.npz", *got.pop("weights"))
        with open(results / "runs.jsonl", "a") as f:
            f.write(json.dumps({"name": job["name"], **got}) + "\n")


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder (tests/tf): its test modules would shadow any such top-level name
    main(Path(sys.argv[1]))
    sys.exit(0)
