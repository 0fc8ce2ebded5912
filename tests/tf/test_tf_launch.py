"""``omnilearn launch``: a user's own TensorFlow script started as local workers, watched like ``omnilearn train``.

- ``examples/keras_tf.py`` launched with ``--workers 2 --speeds 2,1 --out DIR`` (the script gives neither):
  each worker gets its ``TF_CONFIG`` and the launcher's settings, worker 0's output is the console, every
  worker's stderr is in ``DIR/tf-worker<R>.log``; the run balances (scripted timings) and learns.
- A worker that fails stops the others (one that would wait for ever is ended): exit 1 and one line naming it with
  its log's last line. Nothing is timed: a launch that hangs meets the subprocess's generous guard.
- In-process: a script's own ``speeds`` that disagrees with ``--speeds`` is one line; bad launches (bad
  speeds, counts, paths; a PyTorch script: torchrun) are one line and exit 2 before any worker starts.

Run: ``python -m pytest -q tests/tf/test_tf_launch.py``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from needs import needs

from omnilearn.config import ConfigError
from omnilearn.experiments.cli import main
from omnilearn.keywords import LAUNCH_ENV, launched

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests", "tf"))
from runexample import assert_balanced_and_learning, scripted_timings  # noqa: E402


def launch(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnilearn", "launch", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})


def test_a_launched_keras_script_balances_learns_and_logs_per_worker(tmp_path):
    out = tmp_path / "run"
    done = launch("--workers", "2", "--speeds", "2,1", "--out", str(out), "examples/keras_tf.py", "--epochs", "3",
                  env=scripted_timings("2,1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = assert_balanced_and_learning(out)  # the launcher's --speeds and --out reached the script
    assert summary["rebalances"] >= 1 and summary["declared_speeds"] == [2.0, 1.0]
    assert "omnilearn: 2 TensorFlow workers of examples/keras_tf.py --epochs 3" in done.stdout
    assert "epoch 2: test loss" in done.stdout  # worker 0's output is the console
    assert (out / "tf-worker0.log").exists() and (out / "tf-worker1.log").exists()


FAILING = """
import json, os, sys, time
from omnilearn.experiments.launch import netns
if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
    while not os.path.exists(sys.argv[2]):  # worker 0 has said what network it sees
        time.sleep(0.05)
    sys.exit("omnilearn: error: worker 1 could not read its data")
with open(sys.argv[2] + ".part", "w") as f:
    f.write(" ".join(netns.interfaces()))
os.replace(sys.argv[2] + ".part", sys.argv[2])
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(100000)  # worker 0 would wait for it in the cluster for ever: only the launcher ends it
"""
HANG_GUARD_S = 300  # only a launch that hangs takes this long: never a measure of speed


def _gone(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.parametrize("network", ["private", "host"])
def test_a_failing_worker_stops_the_others_and_is_named(tmp_path, network):
    """Also: the workers see the network ``--network`` gives them: loopback only (private, the default: their
    TensorFlow servers bind every interface), or the machine's, said in one line."""
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    done = launch("--workers", "2", "--network", network, "--out", str(tmp_path / "run"), str(script),
                  str(tmp_path / "pid0"), str(tmp_path / "net0"), timeout=HANG_GUARD_S)
    assert done.returncode == 1, done.stderr[-3000:]
    seen = (tmp_path / "net0").read_text().split()
    assert (seen == ["lo"]) == (network == "private") and "lo" in seen, seen
    said = "omnilearn: this run's TensorFlow servers listen on every interface (--network host)"
    assert (said in done.stderr) == (network == "host"), done.stderr[-3000:]
    assert not (tmp_path / "pid0").exists() or _gone(int((tmp_path / "pid0").read_text()))  # worker 0 was stopped
    assert done.stderr.strip().splitlines()[-1] == (
        f"omnilearn: error: TensorFlow worker 1 failed (exit 1): worker 1 could not read its data "
        f"(log: {tmp_path / 'run' / 'tf-worker1.log'})")


NEVER_JOINS = """
import json, os, time
if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
    time.sleep(100000)  # stuck before it joins: never reaches setup(); only the launcher ends it
import omnilearn.tf
omnilearn.tf.setup(global_batch=8)
"""


def test_a_worker_that_never_joins_is_named_after_the_timeout(tmp_path):
    script = tmp_path / "never.py"
    script.write_text(NEVER_JOINS)
    done = launch("--workers", "2", "--timeout-s", "6", "--out", str(tmp_path / "run"), str(script),
                  timeout=HANG_GUARD_S)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("omnilearn: error: TensorFlow worker 0 failed (killed by SIGKILL): worker 0: worker 1 "
                           "(localhost:"), last  # its watcher ended it: TensorFlow held the GIL, waiting
    assert "did not join the TensorFlow cluster within 6 s; start it with its TF_CONFIG (task index 1)" in last


