"""``OmniLearnTrainer`` fails loudly or not at all: complete-or-absent checkpoints, Trainer's DDP and save settings.

- A save cut short (right after Trainer wrote its folder, or in the session
  file's write) with ``save_total_limit=1``: the previous complete
  checkpoint survives, ``resume_from_checkpoint=True`` warns about the cut
  folder and resumes it to the end. A folder of cut checkpoints only is
  refused in one line.
- 2 real gloo ranks (torchrun's environment), each its own "node"
  (``LOCAL_RANK=0`` and its own ``output_dir``): a model with an unused
  parameter trains 3 steps with ``ddp_find_unused_parameters=True``, and with
  ``save_on_each_node=True`` both nodes' checkpoint folders hold the session
  file, rank 1's copy resuming in one process.
- Resuming with another seed is refused in one line naming ``omnilearn=dict(seed=...)``.
- ``train_sampling_strategy`` other than ``"random"`` is refused naming it.

Run: ``python -m pytest -q tests/dist/test_hf_trust.py`` (about 30 s on 2 cores).
"""

from __future__ import annotations

import os

import pytest
from needs import needs
from ranks import start_ranks
import torch
from torch import nn

from omnilearn.config import ConfigError

pytestmark = [pytest.mark.dist, needs("transformers", "hf"), needs("accelerate", "hf")]

SAVE, STEPS = 2, 6


def one_process_trainer(out, steps: int = STEPS, seed: int | None = None, **arguments):
    """test_hf_exact's 1-layer float64 GPT-2 over padded sequences, saving every ``SAVE`` steps, keeping 1."""
    from test_hf_exact import Padded, model, token_loss_f64
    from transformers import TrainingArguments

    from omnilearn.integrations.hf import OmniLearnTrainer

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=steps, learning_rate=1e-2,
                             save_strategy="steps", save_steps=SAVE, save_total_limit=1, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, **arguments)
    settings = {} if seed is None else {"seed": seed}
    return OmniLearnTrainer(model=model(), args=args, train_dataset=Padded(), compute_loss_func=token_loss_f64,
                            omnilearn=settings)


def cut_after_trainer_folder(monkeypatch):
    """Trainer's second save writes its folder, then the process 'dies' before the session file."""
    from transformers import Trainer

    original, calls = Trainer._save_checkpoint, []

    def cut(self, model, trial):
        original(self, model, trial)
        calls.append(self.state.global_step)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed after Trainer's folder")

    monkeypatch.setattr(Trainer, "_save_checkpoint", cut)


def cut_in_session_write(monkeypatch):
    """The second session file's write (the commit mark) fails: a full disk, a kill mid-write."""
    from omnilearn import commit
    from omnilearn.integrations.hf_checkpoint import SESSION_FILE

    original, calls = commit.write_atomic, []

    def cut(path, write):
        if path.name == SESSION_FILE:
            calls.append(path)
            if len(calls) == 2:
                raise OSError("killed mid-write")
        original(path, write)

    monkeypatch.setattr(commit, "write_atomic", cut)


