"""Both Lightning doors in one process: resume checks, the batch taken from the DataLoader, Trainer flags refused.

- A checkpoint resumed with another ``seed`` or another dataset length is
  refused in one line naming the door and its keyword (the core's check,
  ``Session.load_state_dict``, reached through ``fit(ckpt_path=...)`` and
  ``fabric.load``).
- No batch setting: ``OmniLearnStrategy`` trains at the ``DataLoader``'s
  ``batch_size`` x ``accumulate_grad_batches`` per process;
  ``OmniLearnFabricStrategy`` refuses a ``DataLoader`` that disagrees with
  its session's batch, naming the ``local_batch`` that matches.
- Trainer flags the strategy cannot honour are refused in one line:
  a ``GradScaler`` precision, ``sync_batchnorm``, ``limit_train_batches``,
  ``fast_dev_run``, ``overfit_batches``.

Run: ``python -m pytest -q tests/dist/test_lightning_resume.py`` (about 15 s).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from omnilearn.config import ConfigError

pl = pytest.importorskip("lightning.pytorch")
from lightning.fabric import Fabric  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from omnilearn.integrations.lightning import OmniLearnStrategy  # noqa: E402
from omnilearn.integrations.lightning_fabric import OmniLearnFabricStrategy  # noqa: E402
from test_lightning_exact import Net, data, fresh_port, mlp  # noqa: E402,F401  (fresh_port: autouse)

pytestmark = pytest.mark.dist


def fit(strategy: OmniLearnStrategy, samples: int = 360, steps: int = 3, ckpt: str | None = None, batch_size: int = 16,
        **flags) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, **flags)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Net(), DataLoader(data(samples), batch_size=batch_size, shuffle=True), ckpt_path=ckpt)
    return trainer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Lightning checkpoint at step 3 (seed 0, 360 samples, global batch 60)."""
    path = tmp_path_factory.mktemp("lightning_resume") / "step3.ckpt"
    with pytest.MonkeyPatch.context() as m:
        m.delenv("MASTER_PORT", raising=False)
        fit(OmniLearnStrategy(global_batch=60, seed=0)).save_checkpoint(path)
    return str(path)


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_lightning_resume_with_another_seed_is_refused_naming_the_strategys_keyword(saved):
    with pytest.raises(ConfigError) as error:
        fit(OmniLearnStrategy(global_batch=60, seed=1), ckpt=saved, steps=6)
    message = one_line(error)
    assert message.startswith("OmniLearnStrategy cannot resume this checkpoint: "), message
    assert "saved with seed 0 but this run has seed 1" in message and "seed=0 (an OmniLearnStrategy keyword)" in message


def test_lightning_resume_with_another_dataset_length_is_refused(saved):
    with pytest.raises(ConfigError, match=r"OmniLearnStrategy cannot resume .*saved with data size 360 but this run "
                                          r"has data size 300") as error:
        fit(OmniLearnStrategy(global_batch=60, seed=0), samples=300, ckpt=saved, steps=6)
    one_line(error)


