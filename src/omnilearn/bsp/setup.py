"""``omnilearn.setup()``: join the process group, resolve the batch, open a :class:`~omnilearn.bsp.session.Session`.

The world size is known only after joining, so the batch may be given per
worker (``local_batch``) as well as in total (``global_batch``).

Stop signals (``handle_signals=True``, the default): once the session is
open, SIGTERM -- and SIGINT where the group has more than one rank -- set
``ol.should_stop`` at the next control interval end on every rank instead
of killing the process (:mod:`omnilearn.stopping`; a handler of your own is
chained, not replaced). A lone process keeps Ctrl-C as ``KeyboardInterrupt``
(a notebook's interrupt, pytest). Why this is the default: docs/failures.md.
Python installs signal handlers from the main thread only: elsewhere
``handle_signals=True`` is refused in one line naming ``handle_signals=False``.

In a Ray Train training function (Ray's thread of each worker) the session
joins Ray's group and leaves signals and restarts to Ray, whatever
``handle_signals`` says (:func:`omnilearn.integrations.ray.adopt`; docs/ray.md).

Run: ``python -m pytest -q tests/dist/test_api.py tests/faults/test_api_stops.py tests/ray/``
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnilearn import stopping
from omnilearn.bsp import rescue
from omnilearn.bsp.session import Session
from omnilearn.config import BalanceConfig, ConfigError, api_wording, dump_toml
from omnilearn.distributed import group
from omnilearn.integrations import ray as ray_door
from omnilearn.keywords import KEYWORDS, check_keywords, for_world
from omnilearn.observe import samejob
from omnilearn.observe.rundir import prepare
from omnilearn.torchnames import require_torch


def setup(config: BalanceConfig | None = None, *, total_steps: int | None = None, local_batch: int | None = None,
          handle_signals: bool = True, **settings: Any) -> Session:
    """Join the process group (existing, torchrun's, or none) and start balancing.

    ``settings`` are :class:`~omnilearn.config.BalanceConfig` fields. The
    batch: ``global_batch=B`` (all workers together), or ``local_batch=b``
    (per worker: ``B = b x world size``, known only after joining), not both;
    neither: ``local_batch=32``. ``total_steps`` bounds the run (needed for
    ``speed_schedule="paper"`` and for streams). ``handle_signals``: stop
    signals set ``ol.should_stop`` (module docstring; False: leave them
    alone; off the main thread it is refused). In a Ray Train worker Ray owns
    signals and restarts (:mod:`omnilearn.integrations.ray`). Mistakes raise
    :class:`~omnilearn.config.ConfigError`, one line naming the keyword.
    """
    under_ray = ray_door.in_worker()
    if handle_signals is True and not under_ray:
        stopping.refuse_off_main_thread("omnilearn.setup()")
    try:
        session = _setup(config, total_steps, local_batch, handle_signals, settings)
    except ConfigError as e:
        raise ConfigError(api_wording(str(e), KEYWORDS)) from None
    if under_ray:
        ray_door.adopt(session)  # no handlers, no survivors' save: Ray restarts from its last report (docs/ray.md)
        return session
    if handle_signals:
        stopping.handle_for_run(session.world_size, session.is_main, "omnilearn.setup()")
    if session.world_size > 1:
        rescue.guard(session)  # a lost peer's error leaving the script: this rank saves the last step first
    return session


def _setup(config: BalanceConfig | None, total_steps: int | None, local_batch: int | None, handle_signals: bool,
           settings: dict[str, Any]) -> Session:
    require_torch(door="omnilearn.setup")  # the private names of torch we rely on (docs/versions.md)
    check_keywords("omnilearn.setup()", settings, local_batch, handle_signals)
    first = dataclasses.replace(config, **settings) if config is not None else BalanceConfig(**settings)
    ctx = group.join(first.device, first.timeout_s)
    cfg = for_world(config, settings, local_batch, ctx.world_size)
    run_dir = None
    if cfg.out is not None and ctx.is_main:
        restarted = samejob.restarted() or ray_door.resuming()  # torchrun or Ray Train restarted this job
        again = samejob.again(cfg.out) and not restarted  # torchrun re-formed it (a node joined), or launched again
        if again and not cfg.overwrite:
            samejob.say_again(cfg.out, "held until ol.load_checkpoint resumes it, dropped if the run starts afresh")
        run_dir = prepare(cfg.out, cfg.overwrite or again, dump_toml(cfg), keep=restarted, hold=True)  # may resume
        samejob.mark(run_dir)
    return Session(cfg, ctx, run_dir, total_steps)
