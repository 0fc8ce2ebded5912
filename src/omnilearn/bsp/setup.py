"""``omnilearn.setup()``: join the process group, resolve the batch, open a :class:`~omnilearn.bsp.session.Session`.

The world size is known only after joining, so the batch may be given per
worker (``local_batch``) as well as in total (``global_batch``).

Run: ``python -m pytest -q tests/dist/test_api.py``
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnilearn.bsp.session import Session
from omnilearn.config import BalanceConfig, ConfigError, dump_toml
from omnilearn.distributed import group
from omnilearn.observe.rundir import prepare

DEFAULT_LOCAL_BATCH = 32  # samples per worker per step when neither global_batch nor local_batch is given


def setup(config: BalanceConfig | None = None, *, total_steps: int | None = None, local_batch: int | None = None,
          **settings: Any) -> Session:
    """Join the process group (existing, torchrun's, or none) and start balancing.

    ``settings`` are :class:`~omnilearn.config.BalanceConfig` fields. The
    batch: ``global_batch=B`` (all workers together), or ``local_batch=b``
    (per worker: ``B = b x world size``, known only after joining), not both;
    neither: ``local_batch=32``. ``total_steps`` bounds the run (needed for
    ``speed_schedule="paper"``).
    """
    if local_batch is not None and "global_batch" in settings:
        raise ConfigError(f"global_batch={settings['global_batch']} and local_batch={local_batch} both given; "
                          "give one (global_batch = local_batch x workers)")
    if local_batch is not None and (type(local_batch) is not int or local_batch < 1):
        raise ConfigError(f"local_batch={local_batch!r} must be a positive integer (samples per worker per step)")
    cfg = dataclasses.replace(config, **settings) if config is not None else BalanceConfig(**settings)
    ctx = group.join(cfg.device, cfg.timeout_s)
    if cfg.workers is not None and cfg.workers != ctx.world_size:
        raise ConfigError(f"workers={cfg.workers} but the process group has {ctx.world_size}; drop workers")
    if local_batch is None and config is None and "global_batch" not in settings:
        local_batch = DEFAULT_LOCAL_BATCH
    per_worker = {} if local_batch is None else {"global_batch": local_batch * ctx.world_size}
    try:
        cfg = dataclasses.replace(cfg, workers=ctx.world_size, **per_worker)
    except ConfigError as e:
        why = f"local_batch={local_batch} x {ctx.world_size} workers: {e}" if per_worker else str(e)
        raise ConfigError(why) from None
    run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg)) if cfg.out is not None and ctx.is_main else None
    return Session(cfg, ctx, run_dir, total_steps)
