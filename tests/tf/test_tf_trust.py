"""The Keras/TensorFlow door fails loudly or works, never silently: mixed precision, ``None`` gradients, a resumed
model that changed, the order of ``setup()``, a failed checkpoint write, a crash mid-commit.

Real TensorFlow processes (this file run as ``python tests/tf/test_tf_trust.py SCENARIO OUT``, as
``tests/tf/test_tf_fit.py`` runs itself), each part writing ``OUT/<part>.json`` (its traceback if it failed):

- ``one`` (one worker, one process for three parts): under ``mixed_float16`` ``ol.fit`` trains a regression to
  Keras ``fit``'s loss on the same data (the loss scaled before the gradient); a model with a weight its loss
  does not reach trains, that weight untouched, Keras' warning naming it; a checkpoint resumed into a model with
  one more layer is refused naming the new variables, with another seed refused naming both seeds and the
  ``omnilearn.tf.setup`` keyword, and into the same model resumes at its step;
- ``order``: a ``tf.data`` pipeline built before ``omnilearn.tf.setup()``: one ``ConfigError`` naming the order;
- ``full``: two workers, worker 0's checkpoint write raising ``ENOSPC``: both end, naming worker 0 and the
  error (the collective timeout is 300 s: reaching the end of the test at all is the proof).

In this process: :func:`omnilearn.tf.checkpointing.check_resume` of a stand-in session refuses a checkpoint of
another seed, data size or global batch in one line naming both values and the fix, and warns on one saved
before the data basis was.

Run: ``python -m pytest -q tests/tf/test_tf_trust.py``
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest

FEATURES, SAMPLES, BATCH = 8, 512, 64


def regression():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    return x, (x @ rng.normal(size=(FEATURES, 1)) + 3.0).astype("float32")


def mixed_precision(out: Path) -> None:
    """Keras ``fit`` and ``ol.fit``, the same model, data and steps, under ``mixed_float16``."""
    import keras

    import omnilearn.tf

    ol = omnilearn.tf.setup(global_batch=BATCH, seed=1, quiet=True)
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = regression()

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    keras_loss = build().fit(x, y, batch_size=BATCH, epochs=8, verbose=0).history["loss"]
    with ol.scope():
        model = build()
    ol_loss = ol.fit(model, x, y, epochs=8, verbose=0).history["loss"]
    keras.mixed_precision.set_global_policy("float32")
    return {"keras": keras_loss, "ol": ol_loss, "optimizer": type(model.optimizer).__name__}


def unreached_weight(out: Path) -> None:
    """A layer with a weight its output never uses: its gradient is None."""
    import keras

    import omnilearn.tf

    class Spare(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 1), initializer="zeros")
            self.spare = self.add_weight(shape=(1,), initializer="ones", name="spare")

        def call(self, x):
            return x @ self.w

    ol = omnilearn.tf.setup(global_batch=BATCH, seed=1, quiet=True)
    x, y = regression()
    with ol.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), Spare()])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        loss = ol.fit(model, x, y, epochs=2, verbose=0).history["loss"]
    return {"loss": loss, "spare": model.layers[0].spare.numpy().tolist(),
            "warned": [str(w.message) for w in said if "Gradients do not exist" in str(w.message)]}


def resume_changed(out: Path) -> None:
    """Train 8 steps with checkpoints; resume into a model with one more layer (refused), then the same model."""
    import keras

    import omnilearn.tf
    from omnilearn.config import ConfigError

    x, y = regression()

    def session(extra: bool, resume: bool, seed: int = 1):
        ol = omnilearn.tf.setup(global_batch=BATCH, seed=seed, quiet=True, out=str(out / "run"), control_interval=4,
                                total_steps=8, checkpoint_every=4, resume=resume, overwrite=not resume)
        keras.utils.set_random_seed(0)
        with ol.scope():
            layers = [keras.layers.Dense(4, name="hidden")] + ([keras.layers.Dense(4, name="added")] if extra else [])
            model = keras.Sequential([keras.Input((FEATURES,)), *layers, keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        ol.wrap(model, optimizer, keras.losses.MeanSquaredError())
        return ol, ol.data(x, y), model

    ol, loader, model = session(extra=False, resume=False)
    for xb, yb in loader:
        ol.step(xb, yb)
    ol.finish()
    trained = [w.tolist() for w in model.get_weights()]
    try:
        session(extra=True, resume=True)
        refused = None
    except ConfigError as e:
        refused = str(e)
    try:
        session(extra=False, resume=True, seed=2)
        seed_refused = None
    except ConfigError as e:
        seed_refused = str(e)
    ol, _, model = session(extra=False, resume=True)
    return {"refused": refused, "seed_refused": seed_refused, "next_step": ol.next_step,
            "same": all(np.array_equal(a, b) for a, b in zip(trained, model.get_weights()))}


def setup_after_tf_data(out: Path) -> None:
    import tensorflow as tf

    import omnilearn.tf
    from omnilearn.config import ConfigError

    tf.data.Dataset.from_tensor_slices(regression())  # starts TensorFlow's runtime
    try:
        omnilearn.tf.setup(global_batch=BATCH)
        said = None
    except ConfigError as e:
        said = str(e)
    return {"said": said}


def full_disk_on_worker_0(out: Path) -> None:
    """Two workers checkpointing every 3 steps; worker 0's ``session.json`` write raises ENOSPC."""
    import keras

    import omnilearn.tf
    import omnilearn.commit as commit
    from omnilearn.tf.cluster import from_env

    def full(path, _write):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    if from_env().rank == 0:
        commit.write_atomic = full  # the commit mark's write (omnilearn.commit.commit_directory)
    x, y = regression()
    ol = omnilearn.tf.setup(global_batch=16, seed=1, quiet=True, out=str(out / "run"), control_interval=3,
                            total_steps=12, checkpoint_every=3, timeout_s=300)
    with ol.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.01)
    ol.wrap(model, optimizer, keras.losses.MeanSquaredError())
    for xb, yb in ol.data(x, y):
        ol.step(xb, yb)
    ol.finish()


