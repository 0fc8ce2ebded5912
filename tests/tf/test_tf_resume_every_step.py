"""A TensorFlow custom loop (``ol.step``) resumed after every step lands on the uninterrupted path, float64.

The loop of tests/tf/tf_resume_script.py: docs/tensorflow.md's hand-written loop (``omnilearn.tf.setup``,
``ol.wrap``, ``ol.data`` with ``set_epoch``, ``range(ol.epoch, 3)``), Adam on a rate that decays every step,
3 epochs of 4 steps of 16 shuffled samples. Checkpoints are taken at control-interval ends only (every worker
saves at the same one: ``omnilearn.tf.checkpointing``); the ``static`` controller allows an interval of 1 step
(the adaptive ones need 3), so ``checkpoint_every=1`` saves after every step, 1 to 12. The runs, forked from the
tests' kept TensorFlow server (tests/tfpool.py):

- two workers (speeds 3,1: 12 and 4 samples a step), saving after every step;
- one process: the loop without checkpoints (``whole``), the loop saving after every step, then for every step
  k from 1 to 11 (inside each epoch, at the epoch boundaries 4 and 8, one step before and after them, in the
  last epoch) a session that resumes the one-worker checkpoint of step k, and one that resumes the two
  workers' checkpoint of step k at one worker (another worker count), each trained to the end.

Then: saving after every step keeps the path (bitwise); each one-worker resume starts at step k, its optimizer
at iteration k, and ends with ``whole``'s weights bitwise (one process: the same sums in the same order); each
two-worker checkpoint resumed at one worker ends within 1e-12 relative of them, as the two workers' own run
does (their sums are split in two). A resume at two workers of every k would cost a cluster per k: several
workers resume at one step in tests/tf/test_tf_train.py (three at step 20, restarted at three and at two).
Measured: the two workers' weights 4e-15 relative from ``whole``, their checkpoints resumed at one 3e-15 to
5e-15. A resume that loses the optimizer's iteration count (the rate schedule's step; its moments kept) ends
with weights up to 7e-2 to 1.8e-1 apart (relative 1.2 to 2.9 from the two workers' checkpoints).

Run: ``python -m pytest -q tests/tf/test_tf_resume_every_step.py``
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from needs import needs

import tfpool
from omnilearn.tf.cluster import free_ports, local_config

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]
SCRIPT = Path(__file__).with_name("tf_resume_script.py")
STEPS = 12  # the script's 3 epochs of 4 steps
TOLERANCE = 1e-12


def run(base: Path, workers: int, jobs: list[dict]) -> dict[str, dict]:
    """``jobs`` in ``workers`` worker processes of the script (one cluster): worker 0's record per job name."""
    base.mkdir()
    (base / "jobs.json").write_text(json.dumps(jobs))
    ports = free_ports(workers)
    envs = [{**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": local_config(ports, r) if workers > 1 else ""}
            for r in range(workers)]
    done = tfpool.run_scripts([[str(SCRIPT), str(base / "jobs.json")]] * workers, envs, base / "logs", timeout=300)
    for p in done:
        assert p.returncode == 0, f"stdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-4000:]}"
    records = [json.loads(line) for line in (base / "results" / "runs.jsonl").read_text().splitlines()]
    for r in records:
        with np.load(base / "results" / f"{r['name']}.npz") as f:
            r["weights"] = [f[k] for k in f.files]
    return {r["name"]: r for r in records}


def job(name: str, out: Path, every: int = 0, speeds: str = "1", resume: tuple[Path, int] | None = None) -> dict:
    return {"name": name, "out": str(out), "every": every, "speeds": speeds,
            "resume": None if resume is None else [str(resume[0]), resume[1]]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("tfresume")
    two_dir, one_dir = base / "two" / "run", base / "one" / "saving"
    got = run(base / "two", 2, [job("two", two_dir, every=1, speeds="3,1")])
    resumes = [job(f"{src}-{k}", base / "one" / f"{src}-{k}", resume=(run_dir, k))
               for k in range(1, STEPS) for src, run_dir in (("one", one_dir), ("two", two_dir))]
    got.update(run(base / "one", 1, [job("whole", base / "one" / "whole"), job("saving", one_dir, every=1),
                                     *resumes]))
    return {"got": got, "one": one_dir, "two": two_dir}


def saved_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("step-*"))


def max_relative(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The largest ``|a - b| / |b|`` over the weight arrays of ``b``."""
    assert len(a) == len(b)
    return max(float(np.linalg.norm(x - y) / np.linalg.norm(y)) for x, y in zip(a, b))


def test_saving_at_every_step_saves_each_step_and_keeps_the_uninterrupted_path(runs):
    got = runs["got"]
    whole, saving = got["whole"], got["saving"]
    assert {w.dtype for w in whole["weights"]} == {np.dtype("float64")}  # else the bound is moot
    assert (whole["start"], whole["start_iterations"], whole["end"], whole["iterations"]) == (0, 0, STEPS, STEPS)
    assert saved_steps(runs["one"]) == saved_steps(runs["two"]) == list(range(1, STEPS + 1))
    for a, b in zip(saving["weights"], whole["weights"]):
        assert np.array_equal(a, b), float(np.abs(a - b).max())


def test_two_workers_on_an_uneven_split_end_within_1e_12_of_one(runs):
    two = runs["got"]["two"]
    assert two["split"] == [12, 4] and two["end"] == STEPS
    assert max_relative(two["weights"], runs["got"]["whole"]["weights"]) < TOLERANCE


@pytest.mark.parametrize("k", range(1, STEPS))
def test_one_worker_resumed_after_step_k_ends_with_the_uninterrupted_weights_bitwise(runs, k):
    resumed, whole = runs["got"][f"one-{k}"], runs["got"]["whole"]
    steps = (resumed["start"], resumed["start_iterations"], resumed["end"], resumed["iterations"])
    assert steps == (k, k, STEPS, STEPS)
    for n, (a, b) in enumerate(zip(resumed["weights"], whole["weights"])):
        assert np.array_equal(a, b), (k, n, float(np.abs(a - b).max()))


@pytest.mark.parametrize("k", range(1, STEPS))
def test_two_workers_checkpoint_of_step_k_resumed_at_one_ends_within_1e_12(runs, k):
    resumed = runs["got"][f"two-{k}"]
    assert (resumed["start"], resumed["start_iterations"], resumed["end"], resumed["split"]) == (k, k, STEPS, [16])
    relative = max_relative(resumed["weights"], runs["got"]["whole"]["weights"])
    assert relative < TOLERANCE, f"step {k}: relative difference {relative:.2e}"
