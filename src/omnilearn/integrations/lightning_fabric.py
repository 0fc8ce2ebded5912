"""Lightning Fabric: ``Fabric(strategy=OmniLearnFabricStrategy(...))`` balances a custom training loop.

    from omnilearn.integrations.lightning_fabric import OmniLearnFabricStrategy
    fabric = Fabric(strategy=OmniLearnFabricStrategy(global_batch=256, speeds="3,1", accumulation_steps=2,
                                                     total_steps=1000), accelerator="cpu", devices=2)
    fabric.launch()
    model, opt = fabric.setup(model, opt)
    train, val = fabric.setup_dataloaders(train_loader, val_loader)   # train: shuffle=True
    for i, (x, y) in enumerate(train):                                # K micro-batches per step, one by one
        accumulating = (i + 1) % 2 != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(loss_fn(model(x), y))
        if not accumulating:
            opt.step(); opt.zero_grad()                               # OmniLearn's step ends here
    fabric.save(path, {"model": model, "optimizer": opt})             # the session's state rides along

Fabric's DDP strategy with an OmniLearn session inside (one per strategy):

- ``fabric.setup(model, ...)`` opens the session (:func:`omnilearn.setup`
  joins Fabric's group) and wraps the model (``Session.wrap_model``, DDP
  keyword arguments included); Lightning versions outside the tested range
  are refused there (:func:`omnilearn.versions.require_tested`);
- ``fabric.setup_dataloaders``: the shuffled loader is the training data
  (:func:`~omnilearn.integrations.lightning_data.training_loader`: each step
  this worker's share, ``accumulation_steps`` micro-batches one by one, a
  whole epoch's ``len()``; with no ``global_batch``/``local_batch``, one whose
  ``batch_size`` x ``accumulation_steps`` x processes is not the session's
  batch is refused, naming the ``local_batch`` that matches); unshuffled
  loaders are sharded, disjoint, over the ranks (no sample twice; reduce
  sums and counts, not means). Fabric's own
  ``DistributedSampler`` is not injected;
- ``fabric.backward(loss)`` is ``Session.backward`` (exact weights; the
  session decides which micro-batch syncs): ``fabric.no_backward_sync`` only
  checks that the loop skips the sync where the session does, and raises
  where they disagree (``model.no_sync()`` itself is refused);
- ``optimizer.step()`` then ``Session.step()``: the controller may move batches;
- ``fabric.save`` adds the session's state (every rank's part, gathered on
  rank 0) under ``"omnilearn"``, written atomically to a local path with Fabric's default checkpoint IO
  (:func:`~omnilearn.integrations.lightning_save.write_local`); ``fabric.load(path, state)`` restores it, so
  the training loader continues where it stopped (at another world size too);
  one saved with another seed, dataset length or steps per epoch is refused
  in one line naming the strategy's keyword;
- a peer that dies: a survivor writes the last completed step to the path of
  ``strategy.save_on_failure(path, state)`` or of the last ``fabric.save`` /
  ``fabric.load`` (that call's ``state``, this rank's part of the session's), alone and atomically
  (:func:`~omnilearn.integrations.lightning_rescue.write_newest`); the
  restarted loop's ``fabric.load(path, state)`` resumes there.

The loop's length is the session's (``total_steps``); ``strategy.session``
is the :class:`~omnilearn.bsp.session.Session` (``finish()`` for the summary,
``should_stop``). Refused: a ``GradScaler`` precision (``16-mixed``), DDP's
``mixed_precision`` and delayed all-reduce, extra
``backward`` arguments, a second model.

Run: ``python -m pytest -q tests/dist/test_lightning_fabric.py tests/dist/test_lightning_resume.py
tests/dist/test_lightning_atomic.py``
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

try:
    from lightning.fabric.strategies import DDPStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("omnilearn.integrations.lightning_fabric needs Lightning: pip install lightning") from e
import torch
from torch.utils.data import DataLoader, RandomSampler

import omnilearn
from omnilearn.config import ConfigError
from omnilearn.bsp.checkpointing import gathered_state, session_state
from omnilearn.integrations.lightning import STATE_KEY
from omnilearn.integrations.lightning_save import local_target, write_local
from omnilearn.integrations.lightning_data import evaluation_loader, training_loader
from omnilearn.integrations.lightning_rescue import write_newest
from omnilearn.integrations.lightning_options import FABRIC_ARGS, FABRIC_TAKES, refuse_sharded, split_options
from omnilearn.integrations.lightning_session import check_loader_batch, join_round_group, load_resumed
from omnilearn.versions import require_tested


class _SessionSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the session syncs on each step's last micro-batch; the loop must agree."""

    def __init__(self, strategy: "OmniLearnFabricStrategy") -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: Any, enabled: bool):
        micro = self.strategy.session.micro
        k, j = len(micro.sizes), micro.done
        if enabled == (j == k - 1):
            what = "skips" if enabled else "does not skip"
            raise RuntimeError(f"fabric.no_backward_sync(enabled={enabled}) {what} the sync of micro-batch {j + 1} of "
                               f"{k}: OmniLearn syncs each step's last micro-batch only (accumulation_steps="
                               f"{micro.steps}); skip it for the first {k - 1} of every {k}")
        return nullcontext()  # the session sets DDP's require_backward_grad_sync itself


