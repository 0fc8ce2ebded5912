"""What the TensorFlow launcher says when a worker ends badly: one blame line, and the survivors' own lines.

Pure: the workers are finished stand-ins (their exit codes) and their logs are files. A worker killed by a
signal is not blamed with whatever it last printed (a user's print, TensorFlow's logging): only a line
OmniLearn wrote (a watcher saying why it killed its worker) is quoted. What each survivor of a lost peer saved
(``omnilearn: worker R lost a peer at step S ...; saved ...``) is on the console, not only in its log, which a
restart moves away (issue 50).

Run: ``python -m pytest -q tests/unit/test_tf_blame.py``
"""

from __future__ import annotations

import signal

import pytest

from omnilearn.experiments.launch import tfworkers
from omnilearn.experiments.launch.supervise import WorkerFailed


class Done:
    def __init__(self, code: int) -> None:
        self.returncode = code

    def poll(self) -> int:
        return self.returncode


def write_logs(run, *texts: str) -> None:
    for rank, text in enumerate(texts):
        tfworkers.log_path(run, rank).write_text(text)


def test_a_killed_worker_is_not_blamed_with_its_last_print_and_the_survivors_lines_reach_the_console(tmp_path,
                                                                                                     capsys):
    saved = ("omnilearn: worker 0 lost a peer at step 20 (recvmsg: Connection reset by peer); saved the checkpoint "
             "of step 20 in 0.31 s to /run/checkpoints/step-000000020: a restart resumes there")
    write_logs(tmp_path, f"epoch 1 done\n{saved}\nTraceback (most recent call last):\n  ...\n",
               "loss 0.25\nepoch 1 done\n")
    with pytest.raises(WorkerFailed) as failed:
        tfworkers._outcome([Done(1), Done(-signal.SIGKILL)], tmp_path, first=1)
    log = tfworkers.log_path(tmp_path, 1)
    assert str(failed.value) == f"TensorFlow worker 1 failed (killed by SIGKILL) (log: {log})"
    assert capsys.readouterr().err.splitlines() == [saved]


def test_a_line_omnilearn_wrote_before_the_kill_is_the_cause(tmp_path, capsys):
    why = "omnilearn: error: worker 0: worker 1 (localhost:2222) did not join the TensorFlow cluster within 6 s"
    write_logs(tmp_path, f"starting\n{why}\n", "")
    with pytest.raises(WorkerFailed, match="killed by SIGKILL\\): worker 0: worker 1 \\(localhost:2222\\) did not"):
        tfworkers._outcome([Done(-signal.SIGKILL), Done(-signal.SIGTERM)], tmp_path, first=0)
    write_logs(tmp_path, "", "Traceback (most recent call last):\nValueError: bad shape\n")
    with pytest.raises(WorkerFailed, match="exit 1\\): ValueError: bad shape"):  # an exit: its last line says why
        tfworkers._outcome([Done(-signal.SIGTERM), Done(1)], tmp_path, first=1)
    assert capsys.readouterr().err == ""  # no survivor saved anything here
