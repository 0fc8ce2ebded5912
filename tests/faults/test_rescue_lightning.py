"""A crash costs one step with Lightning: ``OmniLearnStrategy`` under ``torchrun --max-restarts 1``.

tests/faults/lightning_rescue_script.py: the float64 MLP of tests/dist/test_lightning_exact.py on 3 workers,
``accumulate_grad_batches=2``, the static split, an ``OnExceptionCheckpoint`` and no periodic checkpoint. Rank 0
(the rank Lightning lets write) SIGKILLs itself at the end of step 4: a survivor writes the Lightning checkpoint of
step 4 alone (the loop's progress as at that step's end: at the failure Lightning is one micro-batch into step 5),
and the agent's restart resumes it with ``fit(ckpt_path="last")``, ending with the uninterrupted run's weights:
those of one plain process's SGD on the same global batches (``test_lightning_exact.reference``, which the
uninterrupted 3-rank runs are held to there; relative 1e-12), computed here instead of a third torchrun.
torchrun runs without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the strategy makes the group in a key space of
the round's own, so the restart re-forms it (without that, this restart hung).

Lightning Fabric (tests/faults/fabric_rescue_script.py, the same model in a loop of its own): the same kill, a
survivor writes ``strategy.save_on_failure``'s path, the restarted loop's ``fabric.load`` resumes it.

The unit tests hold the one-writer rule, where the file goes, and the SIGTERM handler that cannot raise a lost
peer's error into a step (Lightning's broadcasts from inside the handler: torchrun's agent SIGTERMs the
survivors while they save, and 2 runs of 7 by hand had lost their save to it before).

Run: ``python -m pytest -q tests/faults/test_rescue_lightning.py``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import agents
import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402

from omnilearn.integrations import lightning_rescue  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from test_lightning_exact import EXACT_F64, diff, reference  # noqa: E402  (the scripts' model, data and plan)

STEPS = 10  # the scripts' steps

SCRIPT = Path(__file__).with_name("lightning_rescue_script.py")
FABRIC_SCRIPT = Path(__file__).with_name("fabric_rescue_script.py")


def torchrun(out: Path, *args: str, restarts: int = 0, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    """torchrun's agent forking its ranks from the preloaded fork server (tests/agents.py)."""
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # not needed: the strategy keys its group by round
    done = agents.torchrun("--standalone", "--nproc-per-node", "3", "--max-restarts", str(restarts), str(script),
                           str(out), *args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def ends_uninterrupted(out: Path) -> None:
    """The restarted run's weights are the uninterrupted run's: one plain process's SGD on the same global batches
    (``test_lightning_exact.reference``; that a 3-rank run, Lightning's or Fabric's, ends there is what
    tests/dist/test_lightning_exact.py and test_lightning_fabric.py check), relative 1e-12."""
    got, expected = torch.load(out / "final.pt", weights_only=True), reference(STEPS)
    assert diff(got, expected) < EXACT_F64, diff(got, expected)


def test_a_killed_writer_costs_one_step(tmp_path):
    killed = tmp_path / "killed"
    done = torchrun(killed, "0:4", restarts=1)
    saved = [line for line in done.stderr.splitlines() if "saved the Lightning checkpoint of step 4" in line]
    assert len(saved) == 1, done.stderr[-3000:]
    assert saved[0].startswith(("omnilearn: rank 1 lost a peer at step 4", "omnilearn: rank 2 lost a peer at step 4"))
    again = json.loads((killed / "attempt-1.json").read_text())
    assert (again["start"], again["world"]) == (4, 3)
    assert not (killed / "ck" / "on_exception.ckpt").exists()  # the resumed fit ended well: Lightning removed it
    assert not (killed / "ck" / ".on_exception.ckpt.omnilearn").exists()  # and the survivors' lock file: swept
    ends_uninterrupted(killed)


def test_a_fabric_loop_costs_one_step_too(tmp_path):
    """``OmniLearnFabricStrategy``: rank 0 killed after step 4; a survivor writes ``strategy.save_on_failure``'s
    path, the restarted loop's ``fabric.load`` resumes at 4 and ends with the uninterrupted loop's weights."""
    killed = tmp_path / "killed"
    done = torchrun(killed, "0:4", restarts=1, script=FABRIC_SCRIPT)
    assert len([line for line in done.stderr.splitlines() if "saved the Lightning checkpoint of step 4" in line]) == 1
    again = json.loads((killed / "attempt-1.json").read_text())
    assert (again["start"], again["world"]) == (4, 3)
    ends_uninterrupted(killed)


class Trainer:
    def __init__(self, *callbacks) -> None:
        self.callbacks = list(callbacks)


def test_the_file_is_lightnings_own_for_a_failed_fit(tmp_path):
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path / "a", filename="boom")
    last = ModelCheckpoint(dirpath=tmp_path / "b", save_last=True)
    assert lightning_rescue.target(Trainer(last, on_exception)) == tmp_path / "a" / "boom.ckpt"
    assert lightning_rescue.target(Trainer(last)) == tmp_path / "b" / "last.ckpt"
    assert lightning_rescue.target(Trainer(ModelCheckpoint(dirpath=tmp_path / "b"))) is None  # no save_last
    assert lightning_rescue.target(Trainer()) is None


