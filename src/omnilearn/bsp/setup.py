"""``omnilearn.setup()``: join the process group, resolve the batch, open a :class:`~omnilearn.bsp.session.Session`.

The world size is known only after joining, so the batch may be given per
worker (``local_batch``) as well as in total (``global_batch``).

Stop signals (``handle_signals=True``, the default): once the session is
open, SIGTERM -- and SIGINT where the group has more than one rank -- set
``ol.should_stop`` at the next control interval end on every rank instead
of killing the process (:mod:`omnilearn.stopping`; a handler of your own is
chained, not replaced). A lone process keeps Ctrl-C as ``KeyboardInterrupt``
(a notebook's interrupt, pytest). Why this is the default: docs/failures.md.

Run: ``python -m pytest -q tests/dist/test_api.py tests/faults/test_api_stops.py``
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from omnilearn import stopping
from omnilearn.bsp import rescue
from omnilearn.bsp.session import Session
from omnilearn.config import BalanceConfig, ConfigError, api_wording, dump_toml
from omnilearn.distributed import group
from omnilearn.keywords import KEYWORDS, check_keywords, for_world
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
    alone). Mistakes raise :class:`~omnilearn.config.ConfigError`, one line
    naming the keyword.
    """
    try:
        session = _setup(config, total_steps, local_batch, handle_signals, settings)
    except ConfigError as e:
        raise ConfigError(api_wording(str(e), KEYWORDS)) from None
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
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0  # torchrun restarted this job
        run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg), keep=restarted, hold=True)  # a re-run may resume
    return Session(cfg, ctx, run_dir, total_steps)
