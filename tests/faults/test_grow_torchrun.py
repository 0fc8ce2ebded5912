"""A node that joins an elastic torchrun job mid-run: the job goes on at the larger count from the last completed
step, exactly, and the controller sets the newcomer's share.

Three "nodes" (tests/netnodes.py: network namespaces joined by a bridge where the test runs as root, else the
loopback), one real ``python -m torch.distributed.run`` agent each, c10d rendezvous hosted by A, ``--nnodes 1:3``,
one worker per node, running tests/faults/grow_script.py (float64, the default model-based controller, periodic
checkpoints, ``ol.load_checkpoint`` at the start and the ``ol.should_stop`` path of docs/failures.md). A and B
start the job; a sample costs 2 ms on them and 8 ms on C (a sleep inside the timed compute). Once a step at 2
workers is in A's rows file, C's agent starts (the 2-worker job holds after step 12 until its agent's SIGTERM,
so the join lands there whatever the load). Then torchrun does what it does on a join: A's and B's agents see
a node waiting (``num_nodes_waiting() > 0``), SIGTERM their workers and re-form the job when they have exited
(up to 30 s later, then SIGKILL). The workers agree on the stop at the next control interval end, save that
step and exit 143; the 3-node job loads it. Checked:

- the job ran at 2, then 3 workers; the two stopped workers saved the step after the last one the 2-worker job
  completed, and the 3-worker job started there (steps lost: 0);
- the final weights are those of the script's model, data and SGD in one plain process on the same global
  batches (relative 1e-12, float64);
- the newcomer trains from the resume on, its share the declared speeds' even split (> 0); from the first
  control interval end on, the controller's plan (the ``decision`` events of the run's ``metrics.jsonl``: kept
  when the noise gate holds it, as fresh processes' first steps on a loaded machine can make it); the first
  change gives the slower newcomer less than the even split.

The agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. Without it (torch 2.13) the newcomer hangs: the
agents keep the first round's store, and the newcomer, not rank 0, waits for the round's ``MASTER_ADDR``, which
rank 0's agent (its store address cached from the first round) never writes; after 60 s every agent fails.

Printed (``-s``): seconds from C's agent start to the first step at 3 workers (and where they went), the steps
lost, and the decision that moved the newcomer's share.

Run: ``python -m pytest -q -s tests/faults/test_grow_torchrun.py``
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import netnodes
import pytest
from ranks import free_port
from runfiles import raw_events
import torch
import torch.nn.functional as F

from grow_script import GLOBAL_BATCH, INTERVAL, STEPS, build, optimizer
from test_rescue_torchrun import attempts, rel_diff
from omnilearn.data.schedule import GlobalPlan

SCRIPT = Path(__file__).with_name("grow_script.py")
TIMEOUT_S = 180  # hang guards, not deadlines
MS_PER_SAMPLE = {"A": "2", "B": "2", "C": "8"}


@pytest.fixture(scope="module")
def whole() -> dict[str, torch.Tensor]:
    """The uninterrupted run's weights: grow_script's model, data and SGD in one plain process on the global
    batches its sessions take (``GlobalPlan`` of the default seed)."""
    with torch.random.fork_rng():
        data, model = build()
    opt = optimizer(model)
    plan = GlobalPlan(len(data), GLOBAL_BATCH, seed=0)
    x, y = data.tensors
    for step in range(STEPS):
        idx = torch.as_tensor(plan.step_indices(step))
        opt.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def rows(out: Path, node: str) -> list[dict]:
    path = out / f"rows-{node}0.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]  # a line being written: later


def wait_for_steps(net: netnodes.Nodes, out: Path, world: int, count: int) -> None:
    """Until A's rows show ``count`` steps at ``world`` workers (an agent that ends meanwhile fails the test)."""
    deadline = time.monotonic() + TIMEOUT_S
    while sum(r["world"] == world for r in rows(out, "A")) < count:
        ended = [netnodes.letter(i) for i, p in enumerate(net.procs) if p.poll() is not None]
        assert not ended and time.monotonic() < deadline, \
            f"no {count} steps at {world} workers (agents ended: {ended})\n" + logs(out)
        time.sleep(0.05)


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(out.glob("agent-*.log")))