def fabric_loop(strategy: OmniLearnFabricStrategy, save: str | None = None, load: str | None = None,
                batch_size: int = 16, samples: int | None = None, finish: bool = True) -> tuple:
    """Two steps of a Fabric loop (after ``load``, before ``save``; ``finish``: the session's end after):
    ``(fabric, model, optimizer)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1, precision="64-true")
        fabric.launch()
        model = mlp()
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = DataLoader(data() if samples is None else data(samples), batch_size=batch_size, shuffle=True)
        train = fabric.setup_dataloaders(loader)
        if load is not None:
            fabric.load(load, {"model": model, "optimizer": opt})
        for x, y in train:
            fabric.backward(F.cross_entropy(model(x).double(), y))
            opt.step()
            opt.zero_grad()
            if strategy.session.steps_done == 2:
                break
        if save is not None:
            fabric.save(save, {"model": model, "optimizer": opt})
        if finish:
            strategy.session.finish()
    return fabric, model, opt


def test_fabric_resume_with_another_seed_is_refused_naming_the_strategys_keyword(tmp_path):
    path = str(tmp_path / "fabric.ckpt")
    fabric_loop(OmniLearnFabricStrategy(global_batch=60, seed=0, total_steps=6), save=path)
    with pytest.raises(ConfigError) as error:
        fabric_loop(OmniLearnFabricStrategy(global_batch=60, seed=1, total_steps=6), load=path)
    message = one_line(error)
    assert message.startswith("OmniLearnFabricStrategy cannot resume this checkpoint: "), message
    assert "seed=0 (an OmniLearnFabricStrategy keyword)" in message, message


def test_a_one_process_fit_or_fabric_loop_opens_no_socket_the_network_reaches_and_leaks_none():
    """``devices=1``, no launcher: the group of one is made on an in-memory store (lightning_session); the
    framework's own would be torch's TCPStore, listening on every interface and left open after each fit. The
    group's own gloo socket stays: no more with more fits. (A group no one holds any more, in a reference cycle of its
    own, closes at the next garbage collection: the count is read after one. Without it, whether the last fit's
    group was collected yet depended on the tests that ran before in the process.)"""
    import gc
    import os

    import listeners

    def ports(found) -> set[int]:
        return {s["port"] for s in found}

    def listening() -> set[int]:  # a group nobody holds any more, in a cycle of its own, closes at a collection
        gc.collect()
        return ports(listeners.listening([os.getpid()]))

    before = ports(listeners.exposed([os.getpid()]))
    fit(OmniLearnStrategy(global_batch=60, seed=0))
    fabric_loop(OmniLearnFabricStrategy(global_batch=64, seed=0))
    first = listening()
    fit(OmniLearnStrategy(global_batch=60, seed=0))
    fabric_loop(OmniLearnFabricStrategy(global_batch=64, seed=0))
    assert listening() == first
    assert ports(listeners.exposed([os.getpid()])) - before == set()


def test_no_batch_setting_takes_the_dataloaders_batch_size_times_accumulation():
    trainer = fit(OmniLearnStrategy(), batch_size=8, accumulate_grad_batches=2)
    assert trainer.strategy.session.global_batch == 16  # DataLoader(batch_size=8) x accumulate_grad_batches=2 x 1


class WithHook(Net):
    def train_dataloader(self):
        return DataLoader(data(), batch_size=12, shuffle=True)


def test_no_batch_setting_reads_a_train_dataloader_hook_too():
    trainer = pl.Trainer(strategy=OmniLearnStrategy(), accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(WithHook())
    assert trainer.strategy.session.global_batch == 12


def test_fabric_without_a_batch_setting_refuses_a_dataloader_that_disagrees():
    with pytest.raises(ConfigError, match=r"OmniLearnFabricStrategy got no global_batch or local_batch, so "
                                          r"OmniLearn's global batch is 32, but DataLoader\(batch_size=16\) x "
                                          r"accumulation_steps=1 x 1 processes is 16: give "
                                          r"OmniLearnFabricStrategy\(local_batch=16\)"):
        fabric_loop(OmniLearnFabricStrategy(total_steps=6))
    fabric_loop(OmniLearnFabricStrategy(total_steps=6), batch_size=32)  # agrees with the default: trains


@pytest.mark.parametrize("flags, refused", [
    ({"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]},
     r"Trainer\(precision='16-mixed'\) uses a GradScaler"),
    ({"sync_batchnorm": True}, r"Trainer\(sync_batchnorm=True\) is not supported by OmniLearnStrategy"),
    ({"limit_train_batches": 0.5}, r"Trainer\(limit_train_batches=0.5\) is not supported.*Trainer\(max_steps=N\)"),
    ({"limit_train_batches": 1}, r"Trainer\(limit_train_batches=1\) is not supported"),
    ({"fast_dev_run": 2}, r"Trainer\(fast_dev_run=2\) is not supported"),
    ({"overfit_batches": 2}, r"Trainer\(overfit_batches=2\) is not supported"),
])
def test_trainer_flags_the_strategy_cannot_honour_are_refused(flags, refused):
    with pytest.raises(ConfigError, match=refused) as error:
        fit(OmniLearnStrategy(global_batch=60), **flags)
    one_line(error)