SCENARIOS = {"one": (mixed_precision, unreached_weight, resume_changed), "order": (setup_after_tf_data,),
             "full": (full_disk_on_worker_0,)}

if __name__ == "__main__":
    out = Path(sys.argv[2])
    for part in SCENARIOS[sys.argv[1]]:
        try:
            said = part(out)
        except Exception:  # the next parts still run; the test of this one shows the traceback
            said = {"error": traceback.format_exc()}
            if sys.argv[1] == "full":
                raise
        (out / f"{part.__name__}.json").write_text(json.dumps(said))
    sys.stdout.flush()
    os._exit(0)

from needs import needs  # noqa: E402  (in tests/: not importable where this file runs as a worker)
from omnilearn.tf.cluster import free_ports, local_config  # noqa: E402

pytestmark = needs("tensorflow", "tensorflow")
SAFETY_S = float(os.environ.get("OMNILEARN_TEST_SAFETY_S", "240"))  # a net against a hang, not a measure


def run(scenario: str, out: Path, workers: int = 1) -> list[subprocess.CompletedProcess]:
    """``workers`` processes of this file with their ``TF_CONFIG``; their outcomes."""
    out.mkdir(exist_ok=True)
    ports = free_ports(workers)
    procs = [subprocess.Popen([sys.executable, __file__, scenario, str(out)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                                   "TF_CONFIG": local_config(ports, rank) if workers > 1 else ""})
             for rank in range(workers)]
    done = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=SAFETY_S)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:  # a worker left waiting in a collective: the test failed; end it
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one")
    (done,) = run("one", out)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def read(out: Path, part: str) -> dict:
    said = json.loads((out / f"{part}.json").read_text())
    assert "error" not in said, said.get("error")
    return said


@pytest.mark.dist
def test_mixed_float16_trains_to_keras_fits_loss(one):
    said = read(one, "mixed_precision")
    assert said["optimizer"] == "LossScaleOptimizer"  # compile wrapped it: the policy is on
    first, keras_final, ol_final = said["keras"][0], said["keras"][-1], said["ol"][-1]
    assert keras_final < 0.01 * first  # Keras' own fit learns this
    assert ol_final < max(3 * keras_final, 0.01 * first), said  # before the fix: no better than the first epoch


