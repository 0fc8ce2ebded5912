"""A Lightning checkpoint is the old file or the new one, whole, after a crash at any point of its save.

In this process (one rank), ``OmniLearnStrategy``'s ``trainer.save_checkpoint`` and ``OmniLearnFabricStrategy``'s
``fabric.save`` to a local path, with the system temp dir on "another filesystem" (:func:`crashes.other_filesystem`:
a rename out of it fails with ``EXDEV``, as across filesystems: shared checkpoint storage, a local ``/tmp``). The
crash (:class:`crashes.Ops` with ``files=True``): right after the k-th rename, removal or fsync of the save, or in
the middle of a copy, the process "dies": that call and every later one raise. For every k until the save
finishes, every checkpoint file in the directory loads whole (``torch.load``: the session's state, the model, the
tag of the save that wrote it), the old one or the new one; ``fit(ckpt_path=...)`` resumes the first crash's; and
the next save leaves no temporary file behind, beside the checkpoints or in the temp dir. Cases: the next step
beside an older checkpoint, and the same path saved again (``last.ckpt``, a stop at a step already saved).
Lightning's own save (before the fix) copies into the target in place: killed mid-copy (k=0), ``step=4.ckpt``,
``last.ckpt`` and Fabric's file are cut (``torch.load``: ``OSError: [Errno 22] Invalid argument``).

Also: a ``ModelCheckpoint`` (rotation through ``remove_checkpoint``, ``save_last="link"``, ``save_weights_only``)
leaves what it left before; a user's ``checkpoint_io`` plugin still writes; Lightning's names the save relies on.

Run: ``python -m pytest -q tests/dist/test_lightning_atomic.py``
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from crashes import Crash, Ops, other_filesystem
from needs import needs

# Lightning is imported where it is used: every pytest-xdist worker collects this file
pytestmark = [pytest.mark.dist, needs("lightning", "lightning")]
STATE_KEY = "omnilearn"


@pytest.fixture(autouse=True)
def temp_elsewhere(tmp_path, monkeypatch):
    """The system temp dir (``tempfile``'s) on another filesystem; fresh ``MASTER_PORT`` for each fit's group."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    systmp = tmp_path / "systmp"
    systmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))
    with other_filesystem(systmp):
        yield systmp


def fit(steps: int = 2, ckpt: str | None = None, **flags):
    import lightning.pytorch as pl
    from omnilearn.integrations.lightning import OmniLearnStrategy
    from test_lightning_exact import Net, data

    class Tagged(Net):
        tag = "none"

        def on_save_checkpoint(self, checkpoint: dict) -> None:
            checkpoint["tag"] = self.tag

    flags = {"enable_checkpointing": False, **flags}
    trainer = pl.Trainer(strategy=OmniLearnStrategy(global_batch=60, seed=0), accelerator="cpu", devices=1,
                         max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, **flags)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tagged(), DataLoader(data(360), batch_size=16, shuffle=True), ckpt_path=ckpt)
    return trainer


def tag(path: Path) -> str:
    """The tag of the save that wrote ``path`` when it loads whole, else what is wrong with it."""
    try:
        checkpoint = torch.load(path, weights_only=False)
    except Exception as e:  # a cut file: the failure, for the assertion's message
        return f"cut: {type(e).__name__}: {str(e)[:80]}"
    model = checkpoint.get("state_dict") or checkpoint.get("model")
    return checkpoint.get("tag", "untagged") if STATE_KEY in checkpoint and model else "incomplete"


def crash_everywhere(tmp_path: Path, systmp: Path, save, first: str, second: str) -> Path:
    """``save(second, "new")`` beside ``save(first, "old")``, crashed after each of its steps in turn (a fresh
    directory each); checks each crash and the next save. Returns the first crash's directory."""
    k = 0
    while True:
        directory = tmp_path / f"crash-{k}"
        save(directory / first, "old")
        try:
            with Ops(k, files=True):
                save(directory / second, "new")
            finished = True
        except Crash:
            finished = False
        found = {p.name: tag(p) for p in directory.iterdir() if not p.name.startswith(".")}
        wanted = {"old", "new"} if first == second else {"new", None}
        assert found.get(second) in wanted and (first == second or found[first] == "old"), (k, found)
        assert set(found) <= {first, second}, (k, found)
        save(directory / "step=6.ckpt", "next")  # the next save sweeps what the crash left
        left = [p.name for p in directory.iterdir() if p.name.startswith(".")] + [
            p.name for p in systmp.iterdir() if p.is_file()]  # (torch keeps a cache folder in the temp dir)
        assert not left, (k, left)
        assert tag(directory / "step=6.ckpt") == "next", k
        if finished:
            assert k >= 3, k  # it died after the temp file's fsync, the rename and the directory's fsync
            return tmp_path / "crash-0"
        k += 1


@pytest.mark.parametrize("second", ["step=4.ckpt", "last.ckpt"], ids=["next-step", "same-path-again"])
def test_a_crash_anywhere_in_a_trainer_save_leaves_the_old_or_the_new_checkpoint(tmp_path, temp_elsewhere, second):
    trainer = fit()

    def save(path: Path, value: str) -> None:
        trainer.lightning_module.tag = value
        trainer.save_checkpoint(path)

    first = "last.ckpt" if second == "last.ckpt" else "step=2.ckpt"
    directory = crash_everywhere(tmp_path, temp_elsewhere, save, first, second)
    resumed = fit(steps=3, ckpt=str(directory / (second if (directory / second).exists() else first)))
    assert resumed.global_step == 3 and resumed.strategy.session.steps_done == 3


