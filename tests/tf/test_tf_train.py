"""``omnilearn train --framework tensorflow``: real TensorFlow worker processes on one ``tf.distribute`` cluster.

Three runs of the default job, made once for the module, with the recipe of the PyTorch exactness test
(``tests/dist/test_bsp.py``: global batch 256, 36 steps, a decision every 6, seed 3):

- ``tf3``: 3 TensorFlow workers at speeds 4,2,1 (delay emulation) fed
  scripted timings (``OMNILEARN_TEST_S_PER_SAMPLE``: a fixed part and a cost
  per sample per worker), so the controller's decisions are exact;
- ``pt3``: the same plan on the PyTorch runtime (gloo), fed the same timings;
- ``tf1``: one TensorFlow worker, same seed and global batch.

Two more runs resume ``tf3``'s recipe after worker 1 is killed at step 20, with a periodic checkpoint every 12
steps: the survivors save step 20 themselves (:mod:`omnilearn.tf.rescue`), so a run restarted by
``--max-restarts 1``, and one resumed on 2 workers (elastic), go on from step 20, not 12; both end with
``tf3``'s weights.

The TensorFlow runs compute in float64 (``floatx`` in a ``keras.json`` under
``KERAS_HOME``, which every worker process reads). Then: the three TensorFlow
workers, on uneven and changing batches, end with the weights of the one
worker within 1e-12 relative per weight tensor (about 1e-16 measured; the
weights ``b_i / B`` off by 1% show at 6e-3). In float32 the same check once
read 4e-4: rounding, amplified by ReLU and momentum over 36 steps, grows
past any fixed bound there and says nothing about the weighting. The slow
worker's delay emulator sleeps, the fastest's never. PyTorch and
TensorFlow take the same decisions from the same timings (the shared core).
The Keras example (``tests/examples/test_keras_tf.py``) checks that samples
move toward the fast worker through the user-facing API.

Run: ``python -m pytest -q tests/tf/test_tf_train.py``
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from needs import needs
from runfiles import raw_events

h5py = pytest.importorskip("h5py")

from omnilearn.decisions import SCRIPTED_ENV  # noqa: E402
from omnilearn.experiments.cli import main  # noqa: E402
from omnilearn.observe.metrics import read_metrics  # noqa: E402

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]
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
    """As written (a resumed run's redone steps twice); step rows by step, then rank."""
    records = raw_events(out, kind)
    return sorted(records, key=lambda e: (e["step"], e["rank"])) if kind == "step" else records


def float64_keras_home(base: Path) -> Path:
    """A ``KERAS_HOME`` whose ``keras.json`` makes Keras build float64 layers (read when a worker imports Keras)."""
    home = base / "keras-float64"
    home.mkdir()
    (home / "keras.json").write_text(json.dumps({"floatx": "float64", "epsilon": 1e-07, "backend": "tensorflow",
                                                 "image_data_format": "channels_last"}))
    return home


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("tfruns")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERAS_HOME", str(float64_keras_home(base)))  # the worker processes inherit it
        mp.setenv(SCRIPTED_ENV, SCRIPTED)
        train(base / "tf3", "--framework", "tensorflow", "--speeds", "4,2,1", *STEPS)
        train(base / "pt3", "--speeds", "4,2,1", *STEPS)
        mp.delenv(SCRIPTED_ENV)
        train(base / "tf1", "--framework", "tensorflow", "--workers", "1", "--speeds", "1", *STEPS)
    return base


def test_three_heterogeneous_tensorflow_workers_end_with_the_weights_of_one(runs):
    steps = events(runs / "tf3", "step")
    splits = {tuple(e["batch"] for e in steps if e["step"] == s) for s in range(36)}
    assert len(splits) >= 3 and {len(set(b)) for b in splits} == {2, 3}  # even first, then uneven twice
    one, three = weights(runs / "tf1"), weights(runs / "tf3")
    assert sum(a.size for a in one.values()) == 31_498  # the cnn1d's parameters, as in PyTorch
    assert {a.dtype for a in [*one.values(), *three.values()]} == {np.dtype("float64")}  # else the bound is moot
    for name, a in one.items():
        relative = np.linalg.norm(three[name] - a) / np.linalg.norm(a)
        assert relative < 1e-12, f"{name}: relative difference {relative:.2e}"


def test_the_delay_emulator_makes_the_slow_tensorflow_worker_sleep_and_never_the_fastest(runs):
    slept = {rank: [e["delay_s"] > 0 for e in events(runs / "tf3", "step") if e["rank"] == rank] for rank in (0, 2)}
    # Not every step of the slow one: it sleeps until 4x its CPU time has passed, and on a busy host a step's
    # wall time alone can exceed that (then it does not sleep; once in 36 steps was seen).
    assert len(slept[2]) == 36 and sum(slept[2]) >= 1 and not any(slept[0])


def test_pytorch_and_tensorflow_take_the_same_decisions_from_the_same_timings(runs):
    def decisions(name: str) -> list[tuple]:
        return [(e["step"], e["effective_step"], e["new"], e["changed"]) for e in events(runs / name, "decision")]

    tf, pt = decisions("tf3"), decisions("pt3")
    assert tf == pt
    # the scripted intervals last about 0.11 s, under min_window_s: after the warm-up's 4 intervals, the last of
    # them holding the plan, both runtimes stretch the window alike, so the next decision is at the run's end
    assert [step for step, *_ in tf] == [6, 12, 18, 24, 36]
    assert sum(changed for *_, changed in tf) >= 2  # the model controller refined its first split


def test_the_tensorflow_run_writes_what_a_pytorch_run_writes(runs):
    tf, pt = (json.loads((runs / name / "summary.json").read_text()) for name in ("tf3", "pt3"))
    assert set(tf) == set(pt) and tf["steps"] == pt["steps"] == 36 and tf["rebalances"] == pt["rebalances"] >= 2
    assert 0 < tf["balance_efficiency"] <= 1.5 and 0 < tf["test_accuracy"] <= 1
    assert set(tf["workers"][0]) == set(pt["workers"][0]) and len(tf["workers"]) == 3
    assert (runs / "tf3" / "config.toml").read_text().count('framework = "tensorflow"') == 1


def assert_same_weights(ran: Path, reference: Path) -> None:
    theirs, ours = weights(reference), weights(ran)
    assert set(ours) == set(theirs) and {a.dtype for a in ours.values()} == {np.dtype("float64")}
    for name, a in theirs.items():
        relative = np.linalg.norm(ours[name] - a) / np.linalg.norm(a)
        assert relative < 1e-12, f"{name}: relative difference {relative:.2e}"


def test_a_killed_worker_is_restarted_from_the_checkpoint_and_the_run_ends_with_the_uninterrupted_weights(
        runs, monkeypatch, capsys):
    """``tf3`` again with a checkpoint every 12 steps, worker 1 killed at step 20, ``--max-restarts 1``: a
    survivor saves step 20 (a crash costs one step), every worker restarts from it, trains on the same split as
    the uninterrupted run (the controller's state is in the checkpoint) and ends with its weights."""
    monkeypatch.setenv("KERAS_HOME", str(runs / "keras-float64"))
    monkeypatch.setenv(SCRIPTED_ENV, SCRIPTED)
    monkeypatch.setenv("OMNILEARN_FAULT_KILL_AT", "1:20")
    out = runs / "restarted"
    summary = train(out, "--framework", "tensorflow", "--speeds", "4,2,1", *STEPS, "--checkpoint-every", "12",
                    "--max-restarts", "1")
    err = capsys.readouterr().err
    assert "TensorFlow worker 1 failed (killed by SIGKILL)" in err and "restart 1 of 1 from the checkpoint of step 20" \
        in err, err[-3000:]
    assert [e["step"] for e in events(out, "resume")] == [20] and summary["steps"] == 36
    rescued = json.loads((out / "checkpoints" / "step-000000020" / "session.json").read_text())["rescue"]
    assert rescued["worker"] in (0, 2)
    said = [line for line in err.splitlines() if " lost a peer at step 20 " in line]  # the console, not only a log
    assert said and all(line.startswith(("omnilearn: worker 0 ", "omnilearn: worker 2 ")) for line in said), err
    assert any("saved the checkpoint of step 20" in line for line in said), said
    assert (out / "failures" / "attempt-1" / "tf-worker1.log").exists()
    splits = lambda name: [(e["step"], e["rank"], e["batch"]) for e in read_metrics(runs / name, "step")
                           if e["step"] >= 20]  # as the run stands: the redone steps once
    assert splits("restarted") == splits("tf3")  # the same split after the resume: a fixed path
    assert_same_weights(out, runs / "tf3")


def test_a_run_of_three_workers_resumes_on_two_and_ends_with_the_uninterrupted_weights(runs, monkeypatch):
    """Elastic: ``tf3`` killed at step 20 (no restart: the survivors save step 20), then ``--resume --workers 2``:
    the global batch and the samples of every step are the same, so the weights are too (float64: only the sum's
    order differs)."""
    monkeypatch.setenv("KERAS_HOME", str(runs / "keras-float64"))
    monkeypatch.setenv(SCRIPTED_ENV, SCRIPTED)
    out = runs / "elastic"
    monkeypatch.setenv("OMNILEARN_FAULT_KILL_AT", "1:20")
    assert main(["train", "--out", str(out), "--framework", "tensorflow", "--speeds", "4,2,1", *STEPS,
                 "--checkpoint-every", "12"]) == 1
    monkeypatch.delenv("OMNILEARN_FAULT_KILL_AT")
    monkeypatch.setenv(SCRIPTED_ENV, "0.01:0.0001,0.0004")
    summary = train(out, "--framework", "tensorflow", "--resume", "--workers", "2", "--speeds", "2,1")
    assert [(e["step"], e["workers"], e["from_workers"]) for e in events(out, "resume")] == [(20, 2, 3)]
    assert summary["steps"] == 36 and {e["rank"] for e in events(out, "step") if e["step"] >= 30} == {0, 1}
    assert_same_weights(out, runs / "tf3")


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