BACKUP_FIT = """
import json, os, signal, sys
from pathlib import Path
import keras, numpy as np
import omnilearn.tf

out = Path(sys.argv[1])
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 12))
y = np.argmax(x @ rng.normal(size=(12, 4)), axis=1)
ol = omnilearn.tf.setup(global_batch=64, control_interval=4, seed=3)
keras.utils.set_random_seed(0)
with ol.scope():
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


class DieOnce(keras.callbacks.Callback):  # worker 1 is killed at step 14, once
    def on_train_batch_end(self, batch, logs=None):
        if ol.rank == 1 and ol.next_step == 14 and not (out / "died").exists():
            (out / "died").write_text("")
            os.kill(os.getpid(), signal.SIGKILL)


history = ol.fit(model, x, y, epochs=4, callbacks=[
    keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.8 if epoch else rate),  # from the current
    keras.callbacks.BackupAndRestore(str(out / "backup"), save_freq=4),
    keras.callbacks.CSVLogger(str(out / "log.csv"), append=True), DieOnce()])
if ol.is_main:
    (out / "history.json").write_text(json.dumps({"epoch": history.epoch, "loss": history.history["loss"]}))
    np.savez(out / "weights.npz", *model.get_weights())
"""


def test_a_keras_fit_with_backup_and_restore_survives_a_killed_worker(tmp_path):
    """``fit`` with Keras' ``BackupAndRestore(save_freq=4)`` on 2 launched workers (float64), worker 1 killed at
    step 14, ``--max-restarts 1``: the survivor saves step 14 into the backup directory (a crash costs one step;
    the last backup was step 12), every worker restarts, the fit resumes at step 14 (epoch 1, batch 6: 8 steps an
    epoch) and ends with the weights of one uninterrupted process (the same script, no kill); the backup is
    removed at the end, as Keras removes it. A ``LearningRateScheduler`` that scales the current rate runs in the
    resumed epoch's ``on_epoch_begin`` again: the checkpoint's rate is put back after it (else it scaled twice,
    5e-2 off: issue 50)."""
    from test_tf_train import float64_keras_home

    script, out, alone = tmp_path / "backup_fit.py", tmp_path / "run", tmp_path / "alone"
    script.write_text(BACKUP_FIT)
    home = {"KERAS_HOME": str(float64_keras_home(tmp_path))}
    alone.mkdir()
    (alone / "died").write_text("")
    solo = subprocess.run([sys.executable, str(script), str(alone)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **home, "TF_CONFIG": ""})
    assert solo.returncode == 0, solo.stderr[-3000:]
    out.mkdir()
    done = launch("--workers", "2", "--speeds", "2,1", "--max-restarts", "1", "--out", str(out), str(script),
                  str(out), env=home)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TensorFlow worker 1 failed (killed by SIGKILL)" in done.stderr and "restart 1 of 1" in done.stderr
    assert "resumed at step 14 with 2 workers" in done.stdout
    history = json.loads((out / "history.json").read_text())
    assert history["epoch"] == [1, 2, 3] and not (out / "backup").exists()
    with np.load(alone / "weights.npz") as a, np.load(out / "weights.npz") as b:
        for name in a.files:
            assert a[name].dtype == np.float64
            relative = np.linalg.norm(b[name] - a[name]) / np.linalg.norm(a[name])
            assert relative < 1e-12, f"{name}: relative difference {relative:.2e}"


def test_launch_settings_fill_the_script_and_a_disagreement_is_one_line(capsys, tmp_path):
    env = {LAUNCH_ENV: '{"speeds": "3,1", "out": "runs/x"}'}
    assert launched({"global_batch": 8, "out": None}, env) == {"global_batch": 8, "speeds": "3,1", "out": "runs/x"}
    assert launched({"speeds": "3,1"}, env)["speeds"] == "3,1"
    with pytest.raises(ConfigError, match=r"speeds='2,1' in the script, but omnilearn launch --speeds 3,1: give it "
                                          r"in one place"):
        launched({"speeds": "2,1"}, env)
    assert launched({"speeds": "2,1"}, {}) == {"speeds": "2,1"}
    (tmp_path / "s.py").write_text("")
    for argv, said in ((["--framework", "pytorch", "x.py"], "a PyTorch script is started by torchrun"),
                       (["missing.py"], "script 'missing.py' is not a file"),
                       (["--workers", "3", "--speeds", "3,1", str(tmp_path / "s.py")], "--speeds 3,1 has 2 entries"),
                       (["--workers", "3", "--speeds", "HL8", str(tmp_path / "s.py")], "--speeds HL8 has 4 entries"),
                       (["--speeds", "0,1", str(tmp_path / "s.py")], "speed 0 in '0,1' must be a positive number"),
                       (["--speeds", "HL9", str(tmp_path / "s.py")], "unknown heterogeneity level 'HL9'"),
                       (["--workers", "0", str(tmp_path / "s.py")], "--workers 0: give at least 1")):
        assert main(["launch", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("omnilearn: error: ") and said in err and err.count("\n") == 1, err
