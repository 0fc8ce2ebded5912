"""``OmniLearnTrainer``'s save is atomic, the same step saved again included: a kill at any point leaves the old or
the new checkpoint, whole, to resume, and the next save leaves no leftovers.

In this process (1 worker: the door runs in-process at world size 1), test_hf_resume_every_step's tiny float64
regressor. A checkpoint ``checkpoint-2`` ("old": one model) is there; another run (another model's weights, so
every part differs) saves (a) the next step, ``checkpoint-3``, with ``save_total_limit=1`` (the rotation removes
the old one) or (b) ``checkpoint-2`` again, over the complete old folder (what ``save_strategy="epoch"`` and a stop
mid-epoch do: the stop's save, then the epoch's; and a run started afresh, or resumed from an older checkpoint, in
an ``output_dir`` holding newer ones). The crash: the process "dies" just before the k-th rename or removal of the
save (``os.replace``, ``os.unlink``, ``shutil.rmtree``: moving the folder aside, the mark's rename, removing the
aside, the rotation; each file an ``rmtree`` unlinks counts too: a kill mid-removal) and every later one; before
the mark's rename is where Trainer has written its folder and the mark is not there yet (its files, written from
Rust and by ``torch.save``, cannot be cut here). For k = 0, 1, ... until the save finishes (10 and 11 kills):

- :func:`latest_complete` finds a checkpoint and every part of it (weights, optimizer, scheduler, Trainer state,
  RNG state, arguments) is the part of the save its session file names: the old one or the new one, never a mix;
- ``train(resume_from_checkpoint=True)`` resumes that step and trains on; its saves leave only the newest
  complete folder (``save_total_limit=1``): no aside, no cut folder, no claim (the killed save's claim, which
  names a process gone, is swept).

Also: a stop mid-epoch with ``save_strategy="epoch"`` really saves a complete step again, and Trainer's
checkpoint listing ignores an aside (a dot name), so its rotation and ``get_last_checkpoint`` never take one.

Run: ``python -m pytest -q tests/dist/test_hf_atomic.py`` (about 8 s alone, 4 of them importing transformers).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from crashes import Crash
from needs import needs
from test_hf_resume_every_step import Regressor, Rows

pytestmark = [pytest.mark.dist, needs("transformers", "hf"), needs("accelerate", "hf")]

OLD = 2  # the step of the checkpoint there before the save


@pytest.fixture(scope="module", autouse=True)
def frozen():
    """transformers imported, then what this process holds frozen: Trainer's ``gc.collect()`` at every ``train()``
    walked it (about 1 s a run; 0.1 s frozen)."""
    import transformers.trainer  # noqa: F401

    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


class Before:
    """While entered: ``os.replace``, ``os.unlink`` (``Path.unlink``) and ``shutil.rmtree`` that die just before
    their ``k``-th call (``k`` = 0: the first) runs, and at every later one: a kill between two filesystem steps,
    the one before the first and the one before the mark's rename included."""

    def __init__(self, k: int) -> None:
        self.k, self.calls = k, 0
        self.originals = os.replace, os.unlink, shutil.rmtree

    def __enter__(self) -> "Before":
        os.replace, os.unlink, shutil.rmtree = (self.wrap(op) for op in self.originals)
        return self

    def __exit__(self, *_exc) -> None:
        os.replace, os.unlink, shutil.rmtree = self.originals

    def wrap(self, op):
        def call(*args, **kwargs):
            if self.calls >= self.k:
                raise Crash()
            self.calls += 1
            return op(*args, **kwargs)
        return call


def trainer(out: Path, steps: int, tag: str, model_seed: int = 0, every: int = 1, strategy: str = "steps"):
    """A 1-worker ``OmniLearnTrainer`` to ``steps``, saving every ``every`` steps and keeping 1; its session files
    carry ``tag`` (which save wrote them). ``model_seed`` other than 0: other initial weights."""
    from transformers import TrainingArguments

    from omnilearn.integrations.hf import OmniLearnTrainer

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=steps, learning_rate=0.05,
                             dataloader_drop_last=True, save_strategy=strategy, save_steps=every, save_total_limit=1,
                             logging_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    model, g = Regressor(), torch.Generator().manual_seed(model_seed)
    if model_seed:  # another run's weights: every part of its checkpoint differs from the old one's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    t = OmniLearnTrainer(model=model, args=args, train_dataset=Rows(),
                         omnilearn=dict(global_batch=8, control_interval=3, min_batch=1))
    state_dict = t.session.state_dict
    t.session.state_dict = lambda: {**state_dict(), "test_save": tag}
    return t


def parts(folder: Path) -> dict:
    """Every part of a checkpoint folder, loaded (the arguments without their paths), and its session file's tag;
    not a killed write's temporary file (a dot name)."""
    from safetensors.torch import load_file

    from omnilearn.integrations.hf_checkpoint import SESSION_FILE

    out = {}
    for f in sorted(folder.iterdir()):
        if f.name.startswith("."):
            continue
        if f.name == SESSION_FILE:
            out[f.name] = torch.load(f, weights_only=True)["test_save"]
        elif f.suffix == ".safetensors":
            out[f.name] = load_file(f)
        elif f.suffix == ".json":
            out[f.name] = json.loads(f.read_text())
        elif f.name == "training_args.bin":
            out[f.name] = {k: v for k, v in torch.load(f, weights_only=False).to_dict().items() if "dir" not in k}
        else:
            out[f.name] = torch.load(f, weights_only=False)
    return out


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


def save(out: Path, step: int, tag: str, model_seed: int, kill_before: int | None = None) -> bool:
    """A run to ``step`` saving only there; False when it crashed (``kill_before``: :class:`Before`)."""
    run = trainer(out, step, tag, model_seed, every=step)
    try:
        with Before(kill_before) if kill_before is not None else contextlib.nullcontext():
            run.train()
        return True
    except Crash:
        run.session.close()
        as_if_dead(out)
        return False


