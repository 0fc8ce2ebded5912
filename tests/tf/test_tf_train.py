"""``omnilearn train --framework tensorflow``: real TensorFlow worker processes on one ``tf.distribute`` cluster.

Three runs of the default job, made once for the module, with the recipe of the PyTorch exactness test
(``tests/dist/test_bsp.py``: global batch 256, 36 steps, a decision every 6, seed 3):

- ``tf3``: 3 TensorFlow workers at speeds 4,2,1 (delay emulation) fed
  scripted timings (``OMNILEARN_TEST_S_PER_SAMPLE``: a fixed part and a cost
  per sample per worker), so the controller's decisions are exact;
- ``pt3``: the same plan on the PyTorch runtime (gloo), fed the same timings;
- ``tf1``: one TensorFlow worker, same seed and global batch.

Then: the three TensorFlow workers, on uneven and changing batches, end
with the weights of the one worker (relative < 1e-5 per weight tensor, as
in PyTorch; about 1e-7 measured); PyTorch and
TensorFlow take the same decisions from the same timings (the shared core).
On measured timings, the example ``tests/examples/test_keras_tf.py`` checks
that samples move toward the fast worker.

Run: ``python -m pytest -q tests/tf/test_tf_train.py``
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorflow", reason="the [tensorflow] extra is not installed")
h5py = pytest.importorskip("h5py")

from omnilearn.decisions import SCRIPTED_ENV  # noqa: E402
from omnilearn.experiments.cli import main  # noqa: E402

pytestmark = pytest.mark.dist
STEPS = ("--global-batch", "256", "--max-steps", "36", "--control-interval", "6", "--seed", "3", "--no-plots")
SCRIPTED = "0.01:0.0001,0.005:0.0002,0.0004"  # worker 2 slowest per sample, workers 0 and 1 with more fixed cost


def train(out: Path, *flags: str) -> dict:
    assert main(["train", "--out", str(out), *flags]) == 0
    return json.loads((out / "summary.json").read_text())


def weights(out: Path) -> dict[str, np.ndarray]:
    """Every array of ``model.weights.h5`` by its name."""
    arrays: dict[str, np.ndarray] = {}
    with h5py.File(out / "model.weights.h5", "r") as f:
        f.visititems(lambda name, obj: arrays.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return arrays


def events(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("tfruns")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SCRIPTED_ENV, SCRIPTED)
        train(base / "tf3", "--framework", "tensorflow", "--speeds", "4,2,1", *STEPS)
        train(base / "pt3", "--speeds", "4,2,1", *STEPS)
    train(base / "tf1", "--framework", "tensorflow", "--workers", "1", "--speeds", "1", *STEPS)
    return base


def test_three_heterogeneous_tensorflow_workers_end_with_the_weights_of_one(runs):
    steps = events(runs / "tf3", "step")
    splits = {tuple(e["batch"] for e in steps if e["step"] == s) for s in range(36)}
    assert len(splits) >= 3 and {len(set(b)) for b in splits} == {2, 3}  # even first, then uneven twice
    assert {e["delay_s"] > 0 for e in steps if e["rank"] == 2} == {True}  # the slow worker really slept
    one, three = weights(runs / "tf1"), weights(runs / "tf3")
    assert sum(a.size for a in one.values()) == 31_498  # the cnn1d's parameters, as in PyTorch
    for name, a in one.items():
        relative = np.linalg.norm(three[name] - a) / np.linalg.norm(a)
        assert relative < 1e-5, f"{name}: relative difference {relative:.2e}"


def test_pytorch_and_tensorflow_take_the_same_decisions_from_the_same_timings(runs):
    def decisions(name: str) -> list[tuple]:
        return [(e["step"], e["effective_step"], e["new"], e["changed"]) for e in events(runs / name, "decision")]

    tf, pt = decisions("tf3"), decisions("pt3")
    assert tf == pt
    assert sum(changed for *_, changed in tf) >= 2  # the model controller refined its first split


def test_the_tensorflow_run_writes_what_a_pytorch_run_writes(runs):
    tf, pt = (json.loads((runs / name / "summary.json").read_text()) for name in ("tf3", "pt3"))
    assert set(tf) == set(pt) and tf["steps"] == pt["steps"] == 36 and tf["rebalances"] == pt["rebalances"] >= 2
    assert 0 < tf["balance_efficiency"] <= 1.5 and 0 < tf["test_accuracy"] <= 1
    assert set(tf["workers"][0]) == set(pt["workers"][0]) and len(tf["workers"]) == 3
    assert (runs / "tf3" / "config.toml").read_text().count('framework = "tensorflow"') == 1



def test_workers_started_by_hand_with_their_own_tf_config_make_one_run(tmp_path):
    """As on several machines: each worker runs ``omnilearn train`` with its own TF_CONFIG; worker 0 writes the run."""
    import os
    import subprocess
    import sys

    from omnilearn.tf.cluster import free_ports, local_config

    out, ports = tmp_path / "run", free_ports(2)
    cmd = [sys.executable, "-m", "omnilearn", "train", "--framework", "tensorflow", "--workers", "2", "--speeds", "2,1",
           "--max-steps", "20", "--control-interval", "5", "--out", str(out), "--no-plots"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TF_CONFIG": local_config(ports, rank)}) for rank in range(2)]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[1][1][-3000:] + outputs[0][1][-3000:]
    assert "balance efficiency" in outputs[0][0] and outputs[1][0].strip() == ""  # worker 0 speaks
    assert json.loads((out / "summary.json").read_text())["steps"] == 20
