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
  joined by a veth pair, so the nodes have their own addresses; else both use the loopback (said in the
  test's output). Node B's agent and worker SIGKILLed after step 6: A's survivors save step 7, A's agent
  re-forms the job alone and it resumes at step 7 on 2 workers, ending with the 3-worker run's weights
  (float64, relative 1e-12). Node B's worker alone killed: B's agent restarts it, both agents re-form the
  job and it resumes at step 7 on 3 workers.

Run: ``python -m pytest -q tests/faults/test_rescue_torchrun.py``
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import agents
import listeners
import pytest
from ranks import free_port
import torch
import torch.nn.functional as F

from omnilearn.data.schedule import GlobalPlan

SCRIPT = Path(__file__).with_name("rescue_script.py")
TIMEOUT_S = 240
# the default last call (30 s) would wait that long per round; a dead node's keep-alive is missed after 3 s, not 15
RDZV_CONF = "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


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


class Nodes:
    """Two "nodes" for two agents: network namespaces with their own addresses where possible, else loopback."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.names = (f"olA{tag}", f"olB{tag}")
        self.links = (f"vA{tag}", f"vB{tag}")
        subnet = random.randrange(1, 250)
        self.addrs = (f"10.231.{subnet}.1", f"10.231.{subnet}.2")
        self.isolated = False

    def make(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return
        a, b = self.names
        steps = [["netns", "add", a], ["netns", "add", b],
                 ["link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1]],
                 ["link", "set", self.links[0], "netns", a], ["link", "set", self.links[1], "netns", b],
                 ["-n", a, "addr", "add", f"{self.addrs[0]}/24", "dev", self.links[0]],
                 ["-n", b, "addr", "add", f"{self.addrs[1]}/24", "dev", self.links[1]],
                 ["-n", a, "link", "set", self.links[0], "up"], ["-n", b, "link", "set", self.links[1], "up"],
                 ["-n", a, "link", "set", "lo", "up"], ["-n", b, "link", "set", "lo", "up"]]
        for step in steps:
            if subprocess.run(["ip", *step], capture_output=True).returncode != 0:
                self.remove()
                return
        self.isolated = True

    def remove(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def agent(self, node: int, port: int, nproc: int, out: Path, *script_args: str) -> subprocess.Popen:
        """Start node ``node``'s agent (0 hosts the rendezvous) in a session of its own."""
        host = self.addrs[0] if self.isolated else "127.0.0.1"
        args = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id",
                f"rescue{port}", "--max-restarts", "2", "--nproc-per-node", str(nproc),
                "--rdzv-conf", f"{RDZV_CONF},is_host={int(node == 0)}"]
        cmd, extra = torchrun(*args), {}
        if self.isolated:  # each node's own address: advertised to the peers, and gloo's interface
            cmd = ["ip", "netns", "exec", self.names[node], *torchrun(*args, "--local-addr", self.addrs[node])]
            extra = {"GLOO_SOCKET_IFNAME": self.links[node]}
        log = open(out / f"agent-{'AB'[node]}.log", "w")
        return subprocess.Popen([*cmd, str(SCRIPT), str(out), *script_args], env={**env(), **extra}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


@contextmanager
def two_nodes():
    nodes = Nodes()
    nodes.make()
    print(f"nodes: {'network namespaces ' + ', '.join(nodes.addrs) if nodes.isolated else 'loopback'}")
    procs: list[subprocess.Popen] = []
    try:
        yield nodes, procs
    finally:
        for p in procs:
            for pid in listeners.tree(p.pid):  # torchrun's workers sit in sessions of their own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        nodes.remove()


@pytest.mark.parametrize("lost", ["node", "worker"])
def test_two_agents_go_on_after_a_loss(whole, tmp_path, lost):
    with two_nodes() as (nodes, procs):
        port = free_port()
        procs.append(nodes.agent(0, port, 2, tmp_path))
        procs.append(nodes.agent(1, port, 1, tmp_path, "L0:7:agent" if lost == "node" else "L0:7"))
        assert procs[0].wait(timeout=TIMEOUT_S) == 0, (tmp_path / "agent-A.log").read_text()[-3000:]
        if lost == "worker":
            assert procs[1].wait(timeout=60) == 0, (tmp_path / "agent-B.log").read_text()[-3000:]
    log = (tmp_path / "agent-A.log").read_text()
    assert "lost a peer at step 7" in log and "saved the checkpoint of step 7" in log
    world = 2 if lost == "node" else 3
    assert [(a["start"], a["world"]) for a in attempts(tmp_path)] == [(0, 3), (7, world)]
    assert rel_diff(whole, tmp_path) < 1e-12