@pytest.mark.parametrize("inject", [cut_after_trainer_folder, cut_in_session_write])
def test_a_cut_save_leaves_the_previous_checkpoint_resumable(tmp_path, monkeypatch, inject):
    from omnilearn.integrations.hf_checkpoint import SESSION_FILE, CutCheckpointWarning

    with monkeypatch.context() as m:
        inject(m)
        cut = one_process_trainer(tmp_path)
        with pytest.raises((KeyboardInterrupt, RuntimeError)):
            cut.train()
        cut.session.close()
    assert (tmp_path / f"checkpoint-{SAVE}" / SESSION_FILE).is_file(), sorted(os.listdir(tmp_path))
    assert not (tmp_path / f"checkpoint-{2 * SAVE}" / SESSION_FILE).exists()
    resumed = one_process_trainer(tmp_path)
    with pytest.warns(CutCheckpointWarning, match=f"checkpoint-{2 * SAVE} .*resuming checkpoint-{SAVE}"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.session.resumed_from[0] == SAVE and resumed.state.global_step == STEPS
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint-{STEPS}"]  # rotated once each new one was complete
    assert (tmp_path / f"checkpoint-{STEPS}" / SESSION_FILE).is_file()


def test_only_cut_checkpoints_are_refused_in_one_line(tmp_path):
    from omnilearn.integrations.hf_checkpoint import latest_complete

    (tmp_path / "checkpoint-4").mkdir()
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint=True: .* only cut-short folders .*checkpoint-4") as e:
        latest_complete(tmp_path)
    assert "\n" not in str(e.value)


def test_resuming_with_another_seed_is_refused_naming_the_keyword(tmp_path):
    first = one_process_trainer(tmp_path, steps=SAVE)
    first.train()
    other = one_process_trainer(tmp_path, seed=5)
    with pytest.raises(ConfigError, match=r"omnilearn=dict\(seed=0\)") as e:
        other.train(resume_from_checkpoint=True)
    assert "\n" not in str(e.value) and "resume_from_checkpoint=" in str(e.value)
    other.session.close()


@pytest.mark.parametrize("setting, named", [(dict(train_sampling_strategy="group_by_length"),
                                             "train_sampling_strategy='group_by_length'"),
                                            (dict(ddp_static_graph=True), "ddp_static_graph=True"),
                                            (dict(ddp_broadcast_buffers=True), "ddp_broadcast_buffers=True")])
def test_settings_the_door_cannot_honour_are_refused_naming_them(tmp_path, setting, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")) as e:
        one_process_trainer(tmp_path, **setting)
    assert "\n" not in str(e.value)


class Unused(nn.Module):
    """A regression whose ``spare`` layer never takes part in the loss (DDP needs find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used, self.spare = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": nn.functional.mse_loss(self.used(x).squeeze(-1), labels)}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


def _node(rank: int, world: int, port: int, out: str) -> None:
    """One rank as the only process of its own node: LOCAL_RANK 0, its own output_dir."""
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from transformers import TrainingArguments

    from omnilearn.distributed import group
    from omnilearn.integrations.hf import OmniLearnTrainer

    args = TrainingArguments(output_dir=f"{out}/node{rank}", per_device_train_batch_size=4, max_steps=3,
                             save_strategy="steps", save_steps=SAVE, save_on_each_node=True,
                             ddp_find_unused_parameters=True, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = OmniLearnTrainer(model=Unused(), args=args, train_dataset=Pairs())
    trainer.train()
    torch.save({"step": trainer.state.global_step}, f"{out}/rank{rank}.pt")
    group.destroy()


def test_unused_parameters_and_a_checkpoint_on_each_node(tmp_path):
    from test_hf_exact import free_port
    from transformers import TrainingArguments

    from omnilearn.integrations.hf import OmniLearnTrainer
    from omnilearn.integrations.hf_checkpoint import SESSION_FILE

    start_ranks(_node, (2, free_port(), str(tmp_path)), 2)
    assert [torch.load(tmp_path / f"rank{r}.pt")["step"] for r in range(2)] == [3, 3]
    for rank in range(2):
        assert (tmp_path / f"node{rank}" / f"checkpoint-{SAVE}" / SESSION_FILE).is_file(), f"node {rank}"
    args = TrainingArguments(output_dir=str(tmp_path / "node1"), per_device_train_batch_size=4, max_steps=3,
                             report_to=[], use_cpu=True, disable_tqdm=True)
    resumed = OmniLearnTrainer(model=Unused(), args=args, train_dataset=Pairs(), omnilearn=dict(global_batch=8))
    resumed.train(resume_from_checkpoint=str(tmp_path / "node1" / f"checkpoint-{SAVE}"))  # node 1's own copy
    assert resumed.session.resumed_from == (SAVE, 2) and resumed.state.global_step == 3
