"""Ray Train: ``omnilearn.setup()`` inside ``TorchTrainer``'s training function; checkpoints through Ray's reports.

    import omnilearn
    from omnilearn.integrations import ray as ol_ray

    def train_fn(config):                                  # Ray runs it in a thread of every worker
        ol = omnilearn.setup(global_batch=256)             # joins the process group Ray made
        model = ol.wrap_model(Net())                       # not ray.train.torch.prepare_model (refused)
        loader = ol.data_loader(dataset)                   # not ray.train.torch.prepare_data_loader (refused)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ol_ray.resume(ol, model=model, optimizer=opt)      # Ray's last checkpoint, at whatever count Ray restarts
        for epoch in range(ol.epoch, epochs):
            loader.set_epoch(epoch)
            for x, y in loader:
                ...                                        # forward, backward, opt.step(), as usual
                ol.step()
                ol_ray.report(ol, {"loss": loss.item()}, model=model, optimizer=opt, every=100)
        ol.finish()
        ol.close()

    TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=(2, 8)),
                 run_config=RunConfig(storage_path="/shared/runs", failure_config=FailureConfig(max_failures=3),
                                      checkpoint_config=CheckpointConfig(num_to_keep=2)))  # else Ray keeps them all

What the door does (docs/ray.md has the design and the figures):

- ``omnilearn.setup()`` in a Ray Train worker (:func:`in_worker`) adopts the group Ray made and installs no stop
  signal handlers (the function runs off the main thread, and Ray owns its workers' lives: it stops and restarts
  the whole group). :func:`adopt` arms no survivors' save either: Ray restarts a group that lost a worker from
  the last *reported* checkpoint, so a survivor's own file would never be read; a survivor's line says which step
  the restart resumes from. ``ray.train.torch.prepare_model`` / ``prepare_data_loader`` are refused in one line
  while a session is open (a second DDP averaging the weighted gradients; an equal-share sampler).
- :func:`report` every ``every`` steps (and at the run's last): the session's own checkpoint
  (``ol.save_checkpoint``, the same file as anywhere) written to a temporary directory, handed to
  ``ray.train.report`` by rank 0, and, with ``wait=True``, waited for until Ray has committed it. A lost worker
  then costs exactly the steps since the last report, the step in flight included: ``every=1`` makes it one step,
  for the time of one save and one report a step (docs/ray.md, "What a report costs").
- :func:`resume` loads ``ray.train.get_checkpoint()`` through ``ol.load_checkpoint``: rank 0 reads the file and
  sends its bytes to the others; saved at another worker count (an elastic resize), the run goes on from the same
  step with the same global batches, re-split over the new workers.

Run: ``python -m pytest -q tests/ray/``
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from omnilearn.config import ConfigError
from omnilearn.versions import require_tested

DOOR = "omnilearn.integrations.ray"
PREPARE_REFUSED = {  # Ray's own data-parallel helpers, what they would break, and the supported route
    "prepare_model": "it wraps the model in a second DDP (or FSDP) that would average OmniLearn's weighted "
                     "gradients again; use model = ol.wrap_model(model) alone (it moves the model to ol.device too)",
    "prepare_data_loader": "its DistributedSampler gives every worker an equal share of each batch; use loader = "
                           "ol.data_loader(dataset) (each worker's balanced share of every global batch; move the "
                           "batches to ol.device)",
}


@dataclass
class Reports:
    """What the door knows of one session's reports."""

    step: int | None = None  # the step of the last checkpoint Ray holds (reported, or resumed from)


_REPORTS: "weakref.WeakKeyDictionary[Any, Reports]" = weakref.WeakKeyDictionary()
_ADOPTED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # open sessions of this process: prepare_* are refused


def in_worker() -> bool:
    """Whether this code runs in a Ray Train training function (never imports Ray: only if it is loaded)."""
    train = sys.modules.get("ray.train")
    get_context = getattr(train, "get_context", None)
    if get_context is None:
        return False
    try:
        get_context()
    except Exception:  # Ray's RuntimeError outside a training function (the driver, a task)
        return False
    return True


def resuming() -> bool:
    """Whether this Ray Train run restarts from a checkpoint (a run directory from its first attempt is kept)."""
    if not in_worker():
        return False
    import ray.train

    return ray.train.get_checkpoint() is not None


def adopt(session) -> None:
    """What ``omnilearn.setup()`` does in a Ray Train worker, after the session joined Ray's group (module docstring):
    the survivors' line says where Ray's restart resumes, Ray's prepare_* are refused, rank 0 says so once."""
    reports = _checked(session, "omnilearn.setup()")
    session.rescue_with(lambda step: _restart_line(reports, step))
    _ADOPTED.add(session)
    _refuse_prepare()
    if session.is_main:
        print(f"omnilearn: in a Ray Train worker ({session.world_size} workers): Ray owns the workers' lives, so no "
              "stop-signal handlers and no survivors' save; a lost or added worker restarts the group from the last "
              "omnilearn.integrations.ray.report (docs/ray.md)", file=sys.stderr, flush=True)


