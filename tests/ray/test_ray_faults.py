"""The Ray Train door with a worker killed twice: what it costs, and the run still ends on the uninterrupted weights.

One ``TorchTrainer`` run of tests/ray/ray_job.py on a local Ray cluster (2 workers, gloo, float64, 24 steps,
``FailureConfig(max_failures=2)``), shared by the tests below:

- the first attempt tries Ray's ``prepare_model`` and ``prepare_data_loader`` in the session: each is refused in one
  line naming it and the supported route (``ol.wrap_model``, ``ol.data_loader``);
- it reports every 4 steps; rank 1 SIGKILLs itself right after its ``optimizer.step()`` of step 10 (11 updates
  applied). Ray restarts the group from the last report (step 8): 3 steps lost, exactly the steps since it;
- the second attempt reports every step; rank 1 is killed the same way at step 17: the restart resumes at 17, the
  one step in flight lost;
- the third attempt ends the run: its weights equal one plain process's on the same global batches (float64,
  relative 1e-12). (``examples/ray_train.py``: tests/ray/test_ray_example.py, a file of its own for the suite's
  per-file budget.)

The figures (steps lost, what a report costs a step) are printed: ``pytest -s``.

Run: ``python -m pytest -q -s tests/ray/test_ray_faults.py``
"""

from __future__ import annotations

import statistics

import pytest

pytest.importorskip("ray.train")  # tests/ray itself would pass for a namespace package called ray

import ray_job  # noqa: E402
import torch  # noqa: E402
from raycluster import Fit, local_cluster  # noqa: E402

pytestmark = pytest.mark.dist
STEPS, KILLS = 24, (10, 17)
FIT_S = 900.0  # a hang guard: three attempts of a 2-worker group on a loaded 2-core machine


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(head_cpus=2) as made:
        yield made


@pytest.fixture(scope="module")
def killed(cluster, tmp_path_factory):
    import ray.cloudpickle
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp_path_factory.mktemp("killed")
    ray.cloudpickle.register_pickle_by_value(ray_job)  # the workers need not import tests/ray
    config = {"out": str(out), "steps": STEPS, "every": [[0, 4], [1, 1]], "kills": list(KILLS), "refusals": True}
    trainer = TorchTrainer(ray_job.train_fn, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(storage_path=str(out / "storage"), name="killed",
                                                failure_config=FailureConfig(max_failures=2)))
    result = Fit(trainer).wait(FIT_S)
    return out, result, ray_job.read_events(out)


def test_prepare_model_and_prepare_data_loader_are_refused_in_one_line(killed):
    said = {e["name"]: e["message"] for e in killed[2] if e["event"] == "refused"}
    assert set(said) == {"prepare_model", "prepare_data_loader"}, said
    for name, route in (("prepare_model", "ol.wrap_model(model)"), ("prepare_data_loader", "ol.data_loader(dataset)")):
        message = said[name]
        assert message is not None and "\n" not in message, message
        assert f"ray.train.torch.{name}()" in message and route in message, message


def test_a_killed_worker_costs_the_steps_since_the_last_report_and_the_run_stays_exact(killed):
    out, result, events = killed
    starts = [(e["step"], e["world"]) for e in events if e["event"] == "start"]
    assert starts == [(0, 2), (8, 2), (17, 2)], starts  # each restart resumes at the last report before the kill
    kills = [i for i, e in enumerate(events) if e["event"] == "kill"]
    assert [events[i]["applied"] for i in kills] == [k + 1 for k in KILLS]
    for i, (resumed, _) in zip(kills, starts[1:]):
        applied = events[i]["applied"]
        last = [e["step"] for e in events[:i] if e["event"] == "report"][-1]  # the last report before the kill
        assert resumed == last
        print(f"\nkilled after {applied} updates: resumed at {resumed}, {applied - resumed} steps lost "
              f"(reporting every {'4' if resumed == 8 else '1'} steps)")
    assert events[kills[1]]["applied"] - starts[2][0] == 1  # reporting every step: the step in flight only
    assert result.error is None and result.metrics["step"] == STEPS
    final = torch.load(out / "final.pt", weights_only=True)
    assert ray_job.rel_diff(ray_job.plain_weights(STEPS), final) < 1e-12


def test_what_a_report_every_step_costs(killed):
    """Printed, not asserted: the time of a report (the session's save, Ray's report, the wait for its commit at
    a 0.1 s poll) beside a step's own, in the attempt that reports every step."""
    events = killed[2]
    every_step = [e for e in events if e["event"] == "report" and 8 < e["step"] <= 17]
    steps = [e["s"] for e in events if e["event"] == "step"]
    assert len(every_step) == 9
    report_s, step_s = statistics.median(e["s"] for e in every_step), statistics.median(steps)
    print(f"\nreport every step: {report_s * 1e3:.0f} ms a report (median of {len(every_step)}), a step "
          f"{step_s * 1e3:.1f} ms without it")

