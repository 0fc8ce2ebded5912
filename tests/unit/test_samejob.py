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
        tmp_path, torchrun_job, overwrite):
    out = tmp_path / "run"
    torchrun_job("slurm-4242")
    _setup(out, overwrite)
    assert (out / samejob.MARK).read_text() == "slurm-4242"
    held = []
    _setup(out, overwrite, held)  # the agents re-formed the job for a newcomer: same rendezvous, count still 0
    assert held[0].count("eval") == 1  # the job's record, held for the script's resume (not refused, not cleared)
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
