"""A job torchrun re-forms without a restart count (a node joined an elastic job) continues its own record
(omnilearn/observe/samejob.py): ``omnilearn.setup(out=DIR)`` is not refused for it (``overwrite=False``) and holds
its record until the script resumes it (as ``overwrite=True`` does for a re-run): resumed, the record goes on;
another job's run in DIR is refused or replaced as before.

Run: ``python -m pytest -q tests/unit/test_samejob.py``
"""

from __future__ import annotations

import json

import pytest

from omnilearn.observe import heldrun, samejob
from omnilearn.observe.rundir import RunDirError


@pytest.fixture
def torchrun_job(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a re-formed job keeps its count

    def job(run_id: str) -> None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    return job


def _setup(out, overwrite, held=None):
    """One attempt: setup (the record it holds for the script's resume read into ``held``), then a line of its own
    in the record, as a run writes it."""
    import omnilearn

    ol = omnilearn.setup(global_batch=8, device="cpu", handle_signals=False, out=str(out), overwrite=overwrite)
    if held is not None:
        held.append((out / heldrun.HELD / "metrics.jsonl").read_text())
    heldrun.drop(out)  # what the first control interval's end does (observe/rankrows.py): the attempt trained on
    ol.release()
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "eval"}) + "\n")


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_reformed_job_holds_its_record_for_the_resume_and_another_job_is_refused_or_replaces_it(
        tmp_path, torchrun_job, overwrite, capsys):
    out = tmp_path / "run"
    torchrun_job("slurm-4242")
    _setup(out, overwrite)
    assert (out / samejob.MARK).read_text() == "slurm-4242"
    held = []
    _setup(out, overwrite, held)  # the agents re-formed the job for a newcomer: same rendezvous, count still 0
    assert held[0].count("eval") == 1  # the job's record, held for the script's resume (not refused, not cleared)
    said = capsys.readouterr().err
    assert ("holds the record of this torchrun job (rendezvous 'slurm-4242')" in said) is not overwrite  # a line
    torchrun_job("slurm-4243")  # another job in the same directory
    if overwrite:
        _setup(out, True)
        assert (out / samejob.MARK).read_text() == "slurm-4243"
    else:
        with pytest.raises(RunDirError, match="already holds a run"):
            _setup(out, False)


def test_no_rendezvous_id_is_no_job(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    for run_id in ("", "none"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        assert samejob.job_id() is None and not samejob.again(tmp_path)
        samejob.mark(tmp_path)
        assert not (tmp_path / samejob.MARK).exists()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert samejob.restarted()


def test_a_rank_of_a_first_launch_that_finds_rank_0s_mark_does_not_resume_alone(tmp_path, torchrun_job, monkeypatch):
    """``omnilearn train`` under torchrun: every rank decides before joining whether it resumes. In a first launch
    rank 0 may have made and marked the run directory before a slower rank looks (it resumed alone, and the job
    hung); only a mark with a checkpoint beside it is a re-formed job."""
    from omnilearn.checkpoint import CheckpointStore
    from omnilearn.experiments.train import restarts

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    torchrun_job("job-7")
    out = tmp_path / "run"
    out.mkdir()
    samejob.mark(out)  # rank 0 was first
    assert not restarts.torchrun_restart(str(out))
    CheckpointStore(out / "checkpoints").save(3, {"step": 3})  # the stop of the job's last attempt
    assert restarts.torchrun_restart(str(out))
    torchrun_job("job-8")
    assert not restarts.torchrun_restart(str(out))