def start(net: netnodes.Nodes, node: int, port: int, out: Path) -> None:
    name = netnodes.letter(node)
    env = {"GROW_NODE": name, "GROW_MS_PER_SAMPLE": MS_PER_SAMPLE[name], "GROW_WORLD": "3", "GROW_HOLD_AT": "12",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # torch 2.13's shared store hangs a newcomer (module docstring)
    net.agent(node, port, out, ["--max-restarts", "2", "--nproc-per-node", "1"], SCRIPT, str(out), env=env)


def batch_at(newcomer: list[dict], step: int) -> int:
    return next(r["batch"] for r in newcomer if r["step"] == step)


def figures(joined: float, resumed: dict, stops: list[dict], done: int, diff: float) -> str:
    """Seconds from the newcomer's agent start to the first step at 3 workers (and where they went), steps lost."""
    return (f"join to the first step at 3 workers {resumed['first_step'] - joined:.1f} s: to the workers' stop "
            f"{max(s['closed'] for s in stops) - joined:.1f} s, to the new workers' start {resumed['t0'] - joined:.1f}"
            f" s (imports {resumed['imported'] - resumed['t0']:.1f} s, set-up "
            f"{resumed['setup'] - resumed['imported']:.1f} s); resumed at step {resumed['start']} after {done} "
            f"completed: {done - resumed['start']} lost; weights {diff:.1e} from one process")


def test_a_node_that_joins_gets_its_share_and_the_job_stays_exact(whole, tmp_path):
    with netnodes.nodes(3) as net:
        port = free_port()
        start(net, 0, port, tmp_path)
        start(net, 1, port, tmp_path)
        wait_for_steps(net, tmp_path, world=2, count=3)
        joined = time.time()
        start(net, 2, port, tmp_path)
        for p in net.procs:
            assert p.wait(timeout=TIMEOUT_S) == 0, logs(tmp_path)
    assert not net.left()
    found = attempts(tmp_path)
    assert [a["world"] for a in found] == [2, 3], (found, logs(tmp_path))
    resumed = found[1]
    done = 1 + max(r["step"] for r in rows(tmp_path, "A") if r["world"] == 2)  # steps the 2-worker job completed
    stops = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("stopped-*.json"))]
    assert [s["step"] for s in stops] == [done, done], stops  # A and B saved it, and only they stopped
    decisions = [d for d in raw_events(tmp_path / "run", "decision") if d["step"] >= resumed["start"]]
    newcomer = [r for r in rows(tmp_path, "C") if r["world"] == 3]
    rank = newcomer[0]["rank"]
    moved = next((d for d in decisions if d["changed"] and d["new"][rank] != d["old"][rank]), None)
    assert moved is not None, f"the controller never moved the newcomer's share: {decisions}"
    diff = rel_diff(whole, tmp_path)
    print(figures(joined, resumed, stops, done, diff) + f"; the newcomer's share {moved['old'][rank]} -> "
          f"{moved['new'][rank]} at decision {decisions.index(moved) + 1} after the resume")
    assert done == resumed["start"]
    assert diff < 1e-12
    # from the resume the newcomer trains its even share (the declared speeds'); after the first interval, the
    # controller's plan (kept or changed, whichever the noise gate allowed); the first change gives it less
    assert newcomer[0]["step"] == resumed["start"] and newcomer[0]["batch"] == GLOBAL_BATCH // 3
    first = decisions[0]
    assert first["step"] < resumed["start"] + 2 * INTERVAL and batch_at(newcomer, first["step"] + 1) \
        == first["new"][rank] > 0, first
    assert 0 < moved["new"][rank] < GLOBAL_BATCH // 3 and batch_at(newcomer, moved["effective_step"]) \
        == moved["new"][rank], moved
