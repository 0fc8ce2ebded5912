"""``examples/fsdp_transformer.py`` (a transformer sharded with FSDP2) under torchrun, rank 1 emulated 3x slower.

The run balances (the fast worker ends with the larger batch, the loss falls) and saves a sharded
checkpoint (DCP) at steps 20 and 40. Resumed from step 20 on one process (DCP reshards the two
workers' shards), it continues the data where it stopped and ends with the uninterrupted run's loss
(float32, a different split: within 1e-4 relative).

Run: ``python -m pytest -q tests/examples/test_fsdp_transformer.py``
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from runexample import assert_balanced_and_learning, scripted_timings, torchrun

pytestmark = pytest.mark.dist


def test_fsdp_example_rebalances_learns_and_resumes_on_another_worker_count(tmp_path):
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    done = torchrun("fsdp_transformer.py", "--speeds", "3,1", "--steps", "40", "--out", str(out),
                    "--checkpoint-dir", str(ckpt), "--checkpoint-every", "20", env=scripted_timings("3,1"))
    summary = assert_balanced_and_learning(out)
    weights = torch.load(out / "model.pt", weights_only=True)  # the full tensors, not rank 0's shards
    assert weights["embed.weight"].shape == (64, 64) and weights["layers.0.mlp.0.weight"].shape == (256, 64)
    assert summary["rebalances"] >= 1 and "stopped after step 40" in done.stdout
    assert sorted(p.name for p in ckpt.glob("step-*.dcp")) == ["step-000000020.dcp", "step-000000040.dcp"]
    for path in ckpt.glob("step-000000040.*"):  # back to step 20, as if the run had stopped there
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    torchrun("fsdp_transformer.py", "--steps", "40", "--out", str(tmp_path / "resumed"), "--checkpoint-dir",
             str(ckpt), "--checkpoint-every", "20", "--resume", nproc=1, env={"OMNILEARN_TEST_S_PER_SAMPLE": ""})
    resumed = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert resumed["resumed_at_step"] == 20 and resumed["steps"] == 40
    assert resumed["final_train_loss"] == pytest.approx(summary["final_train_loss"], rel=1e-4)
