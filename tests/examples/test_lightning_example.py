"""``examples/lightning_example.py`` under torchrun, rank 1 3x slower: balance, accumulation, validation, resume.

Run 1 (40 steps, ``accumulate_grad_batches=2``, validation every 20 steps,
a checkpoint every 20): it rebalances toward the fast worker, its loss
falls, the per-worker batches reach Lightning's logger, validation metrics
come out. Run 2 resumes from the step-40 checkpoint (mid-epoch: 32 steps per
epoch) to step 60 into the same run directory: the record goes on from step
40 after a ``resume`` event (steps 0..59, none twice), with the split the
controller had learned and the loss where run 1 left it.

Run: ``python -m pytest -q tests/examples/test_lightning_example.py`` (about 30 s)
"""

from __future__ import annotations

import csv
import math

import pytest

from omnilearn.experiments.report.records import load_run
from omnilearn.observe.metrics import read_metrics
from runexample import assert_balanced_and_learning, scripted_timings, torchrun

pytest.importorskip("lightning")
pytestmark = pytest.mark.dist


def test_lightning_example_rebalances_learns_validates_and_resumes(tmp_path):
    out, ck = tmp_path / "run", tmp_path / "ck"
    common = ["--speeds", "3,1", "--accumulate", "2", "--out", str(out)]
    done = torchrun("lightning_example.py", *common, "--max-steps", "40", "--ckpt-dir", str(ck),
                    "--csv-dir", str(tmp_path / "logs1"), env=scripted_timings("3,1"))
    assert_balanced_and_learning(out)
    before = load_run(out)
    assert "global_step 40, " in done.stdout and "val_loss" in done.stdout, done.stdout
    rows = list(csv.DictReader((tmp_path / "logs1" / "example" / "version_0" / "metrics.csv").open()))
    fast = [float(r["omnilearn/batch_rank0"]) for r in rows if r.get("omnilearn/batch_rank0")]
    slow = [float(r["omnilearn/batch_rank1"]) for r in rows if r.get("omnilearn/batch_rank1")]
    assert fast and fast[-1] > slow[-1] and fast[-1] + slow[-1] == 128, (fast[-1:], slow[-1:])
    assert any(r.get("val_loss") for r in rows)

    done = torchrun("lightning_example.py", *common, "--max-steps", "60", "--resume", str(ck / "step=40.ckpt"),
                    "--csv-dir", str(tmp_path / "logs2"), env=scripted_timings("3,1"))
    assert "global_step 60, " in done.stdout, done.stdout
    run = load_run(out)
    assert run.steps == list(range(60)), (run.steps[:3], run.steps[-3:])
    assert [e["step"] for e in read_metrics(out, "resume")] == [40]
    batches = run.per_rank["batch"]
    assert batches[0][40] > batches[1][40], "the resumed run did not keep the split the controller had learned"
    head = [x for x in run.loss_by_step[40:45] if not math.isnan(x)]
    start = [x for x in before.loss_by_step[:5] if not math.isnan(x)]
    assert head and sum(head) / len(head) < 0.5 * sum(start) / len(start), (head, start)
