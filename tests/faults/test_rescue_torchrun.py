"""A crash costs one step under torchrun, as users run it: the API in a script of their own
(tests/faults/rescue_script.py: float64, static split, ``ol.load_checkpoint`` at the start, no periodic
checkpoint within the run), real agents, real SIGKILLs.

- One agent (``--standalone``, 3 workers, ``--max-restarts 2``), two failures in a row: rank 2 killed
  after step 6, then rank 1 after step 14 of the restarted attempt. Each time the survivors save the step
  in flight's start and the agent's restart resumes there (7, then 15); the weights are the uninterrupted
  run's to float64 rounding (DDP's bucket order after a restart changes the sum's order of three terms). The
  uninterrupted run is the script's in one plain process on the same global batches (the ``whole`` fixture).
- The loss seen between ``optimizer.step()`` and ``ol.step()`` (rank 1 of 2 dies right after its update of
  step 12; rank 0 is in the script's own logging ``all_reduce``): the weights hold step 12's update, the count
  does not, so rank 0 saves nothing and says so; the restart resumes from the periodic checkpoint of step 10
  (``RESCUE_EVERY=5``) and ends on the uninterrupted weights (relative 1e-12).
- Two agents with a c10d rendezvous (``--nnodes 1:2``), "node" A with 2 workers (it hosts the rendezvous)
  and "node" B with 1. Where the test can make network namespaces (root), each agent runs in its own,
  joined through a bridge, so the nodes have their own addresses; else both use the loopback (said in
  the test's output; tests/netnodes.py). Node B's agent and worker SIGKILLed after step 6: A's survivors
  save step 7, A's agent re-forms the job alone and it resumes at step 7 on 2 workers, ending with the
  3-worker run's weights (float64, relative 1e-12). Node B's worker alone killed: B's agent restarts it,
  both agents re-form the job and it resumes at step 7 on 3 workers. (A node that joins instead:
  tests/faults/test_grow_torchrun.py.)

Run: ``python -m pytest -q tests/faults/test_rescue_torchrun.py``
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import agents
import netnodes
import pytest
from ranks import free_port
import torch
import torch.nn.functional as F

from omnilearn.data.schedule import GlobalPlan

SCRIPT = Path(__file__).with_name("rescue_script.py")
TIMEOUT_S = 240


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def attempts(out: Path) -> list[dict]:
    found = sorted(out.glob("attempt-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return [json.loads(p.read_text()) for p in found]


def rel_diff(wa: dict[str, torch.Tensor], b: Path) -> float:
    wb = torch.load(b / "final.pt", weights_only=True)
    num = sum(float(((wa[k] - wb[k]) ** 2).sum()) for k in wa) ** 0.5
    return num / sum(float((wa[k] ** 2).sum()) for k in wa) ** 0.5


@pytest.fixture(scope="module")
def whole() -> dict[str, torch.Tensor]:
    """The uninterrupted run's weights: rescue_script's model, data and SGD in one plain process, on the global
    batches its sessions take (``GlobalPlan`` of the default seed; what a 3-rank run of it ends with to float64
    rounding: tests/dist/test_bsp.py holds OmniLearn to one process on such a plan)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as the script: its data and model are made in float64
    try:
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(480, 8, generator=g), torch.randn(480, 1, generator=g)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    finally:
        torch.set_default_dtype(saved)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    plan = GlobalPlan(480, 24, seed=0)
    for step in range(24):
        idx = torch.as_tensor(plan.step_indices(step))
        opt.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_two_failures_in_a_row_cost_a_step_each(whole, tmp_path):
    """torchrun's agent forking its ranks from the preloaded fork server (tests/agents.py); the two agents of the
    tests below are real torchrun processes, one per network namespace."""
    done = agents.torchrun("--standalone", "--nproc-per-node", "3", "--max-restarts", "2", str(SCRIPT), str(tmp_path),
                           "2:7@0,1:15@1", env=env(), timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(a["start"], a["world"]) for a in attempts(tmp_path)] == [(0, 3), (7, 3), (15, 3)]
    assert "lost a peer at step 7" in done.stderr and "lost a peer at step 15" in done.stderr
    # the survivors' console: their lines, not gloo's traceback (kept in the checkpoint directory) nor a "stopping
    # after the next control interval end" for the agent's SIGTERM while they exit anyway
    said = "\n".join(line for line in done.stderr.splitlines() if not re.match(r"[IWE]\d{4} ", line))  # not the agent's
    assert "Traceback" not in said and "GLHF" not in said and "stopping after the next" not in said, said[-3000:]
    assert "omnilearn: the lost peer's error and its traceback: " in said
    kept = (tmp_path / "ckpt" / "error-rank0.log").read_text()  # the last failure's (gloo: reset or closed)
    assert re.search(r"Connection (reset|closed) by peer", kept) and "Traceback (most recent call last)" in kept
    rescued = {json.loads(p.read_text())["meta"]["rescue"]["step"] for p in (tmp_path / "ckpt").glob("*.json")}
    assert rescued == {7, 15}
    assert rel_diff(whole, tmp_path) < 1e-12


def test_a_loss_seen_between_the_update_and_ol_step_saves_nothing_and_the_restart_stays_on_the_path(whole, tmp_path):
    """Rank 1 dies right after its ``optimizer.step()`` of step 12: rank 0 sees the loss in the script's own logging
    ``all_reduce`` with step 12's update applied and not counted. Saving that under "next step 12" would apply step
    12 twice on the restart (it did: issue 50); rank 0 saves nothing, says so, and the restart resumes from the
    periodic checkpoint of step 10, ending on the uninterrupted weights."""
    done = agents.torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(SCRIPT), str(tmp_path),
                           "1:12:update", env={**env(), "RESCUE_EVERY": "5"}, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lost a peer at step 12" in done.stderr and "nothing was saved: its optimizer had applied step 12" \
        in done.stderr, done.stderr[-3000:]
    assert [(a["start"], a["world"]) for a in attempts(tmp_path)] == [(0, 2), (10, 2)]
    assert not [p for p in (tmp_path / "ckpt").glob("*.json") if "rescue" in json.loads(p.read_text())["meta"]]
    assert rel_diff(whole, tmp_path) < 1e-12


@pytest.mark.parametrize("lost", ["node", "worker"])
def test_two_agents_go_on_after_a_loss(whole, tmp_path, lost):
    with netnodes.nodes(2) as net:
        port, args = free_port(), ["--max-restarts", "2", "--nproc-per-node"]
        first = net.agent(0, port, tmp_path, [*args, "2"], SCRIPT, str(tmp_path), env=env())
        second = net.agent(1, port, tmp_path, [*args, "1"], SCRIPT, str(tmp_path),
                           "L0:7:agent" if lost == "node" else "L0:7", env=env())
        assert first.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "agent-A.log").read_text()[-3000:]
        if lost == "worker":
            assert second.wait(timeout=60) == 0, (tmp_path / "agent-B.log").read_text()[-3000:]
    assert not net.left()
    log = (tmp_path / "agent-A.log").read_text()
    assert "lost a peer at step 7" in log and "saved the checkpoint of step 7" in log
    world = 2 if lost == "node" else 3
    assert [(a["start"], a["world"]) for a in attempts(tmp_path)] == [(0, 3), (7, world)]
    assert rel_diff(whole, tmp_path) < 1e-12