def _restart_line(reports: Reports, step: int) -> str:
    if reports.step is None:
        return "nothing was saved: Ray Train restarts the group from its start (no report yet)"
    redo = step - reports.step
    return (f"nothing was saved: Ray Train restarts the group from the last report, step {reports.step} "
            f"({redo} completed step{'' if redo == 1 else 's'} to redo)")


def report(ol, metrics: dict | None = None, *, model, optimizer=None, scheduler=None, extra: dict | None = None,
           every: int = 100, wait: bool = True) -> bool:
    """Call after every ``ol.step()`` on every worker: every ``every`` steps (and at the run's last) a checkpoint.

    ``ol.save_checkpoint`` into a temporary directory, then ``ray.train.report(row, checkpoint=...)`` (rank 0 gives
    the checkpoint; ``row`` is ``metrics`` with ``step``, ``workers``, ``epoch`` and every worker's ``batches``).
    ``wait``: return once Ray has committed the report (``ray.train.get_all_reported_checkpoints(COMMITTED)``), so
    a worker lost after it costs only the steps since. True when it reported.
    """
    reports = _checked(ol, "report()")  # a dictionary look-up once checked: this runs every step
    if type(every) is not int or every < 1:
        raise ConfigError(f"{DOOR}.report(every={every!r}): give the steps between reports, a positive int")
    total = getattr(ol.run, "total_steps", None)
    if reports.step == ol.next_step or (ol.next_step % every and ol.next_step != total):
        return False
    import ray.train

    directory = Path(tempfile.mkdtemp(prefix="omnilearn-ray-"))
    try:
        ol.save_checkpoint(directory, model=model, optimizer=optimizer, scheduler=scheduler, extra=extra, keep=1)
        row = {**(metrics or {}), "step": ol.next_step, "workers": ol.world_size, "epoch": ol.epoch,
               "batches": list(ol.batches)}
        checkpoint = ray.train.Checkpoint.from_directory(str(directory)) if ol.is_main else None
        ray.train.report(row, checkpoint=checkpoint)
        if wait:
            from ray.train import CheckpointConsistencyMode

            ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    reports.step = ol.next_step
    return True


def resume(ol, *, model, optimizer=None, scheduler=None) -> bool:
    """Load Ray's checkpoint (``ray.train.get_checkpoint()``) into the session and objects; False when there is none.

    Call it on every worker after ``wrap_model()`` and ``data_loader()``, before training: rank 0 reads the file and
    sends its bytes to the others (``ol.load_checkpoint``), whatever worker count saved it.
    """
    reports = _checked(ol, "resume()")
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return False
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    if ol.is_main:
        with checkpoint.as_directory() as directory:
            loaded = ol.load_checkpoint(directory, **objects)
    else:  # only rank 0 reads: no copy of a remote checkpoint on the other workers
        loaded = ol.load_checkpoint(checkpoint.path, **objects)
    if loaded:
        reports.step = ol.next_step
    return loaded


def _checked(session, what: str) -> Reports:
    """The door's record of ``session``; the first time, after checking that this is a Ray Train worker and that
    Ray's version is one the door was tested with (one line each, else)."""
    reports = _REPORTS.get(session)
    if reports is None:
        if not in_worker():
            raise ConfigError(f"{DOOR}: {what} outside a Ray Train training function (the function given to "
                              "TorchTrainer): use ol.save_checkpoint / ol.load_checkpoint there")
        require_tested("ray", door=DOOR)
        reports = _REPORTS.setdefault(session, Reports())
    return reports


def _refuse_prepare() -> None:
    """Replace Ray's ``prepare_model`` / ``prepare_data_loader`` where a training function looks them up
    (``ray.train.torch.<name>``, and the module they come from) with one that refuses while a session is open."""
    import ray.train.torch as ray_torch

    modules = {ray_torch, sys.modules.get(getattr(getattr(ray_torch, "prepare_model", None), "__module__", ""))}
    for module in (m for m in modules if m is not None):
        for name, why in PREPARE_REFUSED.items():
            original = getattr(module, name, None)
            if original is not None and not getattr(original, "omnilearn_refuses", False):
                setattr(module, name, _refusing(name, why, original))


def _refusing(name: str, why: str, original: Callable) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        if not _ADOPTED:  # no OmniLearn session open in this process: Ray's own
            return original(*args, **kwargs)
        raise ConfigError(f"ray.train.torch.{name}() in an OmniLearn session: {why}")

    refuse.omnilearn_refuses = True  # type: ignore[attr-defined]
    refuse.__wrapped__ = original  # type: ignore[attr-defined]
    refuse.__name__ = refuse.__qualname__ = name
    return refuse
