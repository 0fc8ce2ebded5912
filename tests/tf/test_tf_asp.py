"""TensorFlow ASP, part one (:mod:`omnilearn.tf.asp`): real ``tf.distribute.Server`` processes, the chief in a third.

Each run is ``tests/tf/asp_chief_script.py``: one parameter server and the workers as processes of their own, the
chief (the coordinator) in the script's, a float64 MLP on 256 synthetic samples, plain SGD. The script runs
forked from one process per module that imported TensorFlow (the ``forks`` fixture), and forks its servers: a
run imports nothing.

- Three workers declared at speeds 1, 2, 3 (``static``: batches 16, 32, 48; the delay emulator slows workers
  0 and 1), ``max_staleness=0``: every sample of both epochs applied exactly once, the server's ``version``
  equal to the pushes the chief applied, every variable (model and optimizer) on the parameter server, and
  every push applied above the bound was one recomputed after a refusal.
- One worker, global batch 48 (5 pushes of 48 and one of 16 an epoch): the final weights are those of a local
  replay of the same pushes in order, each gradient scaled by ``b / 48`` (1e-12): the worker sends gradients,
  the chief applies them at the push's own rate.
- Two workers declared equal, scripted timings with worker 1 three times slower a sample, the ``model``
  controller every 2 x 2 pushes: the batches move to worker 0 until both push at the same rate (48 and 16), and
  the gradient function is traced once per worker whatever the batch.
- Two workers at 16 and 48, worker 1's server SIGKILLed once 5 pushes were applied and both workers had
  answered: the chief drops it and worker 0 ends the run (at most worker 1's one call already back is applied
  after the kill); no sample is lost or repeated and no push is applied that the chief did not count (a call of
  worker 0 that failed with its peer is sent again).
- The same, worker 1's server stopped (SIGSTOP) instead: its call not back within ``heartbeat_s``, it is dropped
  the same way and worker 0 ends the run.

- ``omnilearn train --framework tensorflow --mode asp`` (2 workers, ``mlp``, 30 steps of 2 pushes): the
  launcher's parameter server, workers and chief; ``summary.json`` holds each worker's staleness quantiles, the
  pushes end at ``--max-steps x --workers`` and the model learned (test accuracy above chance).

Not yet built (docs/tensorflow.md): checkpoints and resume, several machines.

Run: ``python -m pytest -q tests/tf/test_tf_asp.py``
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from needs import needs

from omnilearn.decisions import SCRIPTED_ENV
from omnilearn.experiments.launch.tfforks import ForkServer

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]
SCRIPT = Path(__file__).with_name("asp_chief_script.py")


HANG_GUARD_S = 600  # only a hung run gets here: never a measure of speed


@pytest.fixture(scope="module")
def forks(tmp_path_factory) -> Iterator[ForkServer]:
    """One process that imported TensorFlow, Keras and the chief for the module's runs: each chief is forked from
    it, and forks its servers (asp_chief_script.fork_server), so a run imports nothing."""
    log = tmp_path_factory.mktemp("forks") / "server.log"
    with ForkServer(dict(os.environ), log, [sys.executable, str(SCRIPT)],
                    preload=("tensorflow", "keras", "omnilearn.tf.asp")) as server:
        yield server


def chief(forks: ForkServer, out: Path, *args: str, env: dict[str, str] | None = None) -> tuple[dict, dict]:
    out.mkdir()
    rank = len(forks.pids)  # a new number each run
    proc = forks.start(rank, [str(SCRIPT), str(out), *args], {**os.environ, **(env or {})}, out / "chief.log",
                       console=False)
    end = time.monotonic() + HANG_GUARD_S
    while proc.poll() is None:
        if time.monotonic() > end:
            proc.kill()
        forks.pump(wait_s=0.05)
    assert proc.returncode == 0, (out / "chief.log").read_text()[-3000:]
    return json.loads((out / "summary.json").read_text()), dict(np.load(out / "weights.npz"))


def every_sample_once(summary: dict, epochs: int = 2) -> None:
    assert summary["coverage"]["samples_per_epoch"] == [256] * epochs
    assert summary["coverage"]["repeated_samples"] == 0
    assert summary["coverage"]["complete_epochs"] == list(range(epochs))
    assert summary["version"] == summary["applied"] == sum(summary["pushes"]) == len(summary["order"])


def test_three_workers_apply_every_sample_once_within_the_bound(forks, tmp_path):
    summary, _ = chief(forks, tmp_path / "run", "3", "96", "1,2,3", "static", "2", "1")
    every_sample_once(summary)
    assert summary["variable_devices"] == ["/job:ps/replica:0/task:0/device:CPU:0"]
    assert not summary["dropped"]
    for worker, _, indices, _, stale, recomputed in summary["order"]:
        assert len(indices) <= (16, 32, 48)[worker]  # an epoch's last deal may be short
        assert stale <= 1 or recomputed  # above max_staleness 1 only after one refusal
    assert sum(summary["staleness"]["refused"]) == sum(r for *_, r in summary["order"])


@pytest.mark.parametrize("scaling", ["linear", "none"])
def test_one_worker_ends_with_the_weights_of_a_local_replay_of_its_scaled_gradients(forks, tmp_path, scaling):
    summary, weights = chief(forks, tmp_path / "run", "1", "48", "1", "static", "2", "none",
                             env={"ASP_LR_SCALING": scaling})
    every_sample_once(summary)
    sys.path.insert(0, str(SCRIPT.parent))
    import asp_chief_script as script
    import tensorflow as tf

    model = script.build()
    for v, w in zip(model.weights, [weights[f"initial{i}"] for i in range(len(model.weights))]):
        v.assign(w)
    x, y = script.data()
    lr = float(np.float32(script.LR))  # Keras keeps the rate in a float32 variable
    assert sorted({len(indices) for _, _, indices, *_ in summary["order"]}) == [16, 48]
    for _, _, indices, _, stale, _ in summary["order"]:
        assert stale == 0
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(script.loss(y[indices], model(x[indices], training=True)))
        for v, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
            scale = len(indices) / 48 if scaling == "linear" else 1.0  # the chief scales the gradient (b / b_ref)
            v.assign(v - lr * (scale * g))  # and SGD applies its rate
    for i, v in enumerate(model.weights):
        final = weights[f"final{i}"]
        assert np.abs(v.numpy() - final).max() <= 1e-12 * max(1.0, np.abs(final).max()), v.path


def test_the_controller_moves_samples_to_the_worker_that_pushes_faster(forks, tmp_path):
    summary, _ = chief(forks, tmp_path / "run", "2", "64", "1,1", "model", "3", "none",
                       env={SCRIPTED_ENV: "0.0001,0.0003", "ASP_INTERVAL": "2"})
    every_sample_once(summary, epochs=3)
    assert summary["decisions"] and sum(summary["batches"]) == 64
    fast, slow = summary["batches"]  # pushing at the same rate: equal scripted cycles, to one slow sample
    assert abs(fast * 0.0001 - slow * 0.0003) <= 0.0003, summary["decisions"]
    assert summary["traces"] <= 2  # the gradient function traced once per worker, not per batch


def test_a_killed_worker_loses_no_sample_and_no_push_is_applied_twice(forks, tmp_path):
    # 4 epochs: samples are left to deal to worker 1 after its kill at 5 pushes, so its death is always seen (with
    # 2, a loaded machine could deal the last ones to worker 0 first: the run ended with nobody dropped)
    summary, _ = chief(forks, tmp_path / "run", "2", "64", "1,3", "static", "4", "none", "1", "5")
    every_sample_once(summary, epochs=4)
    assert list(summary["dropped"]) == ["1"] and "Error" in summary["dropped"]["1"]
    # killed once 5 pushes were applied and both workers had answered (worker 1 pushed 10 times before worker 0's
    # first answer at 87% of a loaded whole-suite run); after the kill at most its one call already back is applied
    who = [push[0] for push in summary["order"]]
    killed_at = next(n for n in range(5, len(who) + 1) if {0, 1} <= set(who[:n]))
    assert summary["pushes"] == [who.count(0), who.count(1)] and who[killed_at:].count(1) <= 1, (killed_at, who)
    assert summary["batches"] == [64, 0]  # its share went to worker 0


def test_a_hung_worker_is_dropped_after_its_heartbeat_and_its_samples_dealt_again(forks, tmp_path):
    # worker 1's server is stopped (SIGSTOP: alive, never answering) once both answered and 5 pushes were
    # applied; its call in flight, or its next, is not back within --heartbeat-s 4: dropped as a dead one is
    summary, _ = chief(forks, tmp_path / "run", "2", "64", "1,3", "static", "4", "none", "1", "5",
                       env={"ASP_SIGNAL": "STOP", "ASP_HEARTBEAT_S": "4"})
    every_sample_once(summary, epochs=4)
    assert list(summary["dropped"]) == ["1"] and "no answer for" in summary["dropped"]["1"], summary["dropped"]
    assert summary["batches"] == [64, 0]


def test_omnilearn_train_runs_tensorflow_asp_and_writes_the_staleness_per_worker(tmp_path, capfd):
    from omnilearn.experiments.cli import main

    out = tmp_path / "run"
    code = main(["train", "--framework", "tensorflow", "--mode", "asp", "--workers", "2", "--model", "mlp",
                 "--max-steps", "30", "--lr", "0.2", "--out", str(out), "--no-plots"])
    said = capfd.readouterr().out  # the chief's line comes from its own process
    assert code == 0, said
    summary = json.loads((out / "summary.json").read_text())  # the PyTorch server's fields (observe.asplog)
    assert (summary["mode"], summary["framework"], len(summary["workers"])) == ("asp", "tensorflow", 2)
    assert sum(summary["pushes"]) == summary["updates"] == 60
    for w in summary["workers"]:
        assert w["updates"] >= 1 and w["p50_staleness"] <= w["p99_staleness"] <= w["max_staleness"]
    assert summary["repeated_samples"] == 0 and summary["test_accuracy"] > 0.2  # chance: 0.1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    pushes = [r for r in records if r["event"] == "push"]
    assert [p["version"] for p in pushes] == list(range(1, 61))  # one record per applied push, in order
    evals = [r for r in records if r["event"] == "eval"]
    assert [e["epoch"] for e in evals][:1] == [0] and evals[-1]["version"] == 60  # after epoch 0, and at the end
    assert (out / "model.weights.h5").exists()
    assert "staleness mean" in said and "writes no checkpoints yet" in said


def test_the_asp_bench_runs_its_two_arms_on_tensorflow_for_the_time_budget(tmp_path, capfd):
    from omnilearn.experiments.cli import main

    out = tmp_path / "bench"
    code = main(["bench", "--mode", "asp", "--framework", "tensorflow", "--quick", "--model", "mlp",
                 "--time-budget-s", "2", "--out", str(out), "--no-plots"])
    said = capfd.readouterr().out
    assert code == 0, said
    bench = json.loads((out / "bench.json").read_text())
    assert (bench["framework"], bench["arms"], bench["settings"]) == ("tensorflow", ["uniform", "omnilearn"], ["HL8"])
    assert [r["arm"] for r in bench["results"]] == ["uniform", "omnilearn"]  # no bsp arm
    for row, scaling in zip(bench["results"], ("none", "linear")):
        summary = json.loads((Path(row["run_dirs"][0]) / "summary.json").read_text())
        assert (summary["framework"], summary["lr_scaling"]) == ("tensorflow", scaling)
        assert summary["train_s"] >= 2.0 and summary["updates"] >= 1  # stopped by the budget, not by the data
        assert len(row["p99_staleness_per_worker"]) == 4 and row["accuracy_at_budget"]["mean"] is not None
    assert "| HL8 | asp | uniform |" in said and "| HL8 | asp | omnilearn |" in said


def test_the_tensorflow_asp_bench_refuses_a_bsp_arm_flag_in_one_line(tmp_path, capsys):
    from omnilearn.experiments.cli import main

    code = main(["bench", "--mode", "asp", "--framework", "tensorflow", "--steps", "5", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and "--framework tensorflow runs no bsp arm" in err and err.count("\n") == 1
    assert not (tmp_path / "b").exists()
