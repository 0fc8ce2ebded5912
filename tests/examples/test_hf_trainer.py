"""``examples/hf_trainer.py`` (``OmniLearnTrainer``, GPT-2 from a local config) under torchrun, rank 1 3x slower.

- The batches move to the fast worker (in the run directory and in Trainer's
  own logs, ``omnilearn/batch_rank<i>``) and the loss falls.
- Resume: a run stopped mid-epoch after step 15 (its ``save_steps=15``
  checkpoint holds the session) and resumed to step 30 ends with the
  uninterrupted run's eval loss: the data continued where it stopped.

Run: ``python -m pytest -q tests/examples/test_hf_trainer.py`` (about 30 s on 2 cores).
"""

from __future__ import annotations

import json
import re

import pytest
from needs import needs

from runexample import assert_balanced_and_learning, scripted_timings, torchrun

pytestmark = [pytest.mark.dist, needs("transformers", "hf"), needs("accelerate", "hf")]

SLOW = ("--speeds", "3,1", "--max-steps", "30")


def eval_loss(stdout: str) -> str:
    found = re.search(r"eval_loss (\S+) at step 30", stdout)
    assert found, f"no final eval_loss in the output:\n{stdout[-2000:]}"
    return found.group(1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_trainer")
    done = torchrun("hf_trainer.py", *SLOW, "--out", str(out / "run"), "--output-dir", str(out / "ckpt"),
                    env=scripted_timings("3,1"))
    return out, done.stdout


def test_trainer_example_rebalances_and_learns(uninterrupted):
    out, stdout = uninterrupted
    summary = assert_balanced_and_learning(out / "run")
    assert summary["rebalances"] >= 1
    logged = json.loads(re.search(r"^batches (.*)$", stdout, re.M).group(1))  # Trainer's logs, rank 0's copy
    assert all(sum(b) == 32 for b in logged) and logged[-1][0] > logged[-1][1], logged


def test_trainer_example_resumes_mid_epoch_where_it_stopped(uninterrupted, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    torchrun("hf_trainer.py", *SLOW, "--stop-at", "15", "--save-steps", "15", "--output-dir", ckpt,
             env=scripted_timings("3,1"))
    assert (tmp_path / "ckpt" / "checkpoint-15" / "omnilearn_session.pt").is_file()
    resumed = torchrun("hf_trainer.py", *SLOW, "--resume", "--output-dir", ckpt, env=scripted_timings("3,1"))
    assert "resumed at step 15" in resumed.stdout
    assert eval_loss(resumed.stdout) == eval_loss(uninterrupted[1])
