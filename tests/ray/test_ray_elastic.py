"""The Ray Train door, elastic: a node joins a running job and it goes on at 3 workers; the node leaves, at 2 again.

One ``TorchTrainer`` run of tests/ray/ray_job.py (float64, 32 steps, a report every 4) with
``ScalingConfig(num_workers=(2, 3))`` on a local cluster whose head offers 2 CPUs (one worker each):

- at step 12 the test adds a node of 1 CPU. The workers train on to step 18 and wait there (a run that would end
  before Ray notices is held, not timed); Ray's elastic policy sees the node, ends the group and starts 3 workers
  from the last report (16): 2 steps lost, and the newcomer has its share of every global batch from the first
  step at 3 workers on, the first interval end (step 20) included;
- at step 22 (3 workers) the test removes that node; Ray restarts 2 workers from the last report (20);
- the run ends on the weights of one plain process on the same global batches (relative 1e-12).

Printed (``pytest -s``): seconds from the join to the first step at 3 workers, and from the removal to the first
step at 2; the steps lost each time.

Run: ``python -m pytest -q -s tests/ray/test_ray_elastic.py``
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray.train")  # tests/ray itself would pass for a namespace package called ray

import ray_job  # noqa: E402
import torch  # noqa: E402
from raycluster import Fit, await_event, local_cluster, node_args  # noqa: E402

pytestmark = pytest.mark.dist
STEPS, EVERY, JOIN_AT, GROWN, SHRUNK = 32, 4, 12, (18, 2), (22, 3)
WAIT_S = 600.0  # a hang guard for each change: Ray's resource view refreshes every 20 s, restarts take a while here


def test_a_node_that_joins_and_leaves_resizes_the_run_exactly(tmp_path):
    import ray.cloudpickle
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.cloudpickle.register_pickle_by_value(ray_job)
    config = {"out": str(tmp_path), "steps": STEPS, "every": [[0, EVERY]], "holds": [list(GROWN), list(SHRUNK)]}
    with local_cluster(head_cpus=2) as cluster:
        trainer = TorchTrainer(ray_job.train_fn, train_loop_config=config,
                               scaling_config=ScalingConfig(num_workers=(2, 3), elastic_resize_monitor_interval_s=1),
                               run_config=RunConfig(storage_path=str(tmp_path / "storage"), name="elastic",
                                                    failure_config=FailureConfig(max_failures=2)))
        fit = Fit(trainer)

        def events() -> list[dict]:
            return ray_job.read_events(tmp_path)

        def first_step(world: int) -> dict:
            return await_event(events, lambda e: e["event"] == "step" and e["world"] == world, WAIT_S, fit)

        await_event(events, lambda e: e["event"] == "step" and e["step"] >= JOIN_AT, WAIT_S, fit)
        joined = time.time()
        node = cluster.add_node(**node_args(1, cluster.temp))
        grown = first_step(3)
        await_event(events, lambda e: e["event"] == "hold" and (e["step"], e["world"]) == SHRUNK, WAIT_S, fit)
        left = time.time()
        cluster.remove_node(node)
        shrunk = await_event(events, lambda e: e["event"] == "step" and e["world"] == 2 and e["t"] > left, WAIT_S,
                             fit)
        result = fit.wait(WAIT_S)
    log = events()
    starts = [(e["step"], e["world"]) for e in log if e["event"] == "start"]
    assert starts == [(0, 2), (16, 3), (20, 2)], starts  # each from the last report before the change
    done = {w: max(e["step"] for e in log if e["event"] == "step" and e["world"] == w and e["t"] < t)
            for w, t in ((2, grown["t"]), (3, shrunk["t"]))}
    assert (done[2], done[3]) == (GROWN[0], SHRUNK[0])  # the held steps: where Ray ended each group
    at3 = [e for e in log if e["event"] == "step" and e["world"] == 3]
    assert all(b > 0 for b in grown["batches"]) and len(grown["batches"]) == 3  # the newcomer's share at once
    assert [e["batches"] for e in at3 if e["step"] == 16 + ray_job.INTERVAL] == [grown["batches"]]  # and after
    print(f"\njoin -> first step at 3 workers: {grown['t'] - joined:.1f} s, {done[2] - 16} steps lost "
          f"(reports every {EVERY}); removal -> first step at 2: {shrunk['t'] - left:.1f} s, {done[3] - 20} lost")
    assert result.error is None and result.metrics["step"] == STEPS
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert ray_job.rel_diff(ray_job.plain_weights(STEPS), final) < 1e-12