@pytest.mark.dist
def test_a_weight_the_loss_does_not_reach_is_left_out_with_keras_warning(one):
    said = read(one, "unreached_weight")
    assert said["loss"][-1] < 0.8 * said["loss"][0] and said["spare"] == [1.0]  # trained (no bias: not to 0)
    assert said["warned"] and "spare" in said["warned"][0]


@pytest.mark.dist
def test_resuming_a_changed_model_is_refused_and_the_same_model_resumes(one):
    said = read(one, "resume_changed")
    refused = said["refused"]
    assert refused is not None and "\n" not in refused
    assert "was saved from another model (4 variables, 6 now)" in refused and "added/kernel" in refused, refused
    assert said["next_step"] == 8 and said["same"]


@pytest.mark.dist
def test_resuming_with_another_seed_is_refused_naming_both_and_the_keyword(one):
    said = read(one, "resume_changed")["seed_refused"]
    assert said is not None and "\n" not in said, said  # before the fix: resumed, reading other samples
    assert "saved with seed 1 but this run has seed 2" in said and "seed=1 (omnilearn.tf.setup keyword" in said, said


class Planned:
    """A stand-in session: what :func:`omnilearn.tf.checkpointing.check_resume` reads."""

    def __init__(self, samples: int = SAMPLES, seed: int = 1) -> None:
        from omnilearn.data.schedule import GlobalPlan

        self.global_batch, self.plan = BATCH, GlobalPlan(samples, BATCH, seed)


def saved_state(**changed) -> dict:
    from omnilearn.data.position import basis
    from omnilearn.tf.checkpointing import FORMAT

    return {"format": FORMAT, "global_batch": BATCH, "data": basis(Planned(**changed).plan)}


@pytest.mark.parametrize("changed, says", [
    ({"seed": 2}, "saved with seed 2 but this run has seed 1"),
    ({"samples": 2 * SAMPLES}, f"saved with data size {2 * SAMPLES} but this run has data size {SAMPLES}")])
def test_a_resume_whose_data_differs_is_one_line_naming_both_and_the_fix(changed, says):
    from omnilearn.config import ConfigError
    from omnilearn.tf.checkpointing import check_resume

    with pytest.raises(ConfigError) as refused:
        check_resume(Planned(), saved_state(**changed))
    said = str(refused.value)
    assert "\n" not in said and says in said and "(omnilearn.tf.setup keyword; omnilearn train --" in said, said
    assert "omnilearn.setup keyword" not in said


def test_a_resume_of_another_global_batch_names_the_keyword():
    from omnilearn.config import ConfigError
    from omnilearn.tf.checkpointing import check_resume

    state = {**saved_state(), "global_batch": 2 * BATCH}
    with pytest.raises(ConfigError, match=rf"global_batch={2 * BATCH} \(omnilearn.tf.setup keyword; "
                                          rf"omnilearn train --global-batch {2 * BATCH}\)"):
        check_resume(Planned(), state)


def test_the_same_data_resumes_and_an_old_checkpoint_without_a_basis_warns():
    from omnilearn.tf.checkpointing import UnverifiedResumeWarning, check_resume

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_resume(Planned(), saved_state())
    old = saved_state()
    del old["data"]
    with pytest.warns(UnverifiedResumeWarning, match="predates the data checks"):
        check_resume(Planned(), old)


@pytest.mark.dist
def test_setup_after_a_tf_data_pipeline_names_the_order(tmp_path):
    (done,) = run("order", tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    said = read(tmp_path, "setup_after_tf_data")["said"]
    assert said and "\n" not in said and "call omnilearn.tf.setup() before building tf.data pipelines or models" in said


@pytest.mark.dist
def test_a_failed_checkpoint_write_on_worker_0_ends_every_worker_naming_it(tmp_path):
    done = run("full", tmp_path, workers=2)
    for rank, d in enumerate(done):
        assert d.returncode != 0, f"worker {rank} went on:\n{d.stderr[-3000:]}"
        last = d.stderr.strip().splitlines()[-1]
        assert "CheckpointFailed: worker 0 could not write checkpoint" in last, d.stderr[-3000:]
        assert "No space left on device (errno 28)" in last, last
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))  # nothing half-written
    assert not list((tmp_path / "run" / "checkpoints").glob(".step-*"))
