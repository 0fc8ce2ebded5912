"""``OmniLearnStrategy``'s settings in one process: what reaches DDP and the DataLoader, and what is refused.

- Strategy keywords go to Lightning's ``DDPStrategy``, to DDP (``Session.wrap_model``)
  or to ``omnilearn.setup()``; ``accumulation_steps``, ``total_steps``,
  ``device``, DDP comm hooks, DDP's ``mixed_precision`` and delayed all-reduce,
  and buffer broadcasting are refused in one line
  naming the route that works (the 2-rank run in ``test_lightning_exact.py``
  checks that DDP arguments reach the wrapped model).
- The training ``DataLoader``'s ``worker_init_fn``, ``pin_memory`` and
  ``num_workers`` reach the session's loader; ``shuffle=False``, two
  optimizers, an ``accumulate_grad_batches`` that changes during fit, and a
  resume from a checkpoint without OmniLearn's state are refused.
- Manual optimization with one optimizer steps as automatic optimization does.
- A stream (``IterableDataset``) trains to ``max_steps``; without ``max_steps`` it is refused.

Run: ``python -m pytest -q tests/dist/test_lightning_strategy.py`` (about 20 s).
"""

from __future__ import annotations

import functools
import warnings
from datetime import timedelta

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from omnilearn.config import ConfigError

pl = pytest.importorskip("lightning.pytorch")
from omnilearn.integrations.lightning import OmniLearnStrategy  # noqa: E402
from omnilearn.integrations.lightning_options import split_options  # noqa: E402
from test_lightning_exact import Net, data, fresh_port  # noqa: E402,F401  (fresh_port: autouse)

pytestmark = pytest.mark.dist


def run(loader: DataLoader, model: pl.LightningModule | None = None, ckpt: str | None = None, steps: int = 3,
        callbacks=(), strategy: pl.strategies.Strategy | None = None, accumulate: int = 1) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy or OmniLearnStrategy(global_batch=60), accelerator="cpu", devices=1,
                         max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=list(callbacks), accumulate_grad_batches=accumulate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model or Net(), loader, ckpt_path=ckpt)
    return trainer


@pytest.mark.parametrize("keyword, route", [
    ("accumulation_steps", "Trainer\\(accumulate_grad_batches=K\\)"), ("total_steps", "Trainer\\(max_steps=N\\)"),
    ("device", "Trainer\\(accelerator=..., devices=...\\)"), ("ddp_comm_hook", "which a comm hook would replace"),
    ("broadcast_buffers", "averages buffers"), ("bogus", "unknown keyword bogus"),
    ("mixed_precision", "casts the gradients in a comm hook of its own"), ("delay_all_reduce_named_params", "outside the step's timing"),
    ("param_to_hook_all_reduce", "outside the step's timing"),
])
def test_keywords_omnilearn_cannot_honour_are_refused_naming_the_route(keyword, route):
    with pytest.raises(ConfigError, match=route):
        OmniLearnStrategy(**{keyword: 2})


def test_keywords_go_to_lightning_ddp_and_omnilearn():
    lightning, ddp, settings = split_options({"timeout": timedelta(seconds=9), "find_unused_parameters": True,
                                              "bucket_cap_mb": 1, "global_batch": 8, "speeds": "3,1",
                                              "broadcast_buffers": False})
    assert lightning == {"timeout": timedelta(seconds=9)}
    assert ddp == {"find_unused_parameters": True, "bucket_cap_mb": 1}
    assert settings == {"global_batch": 8, "speeds": "3,1"}


def _mark(path, worker_id: int) -> None:
    path.write_text(f"worker {worker_id}")


def test_dataloader_worker_init_fn_and_pin_memory_reach_the_sessions_loader(tmp_path):
    marker = tmp_path / "worker_init_fn_ran"
    loader = DataLoader(data(), batch_size=16, shuffle=True, num_workers=1, pin_memory=True,
                        worker_init_fn=functools.partial(_mark, marker))
    trainer = run(loader)
    built = trainer.strategy.session.loader.loader
    assert built.num_workers == 1 and built.pin_memory is True and built.worker_init_fn is loader.worker_init_fn
    assert marker.read_text() == "worker 0"


def test_training_loader_without_shuffle_is_refused():
    with pytest.raises(ConfigError, match=r"DataLoader\(shuffle=False\) for training.*pass shuffle=True"):
        run(DataLoader(data(), batch_size=16))


class TwoOptimizers(Net):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()

    automatic_optimization = False


def test_two_optimizers_are_refused():
    with pytest.raises(ConfigError, match="returned 2 optimizers: OmniLearnStrategy takes one"):
        run(DataLoader(data(), batch_size=16, shuffle=True), model=TwoOptimizers())


def test_accumulate_grad_batches_changing_during_fit_is_refused():
    schedule = pl.callbacks.GradientAccumulationScheduler({0: 1, 1: 2})
    with pytest.raises(ConfigError, match="accumulate_grad_batches changed to 2 during fit"):
        run(DataLoader(data(120), batch_size=16, shuffle=True), steps=4, callbacks=[schedule])


def test_resume_from_a_checkpoint_without_omnilearn_state_is_refused(tmp_path):
    loader = DataLoader(data(), batch_size=60, shuffle=True)
    plain = run(loader, strategy="auto")
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(ConfigError, match="global_step is 3 but OmniLearn's session is at step 0"):
        run(loader, ckpt=str(tmp_path / "plain.ckpt"), steps=6)


class Manual(Net):
    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


def test_manual_optimization_with_one_optimizer_steps_as_automatic_does():
    loader = DataLoader(data(), batch_size=16, shuffle=True)
    automatic, manual = Net(), Manual()
    run(loader, model=automatic)
    trainer = run(loader, model=manual)
    assert trainer.global_step == trainer.strategy.session.steps_done == 3
    for k, v in automatic.net.state_dict().items():
        assert torch.equal(v, manual.net.state_dict()[k]), k


class Stream(IterableDataset):
    def __iter__(self):
        x, y = data().tensors
        return zip(x, y)


def test_a_stream_trains_to_max_steps_and_without_it_is_refused():
    trainer = run(DataLoader(Stream(), batch_size=16), steps=5)
    assert trainer.global_step == trainer.strategy.session.steps_done == 5
    refused = r"a stream \(Stream, no length\): give the run's length, Trainer\(max_steps=N\)"
    with pytest.raises(ConfigError, match=refused):
        run(DataLoader(Stream(), batch_size=16), steps=-1)


def test_a_model_sharded_with_fully_shard_is_refused_naming_the_route(monkeypatch):
    from omnilearn.bsp import sharded
    from omnilearn.integrations.lightning_options import refuse_sharded

    refuse_sharded(torch.nn.Linear(2, 2), "OmniLearnStrategy")  # not sharded: nothing to say
    monkeypatch.setattr(sharded, "is_sharded", lambda model: True)  # as fully_shard's FSDPModule is
    with pytest.raises(ConfigError, match=r"sharded with fully_shard \(FSDP2\), which OmniLearnStrategy cannot "
                                          r"balance: train it in your own loop with ol.wrap_model\(model\)"):
        refuse_sharded(torch.nn.Linear(2, 2), "OmniLearnStrategy")