class OmniLearnFabricStrategy(DDPStrategy):
    """Fabric's DDP strategy with OmniLearn's balanced batches, weighted gradients and controller."""

    def __init__(self, **options: Any) -> None:
        fabric, ddp_kwargs, settings = split_options(options, "OmniLearnFabricStrategy", FABRIC_ARGS, FABRIC_TAKES)
        super().__init__(**fabric, **ddp_kwargs)
        self.settings = settings
        self.session = None
        self._pending: dict | None = None  # a loaded session state waiting for the training loader
        self._backward_sync_control = _SessionSync(self)
        self._rescue_to: tuple[Any, dict, dict | None] | None = None  # (path, state, filter) of the last save/load

    def setup_environment(self) -> None:
        join_round_group(self)  # under torchrun: a group per round, so a restart re-forms it (lightning_session)
        super().setup_environment()

    @property
    def distributed_sampler_kwargs(self) -> None:
        return None  # OmniLearn shards the data itself: Fabric injects no DistributedSampler

    def setup_module(self, module):
        if self.session is not None:
            raise ConfigError("OmniLearnFabricStrategy balances one model: fabric.setup() it once (one strategy per "
                              "model)")
        if getattr(self.precision, "scaler", None) is not None:
            raise ConfigError("Fabric(precision='16-mixed') uses a GradScaler, which OmniLearnFabricStrategy does not "
                              "support; use precision='bf16-mixed', '32-true' or '64-true'")
        require_tested("lightning", door="OmniLearnFabricStrategy")
        refuse_sharded(module, "OmniLearnFabricStrategy (Fabric's DDP strategy)")
        device = "cuda" if self.root_device.type == "cuda" else "cpu"
        self.session = omnilearn.setup(device=device, **self.settings)
        self.session.rescue_with(self._rescue)  # a lost peer: a survivor saves the last step (_rescue)
        return self.session.wrap_model(module, **self._ddp_kwargs)

    def process_dataloader(self, dataloader: DataLoader) -> Any:
        if self.session is None:
            raise ConfigError("fabric.setup_dataloaders() before fabric.setup(model): set up the model first "
                              "(the session wraps it before it serves data)")
        if isinstance(dataloader, DataLoader) and type(dataloader.sampler) is RandomSampler:
            check_loader_batch(self.settings, dataloader, self.session, "OmniLearnFabricStrategy")
            loader = training_loader(self.session, dataloader)
            self._apply_pending()
            return loader
        return evaluation_loader(dataloader, self.global_rank, self.world_size, None)

    def backward(self, tensor, module, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise ConfigError(f"fabric.backward(loss, {args or ''}{kwargs or ''}): extra arguments are not supported "
                              "by OmniLearnFabricStrategy (Session.backward takes the loss only); drop them")
        self.precision.pre_backward(tensor, module)
        self.session.backward(tensor)
        self.precision.post_backward(tensor, module)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, **kwargs)
        lr = optimizer.param_groups[0].get("lr") if hasattr(optimizer, "param_groups") else None
        self.session.step(lr=float(lr) if lr is not None else None)
        return out

    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict | None = None) -> None:
        """Every rank calls it (``fabric.save``): the session's state, every rank's part, on rank 0, which writes the
        file (:func:`~omnilearn.integrations.lightning_save.write_local`, else Fabric's checkpoint IO)."""
        self._rescue_to = (path, state, filter)
        if self.session is not None and self.session.rescued is not None:
            return  # a peer is gone: this rank saved already, and this save's collectives would fail
        if self.session is not None and self.session.loader is not None:
            if not self.session.interval_ended:
                self.session.sync_buffers()
            state = {**state, STATE_KEY: gathered_state(self.session)}
        target = local_target(self.checkpoint_io, path, storage_options) if self.is_global_zero else None
        if target is None:
            super().save_checkpoint(path, state, storage_options, filter)
        else:  # as Fabric's Strategy.save_checkpoint, written atomically
            write_local(target, self._convert_stateful_objects_in_state(state, filter=filter or {}))

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: bool | None = None) -> dict:
        if state:
            self._rescue_to = (path, state, None)
        remainder = super().load_checkpoint(path, state, strict, weights_only)
        if state and STATE_KEY in remainder:
            self._pending = remainder.pop(STATE_KEY)
            if self.session is not None and self.session.loader is not None:
                self._apply_pending()
        return remainder

    def save_on_failure(self, path, state: dict[str, Any]) -> None:
        """Where, and what, a survivor saves if a peer dies: ``path`` and ``state`` as ``fabric.save`` takes them
        (what the restarted loop's ``fabric.load(path, state)`` reads). Each ``fabric.save``/``fabric.load`` sets
        it too."""
        if not isinstance(path, (str, Path)) or not isinstance(state, dict):
            raise TypeError(f"save_on_failure(path={path!r}, state={type(state).__name__}): give a path and the "
                            "state dict fabric.save takes ({'model': model, 'optimizer': optimizer, ...})")
        self._rescue_to = (path, state, None)

    def _rescue(self, step: int) -> str:
        """A peer died (:mod:`omnilearn.bsp.rescue`): the objects of the last ``fabric.save``/``fabric.load`` to its
        path, with this rank's session state, written alone (no collective)."""
        if self._rescue_to is None:
            return ("nothing was saved: the loop never called strategy.save_on_failure(path, state), fabric.save or "
                    "fabric.load; a restart resumes from the last checkpoint")
        path, state, keep = self._rescue_to
        full = {**self._convert_stateful_objects_in_state(state, filter=keep or {}),
                STATE_KEY: session_state(self.session, rows=False)}
        return write_newest(Path(path), step, time.time(), lambda f: torch.save(full, f), "fabric.load(path, state)")

    def _apply_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            load_resumed(self.session, pending, "OmniLearnFabricStrategy")  # after wrap_model and data_loader