def as_if_dead(out: Path) -> None:
    """The claims the "killed" save left name a process gone, as a real kill's do (this process lives on)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a pid that no longer runs
    for claim in out.glob(".*.claim"):
        host, _, started = claim.read_text().split()
        claim.write_text(f"{host} {pid} {started}\n")


@pytest.mark.filterwarnings("ignore:.*cut short mid-save")  # the new step's folder, cut before its mark
@pytest.mark.parametrize("step", [OLD + 1, OLD], ids=["next-step-keep-1", "same-step-again"])
def test_a_kill_anywhere_in_a_save_leaves_the_old_or_the_new_checkpoint_whole(tmp_path, step):
    from omnilearn.integrations.hf_checkpoint import latest_complete

    assert save(tmp_path / "before", OLD, "old", model_seed=0)
    assert save(tmp_path / "alone", step, "new", model_seed=1)  # the new checkpoint, written without a crash
    wanted = {"old": parts(tmp_path / "before" / f"checkpoint-{OLD}"),
              "new": parts(tmp_path / "alone" / f"checkpoint-{step}")}
    assert not same(wanted["old"]["model.safetensors"], wanted["new"]["model.safetensors"])
    k = 0
    while True:
        out = tmp_path / f"kill-{k}"
        shutil.copytree(tmp_path / "before", out)
        finished = save(out, step, "new", model_seed=1, kill_before=k)
        found = Path(latest_complete(out))
        got = parts(found)
        tag = got["omnilearn_session.pt"]
        torn = sorted(n for n in got.keys() | wanted[tag].keys() if not same(got.get(n), wanted[tag].get(n)))
        assert not torn, f"kill before call {k}: {found.name} has the {tag} session file, but not the {tag} {torn}"
        assert tag == "new" or not finished, f"the save finished, {found.name} is still the old one"
        resumed = trainer(out, step + 1, "next")
        resumed.train(resume_from_checkpoint=True)  # each step saved: the rotation keeps the last
        assert resumed.session.resumed_from[0] == (OLD if tag == "old" else step), (k, tag)
        left = sorted(os.listdir(out))
        assert left == [f"checkpoint-{step + 1}"], f"kill before call {k}: the next saves left {left}"
        if finished:
            break
        k += 1
    assert k >= (4 if step == OLD else 2), k  # the aside, the mark, the aside's removal, the rotation were hit


def test_a_stop_mid_epoch_with_epoch_saves_saves_a_complete_step_again(tmp_path, monkeypatch):
    """The path that saves a step twice in one run: the stop's save after the step, then the epoch's."""
    from transformers import TrainerCallback

    from omnilearn import stopping
    from omnilearn.integrations import hf_checkpoint

    saves, save = [], hf_checkpoint.save
    monkeypatch.setattr(hf_checkpoint, "save", lambda session, folder, *a, **k: (
        saves.append((Path(folder).name, hf_checkpoint.complete(folder))), save(session, folder, *a, **k)))

    class Stop(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                stopping.request_stop("the test")

    run = trainer(tmp_path, 10, "run", strategy="epoch")  # 5 steps an epoch
    run.add_callback(Stop())
    try:
        run.train()
    finally:
        stopping.clear()
    step = run.state.global_step
    assert step < 5 and saves == [(f"checkpoint-{step}", False), (f"checkpoint-{step}", True)], saves
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint-{step}"]  # the first save's aside removed
    assert Path(hf_checkpoint.latest_complete(tmp_path)).name == f"checkpoint-{step}"


def test_trainers_checkpoint_listing_ignores_an_aside(tmp_path):
    """Private behaviour the door relies on: Trainer's rotation (``sort_checkpoints``) and ``get_last_checkpoint``
    list ``checkpoint-<n>`` names only, so an aside (``.checkpoint-<n>.old-<pid>``) is never rotated or resumed."""
    from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints

    for name in ["checkpoint-1", ".checkpoint-2.old-7"]:
        (tmp_path / name).mkdir()
    assert [Path(p).name for p in sort_checkpoints(str(tmp_path), use_mtime=True)] == ["checkpoint-1"]
    assert Path(get_last_checkpoint(str(tmp_path))).name == "checkpoint-1"


def test_an_ordinary_save_never_writes_over_a_survivors_save_of_the_same_step(tmp_path, monkeypatch):
    """A survivor's save of the step holds its claim (a live process: here this test's parent); rank 0's ordinary
    save of that step waits for it (here not at all: ``wait_s=0``) and then fails naming it, writing nothing: the
    complete folder there stays as it was, no aside."""
    import functools
    import socket

    from omnilearn import commit
    from omnilearn.integrations import hf_checkpoint

    assert save(tmp_path, OLD, "old", model_seed=0)
    before = parts(tmp_path / f"checkpoint-{OLD}")
    writer = os.getppid()
    (tmp_path / f".checkpoint-{OLD}.claim").write_text(f"{socket.gethostname()} {writer} "
                                                      f"{commit.start_time(writer)}\n")
    monkeypatch.setattr(hf_checkpoint, "held", functools.partial(commit.held, wait_s=0))
    run = trainer(tmp_path, OLD, "new", model_seed=1, every=OLD)
    with pytest.raises(RuntimeError, match="held by another writer of the same checkpoint"):
        run.train()
    run.session.close()
    assert same(parts(tmp_path / f"checkpoint-{OLD}"), before)
    assert sorted(os.listdir(tmp_path)) == [f".checkpoint-{OLD}.claim", f"checkpoint-{OLD}"]