def test_one_writer_and_never_an_older_step_over_a_newer(tmp_path):
    path = tmp_path / "ck" / "on_exception.ckpt"
    seen = time.time()
    said = lightning_rescue.write_newest(path, 7, seen, lambda f: f.write(b"step 7"))
    assert said.startswith("saved the Lightning checkpoint of step 7") and path.read_bytes() == b"step 7"
    # a survivor one step behind, or another of the same step: the file stays
    assert "holds step 7, saved by another survivor" in lightning_rescue.write_newest(path, 6, seen, lambda f: f.write(b"6"))
    assert "holds step 7" in lightning_rescue.write_newest(path, 7, seen, lambda f: f.write(b"7 again"))
    assert path.read_bytes() == b"step 7"
    # a survivor one step ahead replaces it
    lightning_rescue.write_newest(path, 8, seen, lambda f: f.write(b"step 8"))
    assert path.read_bytes() == b"step 8"
    # an older failure's record does not hold back a later one (a run resumed from an older checkpoint)
    later = seen + lightning_rescue.FRESH_S + 1
    lightning_rescue.write_newest(path, 5, later, lambda f: f.write(b"step 5"))
    assert path.read_bytes() == b"step 5"
    assert sorted(p.name for p in path.parent.iterdir()) == [".on_exception.ckpt.omnilearn", "on_exception.ckpt"]


def test_a_write_that_fails_leaves_the_file_whole(tmp_path):
    path = tmp_path / "on_exception.ckpt"
    lightning_rescue.write_newest(path, 3, time.time(), lambda f: f.write(b"step 3"))

    def cut(f):
        f.write(b"half")
        raise OSError("disk gone")

    with pytest.raises(OSError):
        lightning_rescue.write_newest(path, 4, time.time(), cut)
    assert path.read_bytes() == b"step 3"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".on_exception.ckpt.omnilearn", "on_exception.ckpt"]


def test_a_sigterm_handler_cannot_raise_a_lost_peers_error_into_the_step():
    calls = []

    def lightning_like(signum, frame):  # Lightning's: a broadcast from inside the handler
        calls.append(signum)
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")

    lightning_rescue.PeerSafe(lightning_like)(15, None)  # dropped: the next collective fails at a known point
    assert calls == [15]

    def broken(signum, frame):
        raise ValueError("the handler's own bug")

    with pytest.raises(ValueError, match="own bug"):
        lightning_rescue.PeerSafe(broken)(15, None)


def test_the_boundary_gives_the_loop_state_of_the_last_step_end():
    """What the survivor writes of Lightning's loop: ``fit_loop.state_dict()`` as at the mark (a step's end), with
    the live counters put back after; kept at a fifth of that call's cost."""
    import warnings

    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(max_steps=5, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, accelerator="cpu", devices=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=8))
    boundary = lightning_rescue.Boundary()
    trainer.callbacks.append(OnExceptionCheckpoint(dirpath="unused"))
    assert not boundary.track(trainer, 1) and boundary.track(trainer, 2)  # one rank: nothing to rescue
    at_mark = trainer.fit_loop.state_dict()
    boundary.mark(trainer, 5)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.increment_ready()  # the next step goes on: its counters move
    progress.increment_started()
    trainer.fit_loop.epoch_loop._batches_that_stepped += 1
    moved = trainer.fit_loop.state_dict()
    assert moved != at_mark
    assert boundary.loop_state(trainer) == at_mark
    assert trainer.fit_loop.state_dict() == moved  # the live loop as it was
