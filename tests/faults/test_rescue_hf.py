"""A crash costs one step with Hugging Face's Trainer: ``OmniLearnTrainer`` under ``torchrun --max-restarts 1``.

tests/faults/hf_rescue_script.py: the float64 1-layer GPT-2 of tests/dist/test_hf_exact.py, 2 workers, the
static split, no periodic checkpoint (``save_strategy="no"``). Rank 0 (the rank Trainer lets write) SIGKILLs
itself at the end of step 4: rank 1 writes ``checkpoint-4`` alone, as Trainer loads it, and the agent's restart
resumes it with ``train(resume_from_checkpoint=True)``, ending with bitwise the uninterrupted run's weights.

torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: accelerate makes the process group from torchrun's
store, which torch shares across restarts by default, and a restarted group then reads the dead attempt's peer
addresses (``connectFullMesh ... Connection refused``); ``OmniLearnTrainer`` warns of it on rank 0
(:func:`omnilearn.integrations.hf_checkpoint.arm_rescue`, checked here too).

Run: ``python -m pytest -q tests/faults/test_rescue_hf.py``
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import agents
import pytest
import torch
from needs import needs

pytestmark = [needs("transformers", "hf"), needs("accelerate", "hf")]

SCRIPT = Path(__file__).with_name("hf_rescue_script.py")


def torchrun(out: Path, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    """torchrun's agent forking its ranks from the preloaded fork server (tests/agents.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    done = agents.torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts), str(SCRIPT),
                           str(out), *args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_killed_writer_costs_one_step(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir()
    killed.mkdir()
    torchrun(whole)
    done = torchrun(killed, "0:4", restarts=1)
    assert "omnilearn: rank 1 lost a peer at step 4" in done.stderr
    assert f"saved {killed / 'checkpoint-4'}" in done.stderr
    again = json.loads((killed / "attempt-1.json").read_text())
    assert (again["start"], again["world"]) == (4, 2)
    a, b = (torch.load(p / "final.pt", weights_only=True) for p in (whole, killed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_restarts_on_a_shared_store_are_warned_of(monkeypatch):
    from omnilearn.integrations.hf_checkpoint import RestartStoreWarning, arm_rescue

    class Session:
        is_main, saver = True, None

        def rescue_with(self, saver):
            self.saver = saver

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.warns(RestartStoreWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        arm_rescue(Session(), str)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a store per round (the fix): nothing to say
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arm_rescue(Session(), str)