def test_a_crash_anywhere_in_a_fabric_save_leaves_the_old_or_the_new_checkpoint(tmp_path, temp_elsewhere):
    from omnilearn.integrations.lightning_fabric import OmniLearnFabricStrategy
    from test_lightning_resume import fabric_loop

    strategy = OmniLearnFabricStrategy(global_batch=60, seed=0, total_steps=4)
    fabric, model, opt = fabric_loop(strategy, samples=360, finish=False)

    def save(path: Path, value: str) -> None:
        fabric.save(path, {"model": model, "optimizer": opt, "tag": value})

    directory = crash_everywhere(tmp_path, temp_elsewhere, save, "fabric.ckpt", "fabric.ckpt")
    state = {"model": model, "optimizer": opt}
    assert fabric.load(directory / "fabric.ckpt", state)["tag"] in {"old", "new"}
    strategy.session.finish()


def test_model_checkpoint_rotation_link_and_weights_only_work_as_before(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    keep = ModelCheckpoint(dirpath=tmp_path / "keep", every_n_train_steps=1, save_top_k=1, save_last="link")
    weights = ModelCheckpoint(dirpath=tmp_path / "weights", every_n_train_steps=2, save_top_k=-1,
                              save_weights_only=True, save_last=True)
    fit(steps=4, enable_checkpointing=True, callbacks=[keep, weights])
    link = tmp_path / "keep" / "last.ckpt"
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert link.is_symlink() and link.resolve().name == "epoch=0-step=4.ckpt" and tag(link) == "none"
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt",
                                                                       "last.ckpt"]
    saved = torch.load(tmp_path / "weights" / "last.ckpt", weights_only=False)
    assert "optimizer_states" not in saved and saved["global_step"] == 4 and STATE_KEY in saved


def test_a_users_checkpoint_io_plugin_still_writes(tmp_path):
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class Counting(TorchCheckpointIO):
        saved: list = []

        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            self.saved.append(Path(path).name)
            super().save_checkpoint(checkpoint, path, storage_options)

    fit(plugins=[Counting()]).save_checkpoint(tmp_path / "mine.ckpt")
    assert Counting.saved == ["mine.ckpt"] and tag(tmp_path / "mine.ckpt") == "none"


def test_the_sweep_leaves_what_a_live_writer_may_still_rename(tmp_path):
    """Swept: the temp files of ``.ckpt`` writes by this process or a gone one. Kept: a live process's (a survivor
    on this host), one whose survivors' lock is held (a survivor maybe on another host), other files' temps."""
    import fcntl
    import os
    import subprocess
    import sys

    from omnilearn.integrations.lightning_save import sweep_cut_writes
    from omnilearn.integrations.lightning_rescue import lock_of

    directory = tmp_path / "checkpoints"
    directory.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone, live = int(gone.stdout), os.getppid()
    swept = [f".step=3.ckpt.{os.getpid()}.tmp", f".last.ckpt.{gone}.tmp"]
    kept = [f".step=5.ckpt.{live}.tmp", f".held.ckpt.{gone}.tmp", f".metrics.json.{gone}.tmp", "step=4.ckpt"]
    for name in swept + kept:
        (directory / name).write_bytes(b"cut")
    with open(lock_of(directory / "held.ckpt"), "a+") as survivor:
        fcntl.flock(survivor, fcntl.LOCK_EX)
        sweep_cut_writes(directory / "step=6.ckpt")
    assert sorted(p.name for p in directory.iterdir() if ".omnilearn" not in p.name) == sorted(kept)


def test_lightnings_save_is_still_what_the_atomic_write_replaces():
    """The doors skip ``Strategy.save_checkpoint`` for their own write: it must still be "rank 0 hands the dict to
    the checkpoint IO" (Fabric's after ``_convert_stateful_objects_in_state``), the default IO Lightning's
    ``TorchCheckpointIO``, and its write ``torch.save`` of the dict (``_atomic_save``). A failure: Lightning's save
    changed under the doors (lightning_private_names)."""
    from lightning.fabric.plugins.io import TorchCheckpointIO
    from lightning.fabric.strategies.strategy import Strategy as FabricStrategy
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch.strategies.strategy import Strategy
    from omnilearn.integrations.lightning import OmniLearnStrategy
    from omnilearn.integrations.lightning_fabric import OmniLearnFabricStrategy

    assert set(Strategy.save_checkpoint.__code__.co_names) == {"is_global_zero", "checkpoint_io", "save_checkpoint"}
    assert set(FabricStrategy.save_checkpoint.__code__.co_names) == {
        "_convert_stateful_objects_in_state", "is_global_zero", "checkpoint_io", "save_checkpoint"}
    assert "_atomic_save" in TorchCheckpointIO.save_checkpoint.__code__.co_names
    assert {"torch", "save"} <= set(cloud_io._atomic_save.__code__.co_names)
    assert type(OmniLearnStrategy().checkpoint_io) is TorchCheckpointIO
    assert type(OmniLearnFabricStrategy().checkpoint_io) is TorchCheckpointIO
