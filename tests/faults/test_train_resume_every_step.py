"""``omnilearn train`` (PyTorch, BSP) resumed from a checkpoint of *every* step lands on the uninterrupted path.

One short run (an MLP on 8,192 synthetic samples, global batch 2048: 3 epochs of 4 steps, 2 workers at declared
speeds 2,1 under ``--controller static``, the cosine LR schedule over the run) saves a checkpoint after every step
(``--checkpoint-every 1`` at ``--control-interval 1``, ``--min-window-s 0``: every step ends an interval, none is
stretched). A run stopped after its checkpoint of step k is that run directory without the later checkpoints,
``model.pt`` and ``summary.json``. For every k from 1 to 11 (inside an epoch, at each epoch boundary, one step
before and after it, in the last epoch) it is resumed as ``omnilearn train --resume --checkpoint-every 0``
configures it (saving nothing more):

- at 2 workers it ends with the uninterrupted run's weights bitwise (the same split: the same sums in the same
  order). So saving every step does not move the path either: these resumes save nothing after step k;
- at 1 worker and at 3 it ends with them up to float32 rounding. The CLI has no dtype setting: its models train in
  float32, whose per-worker partial sums of a step round differently at another split (2**-24 = 6e-8 relative a
  rounding); :data:`ELASTIC_TOLERANCE` allows that over the remaining steps (measured: 4e-9 to 7e-8).

A launch costs about a second (start, join, teardown), so the 11 resumes at one worker count run as the jobs of
one launch, the launcher's own way to run several (``omnilearn bench``'s): the same config (``config_from_args``
of the resume's flags, the run's ``config.toml``), the same trainer, in processes forked from the launcher's
preloaded fork server. ``omnilearn train --resume`` launched on its own (``omnilearn.experiments.cli.main``, in
this process) gives bitwise what the shared launch gave, at the same worker count and at another.
tests/faults/test_resume.py covers the rest of resuming (refusals, damaged checkpoints, restarts).

Run: ``python -m pytest -q tests/faults/test_train_resume_every_step.py``
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ranks import max_relative
from runfiles import raw_events, stopped_at

from omnilearn.checkpoint import CheckpointStore
from omnilearn.experiments.args import config_from_args
from omnilearn.experiments.cli import main, parser
from omnilearn.experiments.launch import local as launch

pytestmark = pytest.mark.dist

STEPS = 12  # 3 epochs of 8192 // 2048 = 4 steps
FLAGS = ("--model", "mlp", "--dataset", "synthetic", "--input-shape", "8", "--global-batch", "2048",
         "--epochs", "3", "--speeds", "2,1", "--controller", "static", "--emulator", "none", "--lr-schedule", "cosine",
         "--control-interval", "1", "--min-window-s", "0", "--keep-checkpoints", str(STEPS), "--no-plots")
ELASTIC_TOLERANCE = 1e-6  # float32 (the CLI offers no float64): 14x the largest measured (7e-8)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt", weights_only=True)


def resume_flags(run: Path, *flags: str) -> list[str]:
    """``omnilearn train`` resuming ``run`` with ``flags``, saving nothing more."""
    return ["train", "--out", str(run), "--resume", "--no-plots", "--checkpoint-every", "0", *flags]


def resumed_in_one_launch(whole: Path, out: Path, workers: int) -> dict[int, dict[str, torch.Tensor]]:
    """``whole`` stopped after each step k, each resumed at ``workers`` as ``omnilearn train --resume`` configures
    it, all as the jobs of one launch: {k: its final weights}."""
    runs = {k: stopped_at(whole, out / f"k{k}", k) for k in range(1, STEPS)}
    jobs = [launch.Job(config_from_args(parser().parse_args(resume_flags(run, "--workers", str(workers)))), run)
            for run in runs.values()]
    launch.run_local(jobs, out)
    for k, run in runs.items():
        assert [(e["step"], e["workers"]) for e in raw_events(run, "resume")] == [(k, workers)]
    return {k: weights(run) for k, run in runs.items()}


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The uninterrupted run, with a checkpoint after every step."""
    run = tmp_path_factory.mktemp("whole") / "run"
    assert main(["train", "--out", str(run), "--workers", "2", *FLAGS, "--checkpoint-every", "1"]) == 0
    assert CheckpointStore(run / "checkpoints").steps() == list(range(1, STEPS + 1))
    return run


@pytest.fixture(scope="module")
def resumed(whole, tmp_path_factory) -> dict[int, dict[int, dict[str, torch.Tensor]]]:
    """{workers: {k: the final weights of the resume after step k}}: one launch per worker count."""
    out = tmp_path_factory.mktemp("resumed")
    return {workers: resumed_in_one_launch(whole, out / f"workers{workers}", workers) for workers in (2, 1, 3)}


@pytest.mark.parametrize("k", range(1, STEPS))
def test_a_resume_after_step_k_at_the_same_worker_count_is_bitwise(whole, resumed, k):
    got, expected = resumed[2][k], weights(whole)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), (k, name, max_relative(got, expected))


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("k", range(1, STEPS))
def test_a_resume_after_step_k_at_another_worker_count_ends_on_the_path(whole, resumed, k, workers):
    got, expected = resumed[workers][k], weights(whole)
    assert max_relative(got, expected) <= ELASTIC_TOLERANCE, (k, workers, max_relative(got, expected))


@pytest.mark.parametrize(("k", "workers"), [(4, 2), (5, 1)])
def test_the_command_resumes_as_the_shared_launch_does(whole, resumed, tmp_path, k, workers):
    """``omnilearn train --resume`` launched on its own: the same weights, bitwise (the same split)."""
    run = stopped_at(whole, tmp_path / "run", k)
    assert main(resume_flags(run, "--workers", str(workers))) == 0
    got, shared = weights(run), resumed[workers][k]
    assert got.keys() == shared.keys()
    assert all(torch.equal(got[name], shared[name]) for name in got), max_relative(got, shared)
