"""The cluster recipes keep what a lost node, a preemption and a second submission need (issue 50).

No cluster here: what runs is checked elsewhere (tests/faults/test_rescue_torchrun.py: agents re-forming a job
after a lost node; tests/faults/test_api_stops.py: a stop that saves). This reads the recipes for the settings
those rely on, so an edit that drops one fails here: srun's ``--no-kill`` and ``--kill-on-bad-exit=0``, the CPUs
per task passed to srun, the time limit's signal passed on and the job requeued, a checkpoint directory per job;
on Kubernetes absolute paths, a bound on restarts, a grace period for the final save, a checkpoint directory per
job, and a Trainer v2 ``TrainJob`` beside the ``PyTorchJob``.

Run: ``python -m pytest -q tests/unit/test_recipes.py``
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_slurm_recipe_survives_a_lost_node_a_time_limit_and_a_second_submission():
    text = (EXAMPLES / "slurm" / "own_model.sbatch").read_text()
    srun = re.search(r"^srun (.*?)torchrun", text, re.M | re.S).group(1)
    assert "--no-kill" in srun and "--kill-on-bad-exit=0" in srun
    assert '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in srun  # srun does not inherit it from sbatch
    assert "#SBATCH --signal=B:TERM@" in text and "#SBATCH --requeue" in text
    assert re.search(r"trap '.*kill -TERM \"\$srun_pid\"", text) and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "ckpt=${CKPT_DIR:-$HOME/omnilearn-ckpt/$SLURM_JOB_ID}" in text  # keyed by the job, or given
    assert "--max-restarts" in text and "--nnodes \"1:$SLURM_NNODES\"" in text
    assert "ol.should_stop" in (EXAMPLES / "own_model.py").read_text()
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text  # a node joining late hangs the agents without it


def _pod(doc: dict) -> dict:
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return doc["spec"]["podTemplateOverrides"][0]["spec"]


def test_the_kubernetes_recipes_bound_restarts_give_a_grace_and_keep_a_directory_per_job():
    jobs = {p.name: yaml.safe_load(p.read_text()) for p in (EXAMPLES / "kubernetes").glob("*.yaml")}
    assert sorted(doc["kind"] for doc in jobs.values()) == ["PyTorchJob", "TrainJob"]
    for name, doc in jobs.items():
        pod = _pod(doc)
        container = pod["containers"][0]
        command = container.get("command") or doc["spec"]["trainer"]["command"]
        script = next(a for a in command if a.endswith(".py"))
        assert script.startswith("/"), (name, script)  # absolute: not the container's working directory's guess
        assert pod["terminationGracePeriodSeconds"] >= 90, name  # SIGTERM, then time for the final save
        directory = command[command.index("--checkpoint-dir") + 1]
        assert directory.endswith("$(JOB_NAME)"), (name, directory)
        assert any(e["name"] == "JOB_NAME" and "labels" in e["valueFrom"]["fieldRef"]["fieldPath"]
                   for e in container["env"]), name
    assert jobs["own_model_pytorchjob.yaml"]["spec"]["runPolicy"]["backoffLimit"] >= 1
    elastic = _pod(jobs["own_model_pytorchjob.yaml"])["containers"][0]["env"]  # maxReplicas: pods may join late
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in elastic
    assert jobs["own_model_trainjob.yaml"]["spec"]["runtimeRef"]["name"] == "torch-distributed"
